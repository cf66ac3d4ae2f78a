#!/usr/bin/env bash
# On the GPU machine, after `bash .gpu/check.sh` (which installs .gpu/whl and the project into /tmp): the Megatron
# recipe stock and with the plugin on megatron-core 0.19.2, whose wheel the development machine put in .gpu/mc19:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .gpu/mc19 megatron-core==0.19.2
# Results: benchmarks/results/gpu-h200.md. (Ran as one inline command on 2026-11-26; kept here as that command.)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site19 .gpu/mc19/*.whl
export PYTHONPATH=/tmp/proj:/tmp/site19:/tmp/site PATH=/tmp/proj/bin:$PATH PYTHONUNBUFFERED=1
mkdir -p /tmp/mg19 && cd /tmp/mg19
python3 -c "import megatron.core as m; print('mcore', m.__version__)"
timeout 200 torchrun --standalone --nproc-per-node 1 -m moe_plugins.recipes.train_megatron --model gpt2-moe --size gpt2 \
  --ep 1 --steps 20 --out runs/mg19-stock > stock.log 2>&1; echo "mcore19 stock rc=$?"
timeout 200 torchrun --standalone --nproc-per-node 1 -m moe_plugins.recipes.train_megatron --model gpt2-moe --size gpt2 \
  --ep 1 --steps 20 --out runs/mg19-r1 --moe-plugins '{"schedule": "baseline", "pipeline_degree": 1}' > r1.log 2>&1
echo "mcore19 r1 rc=$?"
python3 -c "
import json, glob, statistics
for f in sorted(glob.glob('runs/*/report.json')):
    d = json.load(open(f)); t = [s['time_s'] for s in d['steps'][3:]]
    print(f.split('/')[1], 'median step %.0f ms, last loss %.3f' % (1000 * statistics.median(t), d['steps'][-1]['loss']))
"
for d in runs/*/; do cp "$d/report.json" "./$(basename "$d").json"; done
tar czf "$OUT/mg19.tgz" ./*.log ./*.json
