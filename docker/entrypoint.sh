#!/usr/bin/env bash
# Container entrypoint: print the environment the run sees, then exec the command (torchrun, deepspeed, ...).
set -euo pipefail
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
python -c "import torch, moe_plugins; print(f'moe_plugins {moe_plugins.__version__}, torch {torch.__version__}, cuda {torch.cuda.is_available()}')"
exec "$@"
