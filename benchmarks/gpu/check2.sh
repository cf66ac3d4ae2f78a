#!/usr/bin/env bash
# On the GPU machine, after prepare.sh (`OUT=... bash benchmarks/gpu/check2.sh`): the #27 re-measure in one call.
#  1. layer_modes.py at the small and large shapes (stock first: the fp32 reference), stock and r1 twice each
#     in alternation at the small shape (its 1.03x was inside one run's noise), parm-auto's syncs after the
#     N_MP = 1 fix, pipe-auto without a profile, and the first GPU runs of Lancet's, Hecate's and Lina's layers;
#  2. the DeepSpeed recipe stock / r1 alternated twice and the Megatron recipe stock / r1, each under
#     prof_recipe.py (wall and GPU time per step);
#  3. the DeepSpeed recipe in fp32, stock and with Lancet's partitions and deferred dW (first GPU run of the
#     block executor): the losses must agree.
# Each stage appends to $OUT as it ends, so a time-out keeps what finished. Results: benchmarks/results/gpu-h200.md.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-$PWD/gpu-out}; L=$OUT/logs; mkdir -p "$L"
source .gpu/remote_setup.sh > /dev/null 2>&1
nvidia-smi -L
python3 -c "import torch, deepspeed, megatron.core as m; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'mcore', m.__version__)"
layer() {   # MODE TAG SHAPE...
  local m=$1 tag=$2; shift 2
  timeout 150 torchrun --standalone --nproc-per-node 1 "$ROOT/benchmarks/gpu/layer_modes.py" "$m" "$@" /tmp/ref > "$L/layer-$tag.log" 2>&1
  grep -h '^{' "$L/layer-$tag.log" >> "$OUT/layer.jsonl" || echo "layer $m $* failed (rc $?)" | tee -a "$OUT/layer.jsonl"
}
i=0; for m in stock r1 parm-auto pipe-auto stock r1 lancet hecate lina; do
  layer $m "$m-small-$((i++))" 8192 768 3072 16 2; done
for m in stock r1 parm-auto; do layer $m "$m-large" 16384 2048 8192 8 2; done
cat "$OUT/layer.jsonl"

mkdir -p /tmp/rc && cd /tmp/rc
base='"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}'
echo "{$base, \"bf16\": {\"enabled\": true}}" > stock.json
echo "{$base, \"bf16\": {\"enabled\": true}, \"moe_plugins\": {\"schedule\": \"baseline\", \"pipeline_degree\": 1}}" > r1.json
echo "{$base}" > stock32.json
echo "{$base, \"moe_plugins\": {\"schedule\": \"baseline\", \"lancet\": {\"defer_wgrad\": true, \"partitions\": 2, \"dense_wgrad\": true}}}" > lancet32.json
recipe() {  # TAG MODULE ARGS...
  local tag=$1 mod=$2; shift 2
  PROF_FROM=20 timeout 150 torchrun --standalone --nproc-per-node 1 "$ROOT/benchmarks/gpu/prof_recipe.py" "$mod" "$tag" -- \
    --model gpt2-moe --size gpt2 --ep 1 --out "runs/$tag" "$@" > "$L/recipe-$tag.log" 2>&1
  echo "$tag rc=$?"; grep -ao "PROF .*" "$L/recipe-$tag.log" | tee -a "$OUT/prof.txt"
}
for rep in a b; do
  recipe "ds-stock-$rep" moe_plugins.recipes.train_deepspeed --steps 24 --ds-config stock.json --no-plugins
  recipe "ds-r1-$rep" moe_plugins.recipes.train_deepspeed --steps 24 --ds-config r1.json
done
recipe mg-stock moe_plugins.recipes.train_megatron --steps 24
recipe mg-r1 moe_plugins.recipes.train_megatron --steps 24 --moe-plugins '{"schedule": "baseline", "pipeline_degree": 1}'
recipe ds-stock-fp32 moe_plugins.recipes.train_deepspeed --steps 12 --ds-config stock32.json --no-plugins
recipe ds-lancet-fp32 moe_plugins.recipes.train_deepspeed --steps 12 --ds-config lancet32.json
python3 - <<'PY' | tee "$OUT/recipes.txt"
import json, glob, statistics
for f in sorted(glob.glob("runs/*/report.json")):
    d = json.load(open(f)); t = [s["time_s"] for s in d["steps"]][3:20]
    print(f"{f.split('/')[1]:16s} median step {1000 * statistics.median(t):.0f} ms over steps 3-19, min {1000 * min(t):.0f}, "
          f"losses {[round(s['loss'], 4) for s in d['steps']][:12]}")
PY
for d in runs/*/; do cp "$d/report.json" "$L/$(basename "$d").json" 2>/dev/null; done
tar czf "$OUT/gpu-check2-logs.tgz" -C "$OUT" logs && rm -rf "$L"
