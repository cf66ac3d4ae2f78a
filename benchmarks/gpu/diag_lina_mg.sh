set -uo pipefail
ROOT=$PWD; OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
source .gpu/remote_setup.sh > /dev/null 2>&1
STEPS=5 AFTER_S=50 timeout 90 torchrun --standalone --nproc-per-node 1 benchmarks/gpu/with_stacks.py benchmarks/gpu/layer_modes.py stock 8192 768 3072 16 2 /tmp/ref > "$OUT/lina-ref.log" 2>&1; echo ref rc=$?
STEPS=5 AFTER_S=40 timeout 90 torchrun --standalone --nproc-per-node 1 benchmarks/gpu/with_stacks.py benchmarks/gpu/layer_modes.py lina 8192 768 3072 16 2 /tmp/ref > "$OUT/lina.log" 2>&1; echo lina rc=$?
grep -a "^{" "$OUT/lina.log"
mkdir -p /tmp/rc && cd /tmp/rc
for t in stock r1; do
  extra=""; [ $t = r1 ] && extra='{"schedule": "baseline", "pipeline_degree": 1}'
  PROF_FROM=12 timeout 100 torchrun --standalone --nproc-per-node 1 "$ROOT/benchmarks/gpu/prof_recipe.py" moe_plugins.recipes.train_megatron "mg-$t" -- \
    --model gpt2-moe --size gpt2 --ep 1 --out "runs/mg-$t" --steps 16 ${extra:+--moe-plugins "$extra"} > "$OUT/mg-$t.log" 2>&1; echo mg-$t rc=$?
  grep -ao "PROF .*" "$OUT/mg-$t.log"; cp runs/mg-$t/report.json "$OUT/mg-$t.json" 2>/dev/null
done
