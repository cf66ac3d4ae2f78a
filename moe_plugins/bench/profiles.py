"""Cost profiles for the bench's auto rows: measured on the case's own groups, at the link rate being timed.

``parm-auto`` (Algorithm 1) and ``@r=auto`` (PipeMoE) decide from alpha-beta models. A user gets those from
``moe-plugins profile`` on their cluster; the bench does the same at every rate it applies, so each auto row
decides from the link it is timed on, and the report carries the fit (alpha, beta, R^2) next to the times.

Sizes run from small to 2x the case: collectives from 4 KiB to twice the bytes one rank sends in the case's
dispatch all-to-all (at least 1 MiB, at most 8 MiB), GEMM rows from 8 to twice the rows one local expert
computes (at least 512, at most 4096), on the case's (E_l, M, H / N_ESP). Powers of two, so most points are small: they pin down alpha (the per-chunk start-up
cost that bounds the pipeline degree), and the large ones beta.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist

from ..costmodel import CostProfile
from ..groups import MoEProcessGroups
from ..gating import capacity
from ..layout import ParallelLayout
from ..plugin_config import PROFILED_SCHEDULES, degree_needs_profile
from ..profiler import ProfileSpec, profile_rank
from .matrix import CaseConfig, RowSpec


MIN_TOP_BYTES = 1 << 20     # a tiny case still fits beta on sizes where it dominates the noise
MIN_TOP_ROWS = 512
MAX_TOP_BYTES = 8 << 20     # above this the line is extrapolated: the fit stays linear, and a slow link's
MAX_TOP_ROWS = 4096         # profile (minutes per op at 32 MiB) is shared by every case of a layout


def _powers_of_two(low: float, high: float) -> tuple:
    lo, hi = max(0, math.floor(math.log2(max(low, 1)))), math.ceil(math.log2(max(high, 2)))
    return tuple(2 ** p for p in range(lo, hi + 1))


def profile_spec_for(case: CaseConfig, layout: ParallelLayout, specs: Sequence[RowSpec], dtype: str,
                     repeats: int = 5) -> ProfileSpec:
    """Pure: what to measure for the auto rows ``specs`` of ``case`` (Parm needs the MP all-gather and SAA,
    PipeMoE the runner's per-chunk cost)."""
    elsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    cap = capacity(case.tokens, case.experts, case.k, case.capacity_factor, case.min_capacity)
    a2a_bytes = case.experts * cap * case.hidden * elsize * layout.esp
    e_l, h_s = case.experts // layout.ep, case.ffn // layout.esp
    rows = cap * layout.ep * layout.esp
    parm = any(s.name in PROFILED_SCHEDULES for s in specs)
    pipe = any(degree_needs_profile(s.option("r", "1")) for s in specs)
    return ProfileSpec(layout=layout, sizes_bytes=_powers_of_two(4096, min(max(2 * a2a_bytes, MIN_TOP_BYTES), MAX_TOP_BYTES)),
                       gemm_rows=_powers_of_two(8, min(max(2 * rows, MIN_TOP_ROWS), MAX_TOP_ROWS)), gemm_shape=(e_l, case.hidden, h_s),
                       ops=("gemm", "all_to_all") + (("all_gather", "saa") if parm else ()) + (("chunk",) if pipe else ()),
                       groups=("ep", "ep_esp", "mp") if parm else ("ep", "ep_esp"), warmup=2, repeats=repeats,
                       dtype=dtype)


def measure_profile(spec: ProfileSpec, groups: MoEProcessGroups, source: str) -> CostProfile:
    """Collective: profile on ``groups``; every rank returns rank 0's fit (so every rank decides alike)."""
    profile = profile_rank(spec, source=source, progress=False, groups=groups)
    box: List[Any] = [profile.to_json() if profile is not None else None]
    dist.broadcast_object_list(box, src=0)
    return CostProfile.from_json(box[0])


def profile_summary(profile: CostProfile) -> Dict[str, Dict[str, float]]:
    """model key -> alpha, beta, R^2, unit and which terms the bounded fit pinned at 0, for the report."""
    return {key: {"alpha": m.alpha, "beta": m.beta, "r2": m.r2, "unit": m.unit,
                  "alpha_clamped": m.alpha_clamped, "beta_clamped": m.beta_clamped}
            for key, m in sorted(profile.models.items())}


def profile_measurements(profile: CostProfile) -> Dict[str, Dict[str, List[float]]]:
    """model key -> the measured sizes and per-size median seconds behind its fit (for re-fits offline, e.g.
    of a cost that is not linear in the size)."""
    return {key: m.to_json() for key, m in sorted(profile.measurements.items())}
