#!/usr/bin/env bash
# On the GPU machine (after prepare.sh; `OUT=... bash benchmarks/gpu/prof_run.sh`): DeepSpeed recipe stock vs r1, alternated twice, profiled at steps PROF_FROM..+3.
set -uo pipefail
ROOT=$PWD; SIZE=${SIZE:-gpt2}; STEPS=${STEPS:-30}
[ "${LOCAL:-0}" = 1 ] || source .gpu/remote_setup.sh > /dev/null 2>&1
OUT=${OUT:-$PWD/prof-out}; mkdir -p "$OUT" /tmp/pr && cd /tmp/pr
echo '{"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "bf16": {"enabled": true}, "zero_optimization": {"stage": 1}}' > stock.json
echo '{"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "bf16": {"enabled": true}, "zero_optimization": {"stage": 1}, "moe_plugins": {"schedule": "baseline", "pipeline_degree": 1}}' > r1.json
for rep in a b; do for n in stock r1; do
  PROF_FROM=$((STEPS - 5)) timeout 200 torchrun --standalone --nproc-per-node 1 "$ROOT/benchmarks/gpu/prof_recipe.py" moe_plugins.recipes.train_deepspeed "ds-$n-$rep" -- \
    --model gpt2-moe --size "$SIZE" --ep 1 --steps "$STEPS" --ds-config $n.json $([ $n = stock ] && echo --no-plugins) --out "runs/ds-$n-$rep" > "$OUT/ds-$n-$rep.log" 2>&1
  echo "ds-$n-$rep rc=$?"; grep -ao "PROF .*" "$OUT/ds-$n-$rep.log"
done; done
python3 - <<'PY'
import json, glob, statistics
for f in sorted(glob.glob("runs/*/report.json")):
    d = json.load(open(f)); t = [s["time_s"] for s in d["steps"]][3:-6]
    print(f"{f.split('/')[1]:14s} median step {1000 * statistics.median(t):.0f} ms over {len(t)} steps, min {1000*min(t):.0f}, last loss {d['steps'][-1]['loss']:.3f}")
PY
