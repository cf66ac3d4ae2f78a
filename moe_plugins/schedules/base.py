"""The schedule interface: how one MoE layer moves tokens to experts and back.

A schedule is five steps. Steps 2-4 act on one chunk of the capacity axis, so other techniques compose
with any schedule without knowing it:

1. ``prepare(x_SM)``: gate and lay tokens out for exchange; returns :class:`Dispatched`
   (the tensor ``d`` with its capacity axis ``cap_dim``, plus private state for step 5);
2. ``exchange_in(chunk)``: collectives that bring a capacity chunk to the expert shards;
3. ``expert(chunk)``: expert compute (with the ESP reduction);
4. ``exchange_out(chunk)``: collectives that bring expert outputs back;
5. ``finish(r, dispatched)``: reassemble and combine into y_SM.

:func:`run_schedule` runs steps 2-4 over ``degree`` chunks in order. Pipelining (PipeMoE), priority of
all-to-all over gradient all-reduce (Lina) and overlap with other computation (Lancet) replace that loop;
sparse materialisation (Hecate) replaces where the expert weights come from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, List, Tuple

import torch

from .. import comm
from ..comm import Recorder
from ..config import MoEConfig
from ..experts import ExpertWeights, partial_ffn
from ..gating import Routing
from ..groups import MoEProcessGroups


@dataclass(frozen=True)
class Dispatched:
    d: torch.Tensor
    cap_dim: int
    state: Any
    aux_loss: torch.Tensor
    exp_counts_E: torch.Tensor
    dropped: int


@dataclass(frozen=True)
class LayerParams:
    """What a schedule computes with: the replicated gate and this rank's expert shard."""

    wg_EM: torch.Tensor
    experts: ExpertWeights


class Schedule(ABC):
    name: ClassVar[str]

    def __init__(self, config: MoEConfig, groups: MoEProcessGroups, rec: Recorder):
        self.config, self.groups, self.rec = config, groups, rec

    @classmethod
    def layout_problems(cls, groups_layout) -> List[str]:
        """Reasons this schedule cannot run on a layout (empty when it can)."""
        return []

    @abstractmethod
    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched: ...

    @abstractmethod
    def exchange_in(self, d: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def expert(self, e: torch.Tensor, params: LayerParams) -> torch.Tensor: ...

    @abstractmethod
    def exchange_out(self, o: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def finish(self, r: torch.Tensor, dispatched: Dispatched) -> torch.Tensor: ...

    # -- helpers shared by schedules -------------------------------------------------------------------

    def uniform_capacity(self, local_max: int) -> int:
        """Dropless capacity: the largest expert count over every rank this layer exchanges with."""
        cap = comm.all_reduce_max(local_max, self.groups.ep_esp, self.rec)
        return max(1, comm.all_reduce_max(cap, self.groups.mp, self.rec))

    def sharded_expert(self, x_ENM: torch.Tensor, w: ExpertWeights, grad_scale: float = 1.0) -> torch.Tensor:
        """Expert shard on rows x_ENM (E = local experts), ESP partial sums reduced, b2 added once."""
        esp = self.groups.esp
        if grad_scale != 1.0:
            w = ExpertWeights(*(comm.grad_scale(t, grad_scale) for t in (w.w1_EMH, w.b1_EH, w.w2_EHM, w.b2_EM)))
        x_ENM = comm.copy_to(x_ENM, esp, self.rec)
        y_ENM = comm.all_reduce(partial_ffn(x_ENM, w, self.config.activation), esp, self.rec)
        return y_ENM + w.b2_EM.unsqueeze(1)


def chunk_bounds(length: int, degree: int) -> List[Tuple[int, int]]:
    """Split [0, length) into ``degree`` contiguous chunks, sizes differing by at most one; empty chunks
    are kept (a rank with fewer slots than chunks still takes part in every collective)."""
    if degree < 1:
        raise ValueError(f"pipeline degree ({degree}) must be >= 1")
    base, extra = divmod(length, degree)
    bounds, start = [], 0
    for i in range(degree):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def run_schedule(schedule: Schedule, x_SM: torch.Tensor, params: LayerParams, degree: int = 1):
    """Run a schedule with its capacity axis cut into ``degree`` chunks, one after another."""
    dispatched = schedule.prepare(x_SM, params)
    d, dim = dispatched.d, dispatched.cap_dim
    outs = [schedule.exchange_out(schedule.expert(schedule.exchange_in(d.narrow(dim, a, b - a)), params))
            for a, b in chunk_bounds(d.shape[dim], degree)]
    r = outs[0] if len(outs) == 1 else torch.cat(outs, dim=dim)
    return schedule.finish(r, dispatched), dispatched


def routing_stats(routings: List[Routing]) -> Tuple[torch.Tensor, int]:
    counts = torch.stack([r.exp_counts_E for r in routings]).sum(0)
    return counts, sum(r.dropped for r in routings)
