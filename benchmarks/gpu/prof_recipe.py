"""Diagnostic: run a recipe module with torch.profiler around optimizer steps PROF_FROM..PROF_FROM+PROF_N.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu/prof_recipe.py MODULE TAG -- RECIPE ARGS

Prints one ``PROF TAG:`` line (wall, self CPU and self CUDA time per step, aten calls, kernel launches and
copies per step) and the op tables (by self CPU, self CUDA, count). Used by prof_run.sh on the GPU machine;
results in benchmarks/results/gpu-h200.md."""
import os, runpy, sys, time
import torch
from torch.profiler import profile, ProfilerActivity

module, tag = sys.argv[1], sys.argv[2]
args = sys.argv[sys.argv.index("--") + 1:]
FROM, N = int(os.environ.get("PROF_FROM", 8)), int(os.environ.get("PROF_N", 3))
GPU = torch.cuda.is_available()
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if GPU else [])
state = {"n": 0, "prof": None}


def tick():
    state["n"] += 1
    n = state["n"]
    if n == FROM:
        GPU and torch.cuda.synchronize()
        state["prof"] = profile(activities=acts); state["prof"].__enter__(); state["t0"] = time.perf_counter()
    elif n == FROM + N and state["prof"] is not None:
        GPU and torch.cuda.synchronize()
        wall = (time.perf_counter() - state["t0"]) / N
        p = state["prof"]; p.__exit__(None, None, None); state["prof"] = None
        ka = p.key_averages()
        cpu = sum(e.self_cpu_time_total for e in ka) / N / 1000
        cuda = sum(getattr(e, "self_device_time_total", 0) for e in ka) / N / 1000
        calls = sum(e.count for e in ka if e.key.startswith("aten::")) / N
        launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync")) / N
        print(f"\nPROF {tag}: wall {wall*1000:.1f} ms/step, self CPU {cpu:.1f} ms, self CUDA {cuda:.1f} ms, aten calls {calls:.0f}, launches+memcpy {launches:.0f}", flush=True)
        print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        GPU and print(ka.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        print(ka.table(sort_by="count", row_limit=25, max_name_column_width=60))


import deepspeed
_orig = deepspeed.DeepSpeedEngine.step
def step(self, *a, **k):
    r = _orig(self, *a, **k); tick(); return r
deepspeed.DeepSpeedEngine.step = step
if "megatron" in module:
    import megatron.core.optimizer as mo
    cls = mo.optimizer.MegatronOptimizer
    for sub in [cls] + cls.__subclasses__() + [c for s in cls.__subclasses__() for c in s.__subclasses__()]:
        if "step" in sub.__dict__:
            def mk(f):
                def w(self, *a, **k):
                    r = f(self, *a, **k); tick(); return r
                return w
            sub.step = mk(sub.__dict__["step"])
sys.argv = [module] + args
runpy.run_module(module, run_name="__main__")
