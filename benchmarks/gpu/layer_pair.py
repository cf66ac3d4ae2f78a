"""Stock ``deepspeed.moe`` layer and the plugin's, in ONE process, steps alternated: a ratio that process-level
noise cannot move. In the GPU check's second sitting (benchmarks/results/gpu-h200.md) the same configuration's
median moved by 45% between processes at S 8192 / M 768, so one process per mode could not resolve a 1.00x target.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu/layer_pair.py MODE S M H E K [ROUNDS]

MODE: a key of layer_modes.MODES other than stock. ``moe_plugins.enable()`` is called without a config, so each
engine's own ds_config decides: the stock engine has no ``moe_plugins`` section, the other has MODE's. Each round
times one stock step and one plugin step (order swapped every round), each between two device syncs. Prints one
JSON line: both medians, the median of the per-round ratios, and the ratio's spread (quartiles).
"""
import json
import os
import statistics
import sys
import time

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(__file__))
from modes import MODES, build_engine  # noqa: E402  (shared with the per-process check, layer_modes.py)

mode, (S, M, H, E, K) = sys.argv[1], (int(v) for v in sys.argv[2:7])
rounds = int(sys.argv[7]) if len(sys.argv) > 7 else 40
if mode not in MODES or MODES[mode] is None:
    raise SystemExit(f"mode ({mode!r}) must be one of {sorted(k for k, v in MODES.items() if v is not None)}")
GPU = torch.cuda.is_available()
if not GPU:
    import importlib
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
import moe_plugins  # noqa: E402
moe_plugins.enable()            # each engine's ds_config decides
deepspeed.init_distributed(dist_backend="nccl" if GPU else "gloo")
sync = torch.cuda.synchronize if GPU else (lambda: None)
DT = torch.bfloat16 if GPU else torch.float32


def build(section):
    ds_config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}}
    if GPU:
        ds_config["bf16"] = {"enabled": True}
    return build_engine((M, H, E, K), ds_config, section)


engines = {"stock": build(None), mode: build(MODES[mode])}
x_BSM = torch.randn(8, S // 8, M, device=engines["stock"].device, dtype=DT)


def timed(engine) -> float:
    sync()
    t0 = time.perf_counter()
    y_BSM, aux = engine(x_BSM)
    engine.backward(y_BSM.float().pow(2).mean() + 0.01 * aux)
    engine.zero_grad()
    sync()
    return time.perf_counter() - t0


for _ in range(5):
    for engine in engines.values():
        timed(engine)
times = {name: [] for name in engines}
for i in range(rounds):
    for name in (("stock", mode) if i % 2 == 0 else (mode, "stock")):
        times[name].append(timed(engines[name]))
ratios = sorted(p / s for p, s in zip(times[mode], times["stock"]))
q1, _, q3 = statistics.quantiles(ratios, n=4)
print(json.dumps({"mode": mode, "S": S, "M": M, "H": H, "E": E, "k": K, "rounds": rounds,
                  "device": str(engines["stock"].device),
                  "stock_median_ms": 1000 * statistics.median(times["stock"]),
                  "plugin_median_ms": 1000 * statistics.median(times[mode]),
                  "ratio_of_medians": statistics.median(times[mode]) / statistics.median(times["stock"]),
                  "median_round_ratio": statistics.median(ratios), "round_ratio_q1_q3": [q1, q3]}), flush=True)
