"""PipeMoE's degree checked by measurement: ``pipeline_degree="tune"``.

The cost model (:mod:`moe_plugins.pipemoe.model`) picks r from fitted alpha-beta terms. Where the host runs costs
the model leaves out, its pick can be off: on CPU/gloo the exchange shares the core with the experts, each
chunk pays thread hand-offs and autograd, and gloo's all-to-all is far from linear in its size
(docs/pipemoe.md). "tune" keeps the model's pick as the starting point and then times the layer itself,
the way ``torch.backends.cudnn.benchmark`` times kernels:

1. start at the model's r (:class:`~moe_plugins.pipemoe.model.AutoDegree`);
2. climb the ladder r, 2r, 4r, ... (at most r_max) while each rung is faster than the one before; if the
   first step up is not faster, climb down r/2, r/4, ..., 1 the same way (:func:`next_probe`, pure);
3. probe the midpoints between the climb's fastest rung and the measured rungs beside it (one round);
4. keep the fastest measured degree, ties within ``TIE_TOLERANCE`` going to fewer chunks (:func:`best_probe`).

Each probe runs ``warmup_calls`` untimed calls, then ``timed_calls`` timed ones; a sample is the time from
the degree's choice to the end of the layer's forward exchange-expert-combine part, plus, when autograd
records, the same part of the backward (from the gradient of its output to the gradient of the dispatched
tensor). The median of a probe is agreed on by the ranks that must run the same r (max over the layer's
EP&ESP and MP groups, as the profiler takes the slowest rank), so every rank climbs alike. That agreement is
a collective in forward: every rank of those groups must call the layer equally often with the same shapes,
which holds for data-, expert- and tensor-parallel training. Decisions are per (schedule, n_d, n_e,
training), like AutoDegree's. On CUDA the clock points synchronise the device (only while tuning).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Dict, List, Mapping, Optional, Tuple

from moe_plugins.pipemoe.degree import AutoDegree, _cached_choice

from moe_plugins.pipemoe.model import fewest_chunks_near
from moe_plugins.core.schedule import Dispatched, Schedule
from moe_plugins.core.tuning import TIE_TOLERANCE, Sample, Search

Key = Tuple[str, float, float, bool]


# ---- the climb (pure) -----------------------------------------------------------------------------------

def ladder(start: int, r_max: int, up: bool) -> List[int]:
    """start, 2 start, 4 start, ... <= r_max (up), or start, start // 2, ..., 1 (down)."""
    out = [start]
    while True:
        nxt = out[-1] * 2 if up else out[-1] // 2
        if (up and nxt > r_max) or (not up and nxt < 1):
            return out
        out.append(nxt)


def _walk(rungs: List[int], times_s: Mapping[int, float]) -> Optional[int]:
    """The next rung to measure while each measured rung beats the one before it; None when the walk ends."""
    for prev, nxt in zip(rungs, rungs[1:]):
        if nxt not in times_s:
            return nxt
        if times_s[nxt] >= times_s[prev]:
            return None
    return None


def _climb(start: int, r_max: int, times_s: Mapping[int, float]) -> Optional[int]:
    up = ladder(start, r_max, up=True)
    step = _walk(up, times_s)
    if step is not None:
        return step
    if len(up) > 1 and times_s[up[1]] < times_s[start]:
        return None                                     # going up helped: the optimum is not below start
    return _walk(ladder(start, r_max, up=False), times_s)


def _refine(start: int, r_max: int, times_s: Mapping[int, float]) -> Optional[int]:
    """After the climb: the midpoints between its fastest rung and the measured rungs beside it (one
    round; the ladder doubles, so an optimum at 2 or 3 from a start of 3 or 4 would be missed)."""
    rungs = sorted(r for r in set(ladder(start, r_max, up=True)) | set(ladder(start, r_max, up=False))
                   if r in times_s)
    i = rungs.index(min(rungs, key=times_s.get))
    for j in (i - 1, i + 1):
        if 0 <= j < len(rungs):
            mid = (rungs[i] + rungs[j]) // 2
            if mid not in (rungs[i], rungs[j]) and mid not in times_s:
                return mid
    return None


def next_probe(start: int, r_max: int, times_s: Mapping[int, float]) -> Optional[int]:
    """The degree to measure next, given the measured ``times_s`` (degree -> seconds); None when done:
    the start, the climb along its ladder, then one round of midpoints (:func:`_refine`)."""
    if start not in times_s:
        return start
    step = _climb(start, r_max, times_s)
    return step if step is not None else _refine(start, r_max, times_s)


def best_probe(times_s: Mapping[int, float], tie_tolerance: float = TIE_TOLERANCE) -> int:
    """The fewest chunks within ``tie_tolerance`` of the fastest measured degree."""
    degrees = sorted(times_s)
    return degrees[fewest_chunks_near([times_s[r] for r in degrees], tie_tolerance) - 1]


# ---- the stateful tuner ---------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TunedDegree(AutoDegree):
    """``pipeline_degree="tune"``: AutoDegree's pick, then the climb described in the module docstring."""

    warmup_calls: int = 1
    timed_calls: int = 3
    searches: Dict[Key, Search[int]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        for name, low in (("warmup_calls", 0), ("timed_calls", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                problems.append(f"{name} ({value!r}) must be an integer >= {low}")
        if problems:
            raise ValueError("invalid TunedDegree: " + "; ".join(problems))
        super().__post_init__()

    def degree(self, schedule: Schedule, dispatched: Dispatched, training: bool) -> int:
        return self.begin(schedule, dispatched, training)[0]

    def begin(self, schedule: Schedule, dispatched: Dispatched, training: bool) -> Tuple[int, Optional[Sample]]:
        """The degree for this call and, while tuning, the Sample to fill (None otherwise)."""
        costs, n_d, n_e, _, r_max = self._workload(schedule, dispatched)
        key: Key = (type(schedule).name, n_d, n_e, training)
        search = self.searches.get(key)
        if search is None:
            start = _cached_choice(costs, n_d, n_e, "training" if training else "forward", r_max,
                                   self.backward_factor).degree
            search = self.searches[key] = Search(start=start, propose=partial(next_probe, start, r_max),
                                                 pick=best_probe, warmup=self.warmup_calls, timed=self.timed_calls,
                                                 decided=1 if r_max == 1 else None)
        d = dispatched.d
        r, sample = search.call(schedule.groups, d.device, training and d.requires_grad)
        if search.decided is not None:
            self.decisions[key] = search.decided
        return min(r, r_max), sample       # a ragged call's key spans calls whose slots differ: never past this one's

    def notes(self) -> List[str]:
        """One line per tuned key: the model's start, what was measured, the pick."""
        return [f"tune ({name}, {'training' if training else 'forward'}, n_d {n_d:.0f} B): "
                f"{search.describe(lambda r: f'r={r}')}"
                for (name, n_d, _, training), search in sorted(self.searches.items(), key=lambda kv: kv[0])]
