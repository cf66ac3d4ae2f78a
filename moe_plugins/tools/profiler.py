"""Measure the ops of the cost model on the real process groups and fit t = alpha + beta * x (costmodel.py).

What is timed (every rank at once, as in training; each sample is the slowest rank's time):

- ``gemm``: one batched matmul (E_l, rows, M) @ (E_l, M, H) on each rank; x = E_l * rows * M * H macs;
- ``all_to_all@<g>``, ``all_gather@<g>``, ``all_reduce@<g>`` on every group kind of the layout larger than
  one rank (all groups of a kind run concurrently); x = bytes (the ledger's convention: the gathered size
  for all-gather, the input size otherwise);
- ``all_to_all_stream@<g>``: the all-to-all issued back to back, as PipeMoE's lane issues its chunks: one
  timed run is :func:`stream_count` exchanges (about 4 MiB per rank in all), and x's time is the run's time
  over that count. A lone exchange after idle link time can be faster (the emulated link's token bucket,
  benchmarks/results/tbf-burst.md: 128 KiB after 5 ms idle took 0.09x its time at the rate);
- ``saa@ep_esp+mp``: Parm's SAA as the layer runs it (:func:`moe_plugins.parm.saa.saa_raw`: the EP&ESP
  all-to-all as point-to-point slices, each peer block's ESP sum all-gathered on MP as soon as it lands),
  so the fit carries its per-slice costs; x = bytes into the all-to-all (the all-gather is mp / esp times
  that, as in S2);
- ``chunk`` (opt-in): what PipeMoE's runner costs per chunk. A tiny MoE layer (so that the per-byte and
  per-mac terms vanish) runs forward + backward at the degrees in :data:`moe_plugins.pipemoe.profile_ops.CHUNK_DEGREES` on the layout's
  groups; x = the degree. r = 1 runs the sequential loop and r >= 2 the pipeline, so the line is fitted to
  the degrees >= 2 (:func:`~moe_plugins.core.costmodel.runner_chunk_terms`): its slope is the per-chunk start-up
  (thread hand-offs, autograd, waiting for the slowest rank at each collective) that the bare ops above do
  not see, and the gap between that line at r = 1 and the sequential time is the step of turning the
  pipeline on, which the planner reads from the points.

Per size: ``warmup`` untimed runs, then ``repeats`` timed runs; the median is fitted with numpy least
squares and R^2 is reported. Rank 0 returns the :class:`~moe_plugins.core.costmodel.CostProfile`; saving it
(the cache) and plotting are the caller's business (the CLI).
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.costmodel import UNITS, CostProfile, LinearModel, Measurement, fit_linear, runner_chunk_terms
from moe_plugins.core.groups import Group, MoEProcessGroups, process_groups
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.profile_ops import ProfileBench, elements as _elements, profile_key
from moe_plugins.core.registry import Registry
from moe_plugins.plugins import default_registry

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
COLLECTIVES = ("all_to_all", "all_to_all_stream", "all_gather", "all_reduce")
GROUP_KINDS = ("ep", "esp", "mp", "ep_esp", "dp", "expert_dp")


@dataclass(frozen=True, kw_only=True)
class ProfileSpec:
    """What to measure. Byte sizes are per rank; GEMM shapes are (E_l, M, H) with a range of rows."""

    layout: ParallelLayout
    sizes_bytes: Tuple[int, ...] = tuple(2 ** p for p in range(14, 23, 1))      # 16 KiB .. 4 MiB
    gemm_rows: Tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    gemm_shape: Tuple[int, int, int] = (2, 256, 512)                            # E_l, M, H
    ops: Tuple[str, ...] = ("gemm", "all_to_all", "all_gather", "all_reduce", "saa", "chunk")
    groups: Tuple[str, ...] = ("ep", "esp", "mp", "ep_esp")
    warmup: int = 2
    repeats: int = 5
    dtype: str = "float32"
    keys: Optional[Tuple[str, ...]] = None     # "op@group" collectives to measure; None: every op on every group

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def problems(self) -> List[str]:
        out = []
        if self.dtype not in DTYPES:
            out.append(f"dtype ({self.dtype!r}) must be one of {sorted(DTYPES)}")
        for name in ("warmup", "repeats"):
            if getattr(self, name) < (0 if name == "warmup" else 1):
                out.append(f"{name} ({getattr(self, name)}) must be >= {0 if name == 'warmup' else 1}")
        for name, values in (("sizes_bytes", self.sizes_bytes), ("gemm_rows", self.gemm_rows)):
            if len(set(values)) < 2 or min(values) < 1:
                out.append(f"{name} ({list(values)}) needs at least 2 distinct positive sizes")
        unknown_ops = sorted(set(self.ops) - set(UNITS))
        if unknown_ops:
            out.append(f"ops ({unknown_ops}) are unknown; allowed: {', '.join(UNITS)}")
        unknown_groups = sorted(set(self.groups) - set(GROUP_KINDS))
        if unknown_groups:
            out.append(f"groups ({unknown_groups}) are unknown; allowed: {', '.join(GROUP_KINDS)}")
        if self.keys is not None:
            known = {f"{op}@{g}" for op in COLLECTIVES for g in GROUP_KINDS}
            unknown_keys = sorted(set(self.keys) - known)
            if unknown_keys:
                out.append(f"keys ({unknown_keys}) are unknown; allowed: op@group with op in "
                           f"{', '.join(COLLECTIVES)} and group in {', '.join(GROUP_KINDS)}")
        if len(self.gemm_shape) != 3 or min(self.gemm_shape) < 1:
            out.append(f"gemm_shape ({self.gemm_shape}) must be three positive ints (E_l, M, H)")
        return out

    def check(self) -> "ProfileSpec":
        problems = self.problems()
        if problems:
            raise ValueError("invalid profile spec: " + "; ".join(problems))
        return self


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _time(op: Callable[[], None], warmup: int, repeats: int, device: torch.device) -> float:
    """Median over ``repeats`` of the slowest rank's time; ranks start each run together."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        op()
    sync()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        op()
        sync()
        samples.append(_slowest(time.perf_counter() - t0))
    return statistics.median(samples)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (as in comm.py)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


STREAM_BYTES = 4 << 20     # bytes per rank one back-to-back sample sends, so a link's banked burst is a small share
STREAM_MAX = 256           # exchanges per back-to-back sample at most


def stream_count(nbytes: int) -> int:
    """Pure: how many exchanges of ``nbytes`` one ``all_to_all_stream`` sample runs back to back."""
    return min(STREAM_MAX, max(1, -(-STREAM_BYTES // max(nbytes, 1))))


def _collective(op: str, group: Group, numel: int, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    x = torch.randn(numel, device=device).to(dtype)
    if op in ("all_to_all", "all_to_all_stream"):
        out = torch.empty_like(x)
        if op == "all_to_all_stream":
            count = stream_count(numel * x.element_size())
            return lambda: [dist.all_to_all_single(out, x, group=group.pg) for _ in range(count)]
        return lambda: dist.all_to_all_single(out, x, group=group.pg)
    if op == "all_gather":                 # x is the gathered size
        shard = torch.randn(numel // group.size, device=device).to(dtype)
        return lambda: _all_gather_flat(x, shard, group=group.pg)
    return lambda: dist.all_reduce(x, group=group.pg)


def _benches(spec: ProfileSpec, groups: MoEProcessGroups, device: torch.device) -> List[ProfileBench]:
    dtype = DTYPES[spec.dtype]
    elsize = torch.tensor([], dtype=dtype).element_size()
    sizes = sorted(set(spec.sizes_bytes))
    out: List[ProfileBench] = []
    if "gemm" in spec.ops:
        e_l, m, h = spec.gemm_shape
        rows = sorted(set(spec.gemm_rows))

        def gemm_setup(i: int) -> Callable[[], None]:
            a = torch.randn(e_l, rows[i], m, device=device).to(dtype)
            b = torch.randn(e_l, m, h, device=device).to(dtype)
            return lambda: torch.bmm(a, b)
        out.append(ProfileBench("gemm", lambda i: float(e_l * rows[i] * m * h), gemm_setup, []))
    first: Dict[Tuple[str, Tuple[int, ...]], ProfileBench] = {}
    for kind in spec.groups:
        group = getattr(groups, kind)
        if group.size == 1:
            continue
        for op in COLLECTIVES:
            if op not in spec.ops or (spec.keys is not None and f"{op}@{kind}" not in spec.keys):
                continue
            if (op, group.ranks) in first:          # e.g. ep_esp == ep when esp == 1
                first[op, group.ranks].aliases.append(f"{op}@{kind}")
                continue
            numels = [_elements(s, dtype, group.size) for s in sizes]
            per_op = ((lambda i, n=numels: stream_count(n[i] * elsize)) if op == "all_to_all_stream"
                      else (lambda i: 1))
            bench = ProfileBench(f"{op}@{kind}", lambda i, n=numels: float(n[i] * elsize),
                           lambda i, op=op, g=group, n=numels: _collective(op, g, n[i], dtype, device), [], per_op)
            first[op, group.ranks] = bench
            out.append(bench)
    return out


def _count(bench: ProfileBench, spec: ProfileSpec) -> int:
    if bench.points is not None:
        return bench.points
    return len(set(spec.gemm_rows)) if bench.key == "gemm" else len(set(spec.sizes_bytes))


def profile_rank(spec: ProfileSpec, *, source: str = "", progress: bool = True,
                 groups: Optional[MoEProcessGroups] = None, registry: Optional[Registry] = None
                 ) -> Optional[CostProfile]:
    """Collective over the default group: measure every op and fit it. Rank 0 returns the profile.
    Without ``groups`` it builds the layout's groups and destroys them afterwards."""
    spec.check()
    registry = default_registry() if registry is None else registry
    if groups is None:
        with process_groups(spec.layout) as made:
            return profile_rank(spec, source=source, progress=progress, groups=made, registry=registry)
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    measured: Dict[str, Measurement] = {}
    with ExitStack() as stack:
        benches = _benches(spec, groups, device)
        for op in registry.profile_ops().values():        # the papers' ops (Parm's SAA, PipeMoE's chunk)
            bench = op(spec, groups, device, stack)
            if bench is not None:
                benches.append(bench)
        total = sum(_count(b, spec) for b in benches)
        bar = _progress(total, progress and dist.get_rank() == 0)
        stack.callback(bar.close)
        for bench in benches:
            xs, ts = [], []
            for i in range(_count(bench, spec)):
                bar.set_description(bench.key)
                ts.append(_time(bench.setup(i), spec.warmup, spec.repeats, device) / bench.per_op(i))
                xs.append(bench.x(i))
                bar.update(1)
            for key in [bench.key] + bench.aliases:
                measured[key] = Measurement(x=tuple(xs), seconds=tuple(ts))
    if dist.get_rank() != 0:
        return None
    models = {k: _fit(k, m) for k, m in measured.items()}
    return CostProfile(key=profile_key(spec.layout, dist.get_backend(), device), dtype=spec.dtype, models=models,
                       measurements=measured, source=source)


def _fit(key: str, m: Measurement) -> LinearModel:
    if key == "chunk":
        return runner_chunk_terms(m)[0]
    return fit_linear(m.x, m.seconds, UNITS[key.split("@")[0]])


class _NoBar:
    def set_description(self, _: str) -> None:
        pass

    def update(self, _: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, show: bool):
    if not show:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="size", desc="profile", leave=True)


def plot_profile(profile: CostProfile, path) -> None:
    """One panel per op: measured medians (markers) and the fitted line, like pipemoe.txt Fig. 6."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    keys = [k for k in sorted(profile.models) if k in profile.measurements]
    if not keys:
        raise ValueError("profile has no measurements to plot")
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        m, fit = profile.measurements[key], profile.models[key]
        x_N = np.asarray(m.x)
        grid = np.linspace(0, x_N.max() * 1.05, 100)
        ax.plot(x_N, np.asarray(m.seconds) * 1e3, "o", label="measured (median)")
        ax.plot(grid, (fit.alpha + fit.beta * grid) * 1e3, "-", label="fit")
        ax.set_title(f"{key}\nalpha={fit.alpha:.3g} s, beta={fit.beta:.3g} s/{fit.unit}, R2={fit.r2:.3f}",
                     fontsize=8)
        ax.set_xlabel(f"x ({fit.unit}s)")
        ax.set_ylabel("time (ms)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(f"cost profile {profile.key.slug()} ({profile.dtype})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
