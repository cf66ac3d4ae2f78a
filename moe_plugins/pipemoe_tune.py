"""PipeMoE's degree checked by measurement: ``pipeline_degree="tune"``.

The cost model (:mod:`moe_plugins.pipemoe`) picks r from fitted alpha-beta terms. Where the host runs costs
the model leaves out, its pick can be off: on CPU/gloo the exchange shares the core with the experts, each
chunk pays thread hand-offs and autograd, and gloo's all-to-all is far from linear in its size
(docs/pipemoe.md). "tune" keeps the model's pick as the starting point and then times the layer itself,
the way ``torch.backends.cudnn.benchmark`` times kernels:

1. start at the model's r (:class:`~moe_plugins.pipemoe.AutoDegree`);
2. climb the ladder r, 2r, 4r, ... (at most r_max) while each rung is faster than the one before; if the
   first step up is not faster, climb down r/2, r/4, ..., 1 the same way (:func:`next_probe`, pure);
3. keep the fastest measured degree, ties within ``TIE_TOLERANCE`` going to fewer chunks (:func:`best_probe`).

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

import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from .groups import MoEProcessGroups
from .pipemoe import TIE_TOLERANCE, AutoDegree, fewest_chunks_near, _cached_choice
from .schedules.base import Dispatched, Schedule

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


def next_probe(start: int, r_max: int, times_s: Mapping[int, float]) -> Optional[int]:
    """The degree to measure next, given the measured ``times_s`` (degree -> seconds); None when done."""
    if start not in times_s:
        return start
    up = ladder(start, r_max, up=True)
    step = _walk(up, times_s)
    if step is not None:
        return step
    if len(up) > 1 and times_s[up[1]] < times_s[start]:
        return None                                     # going up helped: the optimum is not below start
    return _walk(ladder(start, r_max, up=False), times_s)


def best_probe(times_s: Mapping[int, float], tie_tolerance: float = TIE_TOLERANCE) -> int:
    """The fewest chunks within ``tie_tolerance`` of the fastest measured degree."""
    degrees = sorted(times_s)
    return degrees[fewest_chunks_near([times_s[r] for r in degrees], tie_tolerance) - 1]


# ---- one timed call -------------------------------------------------------------------------------------

@dataclass
class Sample:
    """Clock readings of one call (perf_counter seconds); ``backward`` is False for a forward-only call."""

    backward: bool
    cuda: bool
    start: float = 0.0
    forward_end: Optional[float] = None
    backward_start: Optional[float] = None
    backward_end: Optional[float] = None

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def complete(self) -> bool:
        return self.forward_end is not None and (not self.backward or self.backward_end is not None)

    def seconds(self) -> float:
        fwd = self.forward_end - self.start
        return fwd + (self.backward_end - self.backward_start if self.backward else 0.0)

    def wrap_input(self, d: torch.Tensor) -> torch.Tensor:
        """Wrap the dispatched tensor: the backward of the timed part ends when its gradient is made."""
        return _Clock.apply(d, self, "backward_end") if self.backward else d

    def wrap_output(self, y: torch.Tensor) -> torch.Tensor:
        """End the forward clock, and wrap the timed part's output: its backward starts at this gradient."""
        self.forward_end = self.now()
        return _Clock.apply(y, self, "backward_start") if self.backward else y


class _Clock(torch.autograd.Function):
    """Identity; its backward stamps ``sample.<stamp>`` when the gradient passes."""

    @staticmethod
    def forward(ctx, x, sample: Sample, stamp: str):
        ctx.sample, ctx.stamp = sample, stamp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        setattr(ctx.sample, ctx.stamp, ctx.sample.now())
        return g, None, None




# ---- the stateful tuner ---------------------------------------------------------------------------------

@dataclass
class Climb:
    """Where one key's tuning stands."""

    start: int
    r_max: int
    current: int
    times_s: Dict[int, float] = field(default_factory=dict)
    samples: List[Sample] = field(default_factory=list)
    issued: int = 0
    decided: Optional[int] = None


def agree_seconds(seconds: float, groups: MoEProcessGroups, device: torch.device) -> float:
    """Max over the ranks that run the same degree (the layer's EP&ESP group, its MP group, and the EP&ESP
    group again so that a grid of both agrees)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    for group in (groups.ep_esp, groups.mp, groups.ep_esp):
        if group.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    return float(t.item())


@dataclass(frozen=True, kw_only=True)
class TunedDegree(AutoDegree):
    """``pipeline_degree="tune"``: AutoDegree's pick, then the climb described in the module docstring."""

    warmup_calls: int = 1
    timed_calls: int = 3
    climbs: Dict[Key, Climb] = field(default_factory=dict, compare=False, repr=False)

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
        costs, n_d, n_e = self.workload(schedule, dispatched)
        key: Key = (type(schedule).name, n_d, n_e, training)
        climb = self.climbs.get(key)
        if climb is None:
            r_max = max(1, min(self.r_max, dispatched.d.shape[dispatched.cap_dim]))
            start = _cached_choice(costs, n_d, n_e, "training" if training else "forward", r_max,
                                   self.backward_factor).degree
            climb = self.climbs[key] = Climb(start=start, r_max=r_max, current=start)
        if climb.decided is None and self._probe_done(climb):
            self._advance(climb, schedule.groups, dispatched.d.device)
            if climb.decided is not None:
                self.decisions[key] = climb.decided
        if climb.decided is not None:
            return climb.decided, None
        climb.issued += 1
        if not self.warmup_calls < climb.issued <= self.warmup_calls + self.timed_calls:
            return climb.current, None
        sample = Sample(backward=training and dispatched.d.requires_grad, cuda=dispatched.d.device.type == "cuda")
        sample.start = sample.now()
        climb.samples.append(sample)
        return climb.current, sample

    def _probe_done(self, climb: Climb) -> bool:
        return len(climb.samples) == self.timed_calls and all(s.complete() for s in climb.samples)

    def _advance(self, climb: Climb, groups: MoEProcessGroups, device: torch.device) -> None:
        median = statistics.median(s.seconds() for s in climb.samples)
        climb.times_s[climb.current] = agree_seconds(median, groups, device)
        nxt = next_probe(climb.start, climb.r_max, climb.times_s)
        if nxt is None:
            climb.decided = best_probe(climb.times_s)
        else:
            climb.current, climb.samples, climb.issued = nxt, [], 0

    def notes(self) -> List[str]:
        """One line per tuned key: the model's start, what was measured, the pick."""
        out = []
        for (name, n_d, _, training), c in sorted(self.climbs.items(), key=lambda kv: kv[0]):
            measured = ", ".join(f"r={r}: {t * 1e3:.3g} ms" for r, t in sorted(c.times_s.items()))
            state = f"chose r={c.decided}" if c.decided is not None else f"still measuring r={c.current}"
            out.append(f"tune ({name}, {'training' if training else 'forward'}, n_d {n_d:.0f} B): model r="
                       f"{c.start}; measured {measured or 'nothing yet'}; {state}")
        return out
