"""Lina's packing controller times micro-ops in the forward pass (§6.1): here the schedule's ``expert`` step
(one FFN micro-op per capacity chunk) and its ``exchange_in`` / ``exchange_out`` steps (one all-to-all
micro-op each). :class:`TimedSchedule` wraps a layer's schedule and adds each step's wall time to a
:class:`PackingProbe`: two ``perf_counter_ns`` calls per step, no collective, nothing kept but four sums.

CPU/gloo only: a step's wall time is its compute or its blocking collective. On CUDA the steps return before
the device finishes; a host there should time with CUDA events and pass the sums to
:meth:`moe_plugins.lina.packer.PackingController.step_end` itself.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Set

import torch

from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, RowLoad, Schedule
from moe_plugins.lina.packing import MicroOpTimes


class PackingProbe:
    """Sums of the timed micro-ops since the last :meth:`take` (the schedule steps of pipelined layers run on
    the lane's thread too, hence the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times = MicroOpTimes()

    def add(self, kind: str, seconds: float) -> None:
        if kind not in ("expert", "a2a"):
            raise ValueError(f"kind ({kind!r}) must be 'expert' or 'a2a'")
        one = MicroOpTimes(expert_s=seconds, expert_n=1) if kind == "expert" else MicroOpTimes(a2a_s=seconds, a2a_n=1)
        with self._lock:
            self._times = self._times + one

    def take(self) -> MicroOpTimes:
        """The sums so far; starts new ones."""
        with self._lock:
            times, self._times = self._times, MicroOpTimes()
        return times

    def attach(self, layer: Any) -> None:
        """Time ``layer``'s schedule (a core ``MoELayer``, or any module with a ``schedule``)."""
        if isinstance(layer.schedule, TimedSchedule):
            raise ValueError(f"layer {getattr(layer, 'name', layer)!r} is already timed by a packing probe")
        layer.schedule = TimedSchedule(layer.schedule, self)

    @staticmethod
    def detach(layer: Any) -> None:
        if isinstance(layer.schedule, TimedSchedule):
            layer.schedule = layer.schedule.inner


class TimedSchedule(Schedule):
    """``inner`` with its expert and exchange steps timed into ``probe``; everything else is ``inner``'s."""

    def __init__(self, inner: Schedule, probe: PackingProbe):     # no Schedule.__init__: inner's state is used
        self.inner, self.probe = inner, probe
        self.config, self.groups, self.rec = inner.config, inner.groups, inner.rec
        self.name = inner.name
        self.needs_expert_partials = inner.needs_expert_partials

    def __getattr__(self, attr: str) -> Any:          # a schedule's own extras (Parm's plans) stay reachable
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(attr)
        return getattr(inner, attr)

    def rebuilt(self, groups: MoEProcessGroups, rec: Any = None) -> "TimedSchedule":
        """The same schedule class, freshly built on ``groups`` (after a regroup; ``rec``: its recorder, default
        the old one's), still timed."""
        return TimedSchedule(type(self.inner)(self.inner.config, groups, rec or self.inner.rec), self.probe)

    def twin(self, groups: MoEProcessGroups) -> "TimedSchedule":
        return TimedSchedule(self.inner.twin(groups), self.probe)

    def exchange(self, d: torch.Tensor) -> Exchange:
        return self.inner.exchange(d)

    def row_load(self, dispatched: Dispatched) -> Optional[RowLoad]:     # a ragged call's agreed rows (degree words)
        return self.inner.row_load(dispatched)

    def notes(self) -> List[str]:
        return self.inner.notes()

    def ran(self) -> Set[str]:
        return self.inner.ran()

    def mark_combine(self, y_SM: torch.Tensor) -> torch.Tensor:
        return self.inner.mark_combine(y_SM)

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        return self.inner.prepare(x_SM, params)

    def prefetch(self, weights: Any) -> None:
        return self.inner.prefetch(weights)

    def chunks(self, dispatched: Dispatched, degree: int) -> List[torch.Tensor]:    # the ragged exchange cuts its own
        return self.inner.chunks(dispatched, degree)

    def join(self, outs: List[torch.Tensor], dispatched: Dispatched) -> torch.Tensor:
        return self.inner.join(outs, dispatched)

    def _timed(self, kind: str, step: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        out = step(*args)
        self.probe.add(kind, (time.perf_counter_ns() - t0) * 1e-9)
        return out

    def exchange_in(self, d: torch.Tensor) -> torch.Tensor:
        return self._timed("a2a", self.inner.exchange_in, d)

    def expert(self, e: torch.Tensor, params: LayerParams) -> torch.Tensor:
        return self._timed("expert", self.inner.expert, e, params)

    def exchange_out(self, o: torch.Tensor) -> torch.Tensor:
        return self._timed("a2a", self.inner.exchange_out, o)

    def finish(self, r: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return self.inner.finish(r, dispatched)


def rebuild_schedule(schedule: Schedule, groups: MoEProcessGroups, rec: Any = None) -> Schedule:
    """``schedule``'s class built afresh on ``groups`` with ``rec`` (default: its own recorder; a timed one stays
    timed). Raises ValueError naming the problems when that class cannot run on ``groups``' layout."""
    base = schedule.inner if isinstance(schedule, TimedSchedule) else schedule
    problems = type(base).layout_problems(groups.layout)
    if problems:
        raise ValueError(f"schedule {base.name!r} cannot run on the packed layout: " + "; ".join(problems))
    if isinstance(schedule, TimedSchedule):
        return schedule.rebuilt(groups, rec)
    return type(base)(base.config, groups, rec or base.rec)
