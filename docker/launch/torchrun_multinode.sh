#!/usr/bin/env bash
# Multi-node training with torchrun. Run this same script on every node.
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node0 host> bash docker/launch/torchrun_multinode.sh
set -euo pipefail
NNODES=${NNODES:?set NNODES}
NODE_RANK=${NODE_RANK:?set NODE_RANK}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MODEL=${MODEL:-gpt2-moe}
CONFIG=${CONFIG:-recipes/configs/gpt2_moe_cluster.json}

torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m moe_plugins.recipes.train_deepspeed --model "$MODEL" --size gpt2 --ep "${EP:-8}" \
  --ds-config "$CONFIG" --steps "${STEPS:-10000}" --ckpt-dir "${CKPT_DIR:-checkpoints/$MODEL}" \
  --save-every "${SAVE_EVERY:-500}" --out "${OUT:-runs/$MODEL}"
