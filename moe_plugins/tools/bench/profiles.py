"""Cost profiles for the bench's auto rows, measured on the bench's own groups at the link rate being timed.

``parm-auto`` (Algorithm 1) and ``@r=auto`` (PipeMoE) decide from alpha-beta models. A user gets those from
``moe-plugins profile``, once per cluster, and plans every layer shape from it; the bench does the same at
every rate it applies, so each auto row decides from the link it is timed on, and the report carries the fit
(alpha, beta, R^2) next to the times. Two parts, merged per case (:func:`merge_profiles`):

- **the link part** (collectives, Parm's SAA, PipeMoE's back-to-back all-to-all and ``chunk`` term): measured once per layout and rate
  and shared by every case of that layout, as a user's profile is. Sizes run from 4 KiB to twice the
  largest case's dispatch all-to-all bytes per rank (at least 1 MiB, at most 8 MiB), with
  :data:`LINK_REPEATS` timed runs per size. (Until git 51dee78 every case measured its own, over its own
  sizes, with 5 repeats: eight noisy copies of one link, whose fits fell below R^2 0.95 in 8 of 48 on the
  2 x 1 PipeMoE grid, and whose ``chunk`` points for the same tiny layer differed by up to 1.6x.)
- **the GEMM part**: one per case, on the case's (E_l, M, H / N_ESP), with rows from 8 to twice the rows one
  local expert computes (at least 512, at most 4096). It does not depend on the link, so it is measured at
  the first rate and reused at the others.

Powers of two, so most points are small: they pin down alpha (the per-chunk start-up cost that bounds the
pipeline degree), and the large ones beta.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist

from moe_plugins.core.costmodel import CostProfile
from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.gating import capacity
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.plugin_config import degree_needs_profile
from moe_plugins.plugins import default_registry
from moe_plugins.tools.profiler import ProfileSpec, profile_rank
from moe_plugins.tools.bench.matrix import CaseConfig, RowSpec, row_schedule


MIN_TOP_BYTES = 1 << 20     # a tiny case still fits beta on sizes where it dominates the noise
MIN_TOP_ROWS = 512
MAX_TOP_BYTES = 8 << 20     # above this the line is extrapolated: the fit stays linear, and a slow link's
MAX_TOP_ROWS = 4096         # profile (minutes per op at 32 MiB) is shared by every case of a layout
LINK_REPEATS = 15           # timed runs per size; the median is fitted
GEMM_REPEATS = 15
WARMUP = 3


def _powers_of_two(low: float, high: float) -> tuple:
    lo, hi = max(0, math.floor(math.log2(max(low, 1)))), math.ceil(math.log2(max(high, 2)))
    return tuple(2 ** p for p in range(lo, hi + 1))


def _elsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def dispatch_bytes(case: CaseConfig, layout: ParallelLayout, dtype: str) -> int:
    """Bytes one rank passes to the case's dispatch all-to-all (E x C x M, dumped to N_ESP shards)."""
    cap = capacity(case.tokens, case.experts, case.k, case.capacity_factor, case.min_capacity)
    return case.experts * cap * case.hidden * _elsize(dtype) * layout.esp


def link_spec_for(cases: Sequence[CaseConfig], layout: ParallelLayout, specs: Sequence[RowSpec], dtype: str,
                  repeats: int = LINK_REPEATS) -> ProfileSpec:
    """Pure: the link part for the auto rows ``specs`` of every case in ``cases`` (all on ``layout``): Parm
    needs the MP all-gather and SAA, and for DeepSpeed's flow (its third candidate) the EP all-to-all and the
    ESP all-gather and all-reduce; PipeMoE the back-to-back all-to-all and the runner's per-chunk cost. Only
    those collectives are measured (``keys``)."""
    if not cases:
        raise ValueError("link_spec_for needs at least one case")
    top = max(dispatch_bytes(case, layout, dtype) for case in cases)
    parm = any(default_registry().is_profiled(row_schedule(s)) for s in specs)
    pipe = any(degree_needs_profile(s.option("r", "1")) for s in specs)
    keys = ("all_to_all@ep", "all_to_all@ep_esp") \
        + (("all_gather@mp", "all_gather@esp", "all_reduce@esp") if parm else ()) \
        + (("all_to_all_stream@ep", "all_to_all_stream@ep_esp") if pipe else ())
    return ProfileSpec(layout=layout, sizes_bytes=_powers_of_two(4096, min(max(2 * top, MIN_TOP_BYTES), MAX_TOP_BYTES)),
                       ops=("all_to_all",) + (("all_gather", "all_reduce", "saa") if parm else ())
                       + (("all_to_all_stream", "chunk") if pipe else ()),
                       groups=("ep", "ep_esp", "mp", "esp") if parm else ("ep", "ep_esp"), warmup=WARMUP,
                       repeats=repeats, dtype=dtype, keys=keys)


def gemm_spec_for(case: CaseConfig, layout: ParallelLayout, dtype: str, repeats: int = GEMM_REPEATS) -> ProfileSpec:
    """Pure: the GEMM part for ``case``: its local experts' shape, rows up to twice one expert's."""
    cap = capacity(case.tokens, case.experts, case.k, case.capacity_factor, case.min_capacity)
    rows = cap * layout.ep * layout.esp
    return ProfileSpec(layout=layout, gemm_rows=_powers_of_two(8, min(max(2 * rows, MIN_TOP_ROWS), MAX_TOP_ROWS)),
                       gemm_shape=(case.experts // layout.ep, case.hidden, case.ffn // layout.esp), ops=("gemm",),
                       groups=(), warmup=WARMUP, repeats=repeats, dtype=dtype)


def merge_profiles(*parts: CostProfile) -> CostProfile:
    """Pure: one profile holding every part's models and measurements. The parts must share the key and dtype
    and name no model twice."""
    problems = []
    if len({p.key for p in parts}) != 1:
        problems.append(f"keys differ ({', '.join(sorted({p.key.slug() for p in parts}))})")
    if len({p.dtype for p in parts}) != 1:
        problems.append(f"dtypes differ ({', '.join(sorted({p.dtype for p in parts}))})")
    twice = sorted(name for name, n in Counter(name for p in parts for name in p.models).items() if n > 1)
    if twice:
        problems.append(f"models in more than one part: {', '.join(twice)}")
    if not parts or problems:
        raise ValueError("cannot merge profiles: " + ("; ".join(problems) or "no parts"))
    return CostProfile(key=parts[0].key, dtype=parts[0].dtype,
                       models={k: m for p in parts for k, m in p.models.items()},
                       measurements={k: m for p in parts for k, m in p.measurements.items()},
                       source="; ".join(p.source for p in parts if p.source))


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
