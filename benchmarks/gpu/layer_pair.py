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
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

sys.path.insert(0, os.path.dirname(__file__))
from modes import MODES  # noqa: E402  (the configurations of the per-process check, layer_modes.py)

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


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        expert = torch.nn.Sequential(torch.nn.Linear(M, H), torch.nn.GELU(), torch.nn.Linear(H, M))
        self.moe = MoE(M, expert, num_experts=E, ep_size=1, k=K, capacity_factor=1.0, min_capacity=0,
                       use_rts=False, top2_2nd_expert_sampling=False)

    def forward(self, x_BSM):
        y_BSM, aux, _ = self.moe(x_BSM)
        return y_BSM.float().pow(2).mean() + 0.01 * aux


def build(section):
    torch.manual_seed(0)
    net = Net()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "p"})
    ds_config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}}
    if GPU:
        ds_config["bf16"] = {"enabled": True}
    if section is not None:
        ds_config["moe_plugins"] = section
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(groups, lr=1e-4), config=ds_config)
    return engine


engines = {"stock": build(None), mode: build(MODES[mode])}
x_BSM = torch.randn(8, S // 8, M, device=engines["stock"].device, dtype=DT)


def timed(engine) -> float:
    sync()
    t0 = time.perf_counter()
    engine.backward(engine(x_BSM))
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
