#!/usr/bin/env bash
# CPU, one rank (Megatron-core through --cpu-shims): the Megatron recipe at GPT-2's widths (12 layers, M 768,
# H 3072, E 16, k 2; 4 x 256 tokens) stock, with the plugin's padded exchange, and with the ragged exchange
# (whose experts now get the kept rows only, LayerParams.row_experts), alternated twice; steps 3-4 profiled.
# Prints each run's PROF line and its aten::mm row. Results: benchmarks/results/megatron-expert-rows-cpu.txt.
set -uo pipefail
ROOT=$PWD; PY=${PY:-$ROOT/.venv/bin}; mkdir -p /tmp/mer && cd /tmp/mer
for rep in a b; do for t in stock padded ragged; do
  case $t in stock) ex="";; padded) ex='{"schedule": "baseline", "pipeline_degree": 1}';;
    ragged) ex='{"schedule": "baseline", "pipeline_degree": 1, "exchange": "ragged"}';; esac
  PROF_FROM=3 PROF_N=2 timeout 900 "$PY/torchrun" --standalone --nproc-per-node 1 "$ROOT/benchmarks/gpu/prof_recipe.py" \
    moe_plugins.recipes.train_megatron "$t-$rep" -- --model gpt2-moe --size gpt2 --seq-len 256 --micro-batch-size 4 \
    --ep 1 --steps 6 --out "runs/$t-$rep" --cpu-shims ${ex:+--moe-plugins "$ex"} > "$t-$rep.log" 2>&1
  grep -a "^PROF" "$t-$rep.log"; grep -a "^ *aten::mm " "$t-$rep.log" | head -1 | awk '{print "  aten::mm self CPU", $3, "calls", $NF}'
  python3 -c "import json; d=json.load(open('runs/$t-$rep/report.json')); print('  losses', [round(s['loss'], 4) for s in d['steps']])"
done; done
