"""One ``deepspeed.moe`` layer at world 1 under each plugin schedule: exactness against stock in fp32, then
forward+backward time and host synchronisations (bf16 on a GPU, fp32 on CPU with gloo).

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu/layer_modes.py MODE S M H E K OUTDIR

MODE: a key of MODES. Run ``stock`` first for a shape: it saves the fp32 reference (output, aux loss, every
gradient) to OUTDIR, which every later mode compares against. Prints one JSON line. Written for the GPU
check of issue #27 (results in benchmarks/results/gpu-h200.md): the first run of Lancet's, Hecate's and Lina's
CUDA paths (engine side streams, the pipeline lane's stream) on a GPU.
"""
import json
import os
import sys
import time
import warnings

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(__file__))
from modes import MODES, build_engine  # noqa: E402

mode, (S, M, H, E, K), out_dir = sys.argv[1], (int(v) for v in sys.argv[2:7]), sys.argv[7]
if mode not in MODES:
    raise SystemExit(f"mode ({mode!r}) must be one of {sorted(MODES)}")
GPU = torch.cuda.is_available()
if not GPU:     # the CPU image's DeepSpeed cannot build its shared-memory op
    import importlib
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
if MODES[mode] is not None:
    import moe_plugins
    moe_plugins.enable({"moe_plugins": MODES[mode]})
deepspeed.init_distributed(dist_backend="nccl" if GPU else "gloo")
sync = torch.cuda.synchronize if GPU else (lambda: None)


def build(ds_config):
    return build_engine((M, H, E, K), ds_config, MODES[mode])


# 1. exactness: fp32, no ZeRO, one forward+backward at a fixed input; gradients read from .grad
engine = build({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 0}})
x_BSM = torch.randn(8, S // 8, M, generator=torch.Generator().manual_seed(1)).to(engine.device)
y_BSM, aux = engine(x_BSM)
engine.backward(y_BSM.pow(2).mean() + 0.01 * aux)
got = {"y": y_BSM.detach().cpu(), "aux": aux.detach().cpu()}
got.update({n: p.grad.detach().cpu().clone() for n, p in engine.module.named_parameters() if p.grad is not None})
ref_path = os.path.join(out_dir, f"ref-{S}-{M}-{H}-{E}-{K}.pt")
if mode == "stock":
    os.makedirs(out_dir, exist_ok=True)
    torch.save(got, ref_path)
    exact = {"reference": ref_path}
else:
    ref = torch.load(ref_path)
    missing = sorted(set(ref) ^ set(got))
    worst = max(((got[k] - ref[k]).abs().max().item() / max(ref[k].abs().max().item(), 1e-30), k)
                for k in ref if k in got)
    exact = {"missing": missing, "worst_rel_diff": worst[0], "worst_tensor": worst[1]}
del engine

# 2. time and host synchronisations: bf16 on a GPU (ZeRO-1), fp32 on CPU
ds_config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}}
if GPU:
    ds_config["bf16"] = {"enabled": True}
engine = build(ds_config)
x_BSM = torch.randn(8, S // 8, M, device=engine.device, dtype=torch.bfloat16 if GPU else torch.float32)


def step():
    y_BSM, aux = engine(x_BSM)
    engine.backward(y_BSM.float().pow(2).mean() + 0.01 * aux)
    engine.zero_grad()


for _ in range(5):
    step()
sync()
times = []
for _ in range(int(os.environ.get("STEPS", 40))):
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    times.append(time.perf_counter() - t0)
times.sort()
if GPU:
    torch.cuda.set_sync_debug_mode(1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step()
    sync()
if GPU:
    torch.cuda.set_sync_debug_mode(0)
syncs = [str(w.message).splitlines()[0][:120] for w in caught if "synchroniz" in str(w.message)]
print(json.dumps({"mode": mode, "S": S, "M": M, "H": H, "E": E, "k": K, "device": str(engine.device),
                  "median_ms": 1000 * times[len(times) // 2], "min_ms": 1000 * times[0], "steps": len(times),
                  "syncs_per_step": len(syncs), "sync_sites": sorted(set(syncs))[:4], **exact}), flush=True)
