#!/usr/bin/env bash
# DeepSpeed's launcher over a hostfile (passwordless ssh between nodes, same image/paths everywhere).
#   bash docker/launch/deepspeed_launch.sh
set -euo pipefail
HOSTFILE=${HOSTFILE:-docker/launch/hostfile}
CONFIG=${CONFIG:-recipes/configs/gpt2_moe_cluster.json}
deepspeed --hostfile "$HOSTFILE" --module moe_plugins.recipes.train_deepspeed \
  --model "${MODEL:-gpt2-moe}" --size gpt2 --ep "${EP:-8}" --ds-config "$CONFIG" \
  --steps "${STEPS:-10000}" --ckpt-dir "${CKPT_DIR:-checkpoints/gpt2-moe}" --save-every "${SAVE_EVERY:-500}"
