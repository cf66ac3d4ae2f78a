#!/usr/bin/env bash
# The next GPU sitting's script (after prepare.sh; `OUT=... bash benchmarks/gpu/check3.sh`), about 6 minutes:
#  1. layer_pair.py: stock and plugin in one process, steps alternated (the small shape's 1.00x target, which
#     process-to-process noise hid in the second sitting), r = 1 at both shapes and parm-auto at the small one;
#  2. layer_modes.py stock then lina: Lina's layer after the engine fix (it hung in the second sitting);
#  3. the Megatron recipe stock and with the plugin's default section (now the ragged exchange: experts on the
#     kept rows), profiled, then one DeepSpeed recipe pair.
# Summaries go to $OUT/summary.txt as each stage ends; every log into one archive at the end.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-$PWD/gpu-out}; L=/tmp/check3-logs; mkdir -p "$OUT" "$L"
source .gpu/remote_setup.sh > /dev/null 2>&1
S="$OUT/summary.txt"; nvidia-smi -L | tee -a "$S"
pair() { timeout 120 torchrun --standalone --nproc-per-node 1 "$ROOT/benchmarks/gpu/layer_pair.py" "$@" > "$L/pair-$1-$2.log" 2>&1
  grep -h '^{' "$L/pair-$1-$2.log" | tee -a "$S" || echo "pair $* failed" | tee -a "$S"; }
pair r1 8192 768 3072 16 2 40; pair parm-auto 8192 768 3072 16 2 40; pair r1 16384 2048 8192 8 2 30
for m in stock lina; do
  STEPS=20 timeout 120 torchrun --standalone --nproc-per-node 1 "$ROOT/benchmarks/gpu/with_stacks.py" \
    "$ROOT/benchmarks/gpu/layer_modes.py" $m 8192 768 3072 16 2 /tmp/ref > "$L/modes-$m.log" 2>&1
  grep -h '^{' "$L/modes-$m.log" | tee -a "$S" || echo "layer_modes $m failed (stacks in its log)" | tee -a "$S"
done
mkdir -p /tmp/rc3 && cd /tmp/rc3
recipe() { local tag=$1 mod=$2; shift 2
  PROF_FROM=12 timeout 150 torchrun --standalone --nproc-per-node 1 "$ROOT/benchmarks/gpu/prof_recipe.py" "$mod" "$tag" -- \
    --model gpt2-moe --size gpt2 --ep 1 --out "runs/$tag" --steps 16 "$@" > "$L/recipe-$tag.log" 2>&1
  echo "$tag rc=$?" | tee -a "$S"; grep -ao "PROF .*" "$L/recipe-$tag.log" | tee -a "$S"
  grep -a "^ *aten::mm " "$L/recipe-$tag.log" | head -1 | awk '{print "  aten::mm calls", $NF, "avg", $(NF-1)}' | tee -a "$S"; }
recipe mg-stock moe_plugins.recipes.train_megatron
recipe mg-plugin moe_plugins.recipes.train_megatron --moe-plugins '{"schedule": "baseline"}'
base='"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "bf16": {"enabled": true}, "zero_optimization": {"stage": 1}'
echo "{$base}" > stock.json; echo "{$base, \"moe_plugins\": {\"schedule\": \"baseline\"}}" > r1.json
recipe ds-stock moe_plugins.recipes.train_deepspeed --ds-config stock.json --no-plugins
recipe ds-r1 moe_plugins.recipes.train_deepspeed --ds-config r1.json
python3 - <<'PY' | tee -a "$S"
import json, glob, statistics
for f in sorted(glob.glob("runs/*/report.json")):
    d = json.load(open(f)); t = [s["time_s"] for s in d["steps"]][3:12]
    print(f"{f.split('/')[1]:10s} median of steps 3-11 {1000 * statistics.median(t):.0f} ms, losses {[round(s['loss'], 3) for s in d['steps']][-4:]}")
PY
for d in runs/*/; do cp "$d/report.json" "$L/$(basename "$d").json" 2>/dev/null; done
tar czf "$OUT/check3-logs.tgz" -C /tmp check3-logs
