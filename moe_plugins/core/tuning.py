"""Timing a layer's own calls, for the choices that check a cost model by measurement (a paper's tuned
degree policy or schedule, e.g. in moe_plugins/pipemoe/tune.py and moe_plugins/parm/tune.py).

A :class:`Sample` is one call's clock: started when the choice is made, ended in forward by
:meth:`Sample.wrap_output`, and, when autograd records, timed again in backward from the gradient of the
wrapped output to the gradient of the wrapped input (:meth:`Sample.wrap_input`). On CUDA each reading
synchronises the device (only calls being timed are sampled). :func:`agree_seconds` makes the ranks that
must choose alike see one number: the slowest rank's, as the profiler takes it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Generic, List, Mapping, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist

from moe_plugins.core.groups import MoEProcessGroups

C = TypeVar("C")       # a candidate: a degree, a schedule name
# Measured medians within 1% of the fastest count as ties (each tuner breaks them towards its cheaper or
# modelled choice).
TIE_TOLERANCE = 0.01


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
        """Wrap the timed part's input: its backward ends when this gradient is made."""
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


def agree_seconds(seconds: float, groups: MoEProcessGroups, device: torch.device) -> float:
    """Max over the ranks that must make the same choice (the layer's EP&ESP group, its MP group, and the
    EP&ESP group again so that a grid of both agrees). A collective: each of them calls it at the same call."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    for group in (groups.ep_esp, groups.mp, groups.ep_esp):
        if group.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    return float(t.item())


@dataclass
class Probe(Generic[C]):
    """The calls at one candidate: ``warmup`` untimed, then ``timed`` timed ones."""

    candidate: C
    warmup: int
    timed: int
    issued: int = 0
    samples: List[Sample] = field(default_factory=list)

    def call(self, backward: bool, cuda: bool) -> Optional[Sample]:
        self.issued += 1
        if not self.warmup < self.issued <= self.warmup + self.timed:
            return None
        sample = Sample(backward=backward, cuda=cuda)
        sample.start = sample.now()
        self.samples.append(sample)
        return sample

    def done(self) -> bool:
        """Every timed call made and clocked (a call's backward may still be pending, e.g. under 1F1B)."""
        return len(self.samples) == self.timed and all(s.complete() for s in self.samples)

    def median_s(self) -> float:
        return statistics.median(s.seconds() for s in self.samples)


@dataclass
class Search(Generic[C]):
    """One decision made by measurement: ``propose(times)`` names the next candidate to time (None: enough),
    ``pick(times)`` the final choice; ``start`` is the cost model's pick (for notes). Every rank that must
    choose alike runs the same calls, so each probe ends at the same call everywhere and the agreed times,
    hence the proposals, are the same."""

    start: C
    propose: Callable[[Mapping[C, float]], Optional[C]]
    pick: Callable[[Mapping[C, float]], C]
    warmup: int
    timed: int
    times_s: Dict[C, float] = field(default_factory=dict)
    probe: Optional[Probe[C]] = None
    decided: Optional[C] = None

    def call(self, groups: MoEProcessGroups, device: torch.device, backward: bool) -> Tuple[C, Optional[Sample]]:
        """The candidate for this call and, if it is timed, its Sample."""
        if self.decided is None and (self.probe is None or self.probe.done()):
            if self.probe is not None:
                self.times_s[self.probe.candidate] = agree_seconds(self.probe.median_s(), groups, device)
            nxt = self.propose(self.times_s)
            if nxt is None:
                self.decided = self.pick(self.times_s)
            else:
                self.probe = Probe(nxt, self.warmup, self.timed)
        if self.decided is not None:
            return self.decided, None
        return self.probe.candidate, self.probe.call(backward, device.type == "cuda")

    def describe(self, fmt: Callable[[C], str] = str) -> str:
        measured = ", ".join(f"{fmt(c)}: {t * 1e3:.3g} ms" for c, t in self.times_s.items())
        state = (f"chose {fmt(self.decided)}" if self.decided is not None
                 else f"still measuring {fmt(self.probe.candidate)}" if self.probe else "not started")
        return f"model's pick {fmt(self.start)}; measured {measured or 'nothing yet'}; {state}"
