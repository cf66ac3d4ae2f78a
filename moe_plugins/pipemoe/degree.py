"""PipeMoE's ``pipeline_degree="auto"``: the degree of each layer call from its dispatched tensor and the
cost profile (the time model is :mod:`moe_plugins.pipemoe.model`; docs/pipemoe.md explains both).

Shapes: E experts, C capacity, M model dim, H FFN hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, Mapping, Optional, Tuple, Union

from moe_plugins.core.costmodel import PipeCosts
from moe_plugins.core.schedule import Dispatched, Schedule
from moe_plugins.pipemoe.model import R_MAX, DegreeChoice, choose_degree

@dataclass(frozen=True, kw_only=True)
class AutoDegree:
    """``pipeline_degree="auto"``: pick r per layer call from the dispatched tensor's shape and the costs
    (``costs`` keyed by the exchange's group kind, "ep" or "ep_esp"). Objective: forward + backward when
    autograd records, else forward only. Deterministic, so every rank of an exchange group (same shapes)
    picks the same r."""

    costs: Mapping[str, PipeCosts]
    r_max: int = R_MAX
    backward_factor: float = 2.0
    source: str = ""
    # what it chose, per (schedule, n_d bytes, n_e macs, training): for logs and reports, not for deciding
    decisions: Dict[Tuple[str, float, float, bool], int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = [f"costs[{k!r}]: {p}" for k, c in self.costs.items() for p in c.problems()]
        if not self.costs:
            problems.append("costs ({}) must name at least one exchange group, e.g. 'ep'")
        if not isinstance(self.r_max, int) or self.r_max < 1:
            problems.append(f"r_max ({self.r_max!r}) must be a positive integer")
        if problems:
            raise ValueError("invalid AutoDegree: " + "; ".join(problems))

    def workload(self, schedule: Schedule, dispatched: Dispatched) -> Tuple[PipeCosts, float, float]:
        """(costs, n_d, n_e) of this call: bytes into one exchange all-to-all, macs of one expert GEMM."""
        return self._workload(schedule, dispatched)[:3]

    def _workload(self, schedule: Schedule, dispatched: Dispatched) -> Tuple[PipeCosts, float, float, int, int]:
        """:meth:`workload`, the size of the exchange's group and the most chunks the call can be cut into.
        A ragged call (``Schedule.row_load``) is priced by its busiest rank's rows, rounded up to the grid of
        :func:`grid_rows`; a padded one by its dispatched tensor's shape."""
        name = type(schedule).name
        d, cfg, groups = dispatched.d, schedule.config, schedule.groups
        ex = schedule.exchange(d)
        if ex is None:
            raise ValueError(f"pipeline_degree 'auto' does not know the exchange of schedule {name!r}: it "
                             "describes none (Schedule.exchange)")
        if ex.group not in self.costs:
            raise ValueError(f"pipeline_degree 'auto' needs all-to-all costs on group {ex.group!r} for schedule "
                             f"{name!r}; it has: {', '.join(sorted(self.costs))}")
        width, size = d.shape[-1], getattr(groups, ex.group).size
        load = schedule.row_load(dispatched)
        if load is not None:        # the rows are what travels (a dump's copies included) and what the experts get
            sent, rows, slots = grid_rows(max(load.sent, load.received)), grid_rows(load.received), load.slots
            n_d = float(sent * width * d.element_size())
        else:
            rows, slots = d.numel() // max(width, 1) * ex.rows, d.shape[dispatched.cap_dim]
            n_d = float(d.numel() * d.element_size() * ex.sent)
        return (self.costs[ex.group], n_d, float(rows * width * (cfg.ffn // groups.esp.size)), size,
                max(1, min(self.r_max, slots)))

    def begin(self, schedule: Schedule, dispatched: Dispatched, training: bool) -> Tuple[int, Optional[object]]:
        """(degree, None): the degree of this call; a subclass that times calls (pipemoe_tune.TunedDegree)
        returns a sample with ``wrap_input`` / ``wrap_output`` in place of None."""
        return self.degree(schedule, dispatched, training), None

    def degree(self, schedule: Schedule, dispatched: Dispatched, training: bool) -> int:
        costs, n_d, n_e, group_size, r_max = self._workload(schedule, dispatched)
        if nothing_to_overlap(group_size, n_d):      # r > 1 would only add chunks
            self.decisions[(type(schedule).name, n_d, n_e, training)] = 1
            return 1
        r = _cached_choice(costs, n_d, n_e, "training" if training else "forward", r_max,
                           self.backward_factor).degree
        self.decisions[(type(schedule).name, n_d, n_e, training)] = r
        return r


def grid_rows(rows: int) -> int:
    """``rows`` rounded up to the quarter-octave grid 1, 2, ..., 8, 10, 12, 14, 16, 20, 24, ... (at most 25%
    above ``rows``; pure): ragged calls of about the same volume share a decision
    (AutoDegree's cache, TunedDegree's search) instead of each call's exact row count making a new one."""
    if rows <= 8:
        return max(0, int(rows))
    octave = 1 << (int(rows).bit_length() - 1)           # the power of two at or below rows
    step = octave // 4
    return -(-int(rows) // step) * step


def nothing_to_overlap(exchange_group_size: int, n_d: float) -> bool:
    """Whether the exchange moves nothing (a group of one rank, or no bytes): then the pipeline has no
    communication to hide and every chunk past the first is pure overhead, whatever the costs say."""
    return exchange_group_size <= 1 or n_d <= 0


@lru_cache(maxsize=256)
def _cached_choice(costs: PipeCosts, n_d: float, n_e: float, objective: str, r_max: int,
                   backward_factor: float) -> DegreeChoice:
    return choose_degree(costs, n_d, n_e, objective=objective, r_max=r_max, backward_factor=backward_factor)


Degree = Union[int, AutoDegree]
