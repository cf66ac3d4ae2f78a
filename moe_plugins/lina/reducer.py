"""Lina's communication scheduler for training (§4.2, §6.1): gradient buffers cut into micro-ops, issued as
background all-reduces on the rank's communication engine.

The engine does the scheduling: its background lane issues micro-ops in FIFO order and starts one only when
no MoE exchange (an urgent op) is pending or in flight on this rank, and from the moment backward reaches a
layer's combine (``Schedule.mark_combine``) until that layer's exchange is issued. A micro-op already on the
wire is not pre-empted, so at most one overlaps an exchange. ``priority=False`` is the no-priority reference
("fifo"): each buffer is one op that starts in its FIFO turn, beside the exchanges, as DeepSpeed's
reduction stream does on GPU.

Exactness: a micro-op sums the same elements over the same ranks as the host's bucket collective; with two
ranks the sum is bitwise the host's, with more it may differ in the last bits (the collective's order).
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Tuple

import torch

from moe_plugins.core.engine import BACKGROUND, CommEngine, Handle
from moe_plugins.core.groups import Group
from moe_plugins.lina.microops import micro_op_elements, micro_op_slices


class PendingReduce:
    """The micro-ops of one buffer, each ``(a, b, handle)``: :meth:`wait` puts every summed slice back into the
    buffer at ``[a, b)`` (in place) and returns it; a failed micro-op raises there (and on every rank: the engine
    is poisoned)."""

    def __init__(self, flat: torch.Tensor, parts: List[Tuple[int, int, Handle]]):
        self.flat, self._parts = flat, parts

    def done(self) -> bool:
        return all(handle.done() for _, _, handle in self._parts)

    def wait(self) -> torch.Tensor:
        parts, self._parts = self._parts, []
        for a, b, handle in parts:
            self.flat[a:b].copy_(handle.wait())
        return self.flat


class GradReducer:
    """Issues gradient all-reduces (sum) as Lina's micro-ops on ``engine``'s background lane (``engine`` built
    with ``build_engine(groups, background=True)``, shared with the MoE layers whose exchanges go first)."""

    def __init__(self, engine: CommEngine, *, micro_op_bytes: Optional[int], priority: bool = True,
                 name: str = "lina"):
        if not engine.has_lane(BACKGROUND):
            raise ValueError("GradReducer needs an engine with a background lane: build_engine(groups, "
                             "background=True)")
        if priority and not (isinstance(micro_op_bytes, int) and micro_op_bytes > 0):
            raise ValueError(f"micro_op_bytes ({micro_op_bytes!r}) must be a positive number of bytes")
        self.engine, self.micro_op_bytes, self.priority, self.name = engine, micro_op_bytes, priority, name

    def submit(self, flat: torch.Tensor, group: Group, *, phase: str = "backward") -> PendingReduce:
        """Queue the sum all-reduce of the 1-D buffer ``flat`` over ``group`` (a group of the engine's layout,
        e.g. ``groups.dp``). The caller must not touch ``flat`` until :meth:`PendingReduce.wait`."""
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"flat must be a contiguous 1-D buffer, got shape {tuple(flat.shape)}")
        chunk = micro_op_elements(self.micro_op_bytes, flat.element_size()) if self.priority else 0
        return self._queue("all_reduce", group, flat, 0, micro_op_slices(flat.numel(), chunk),
                           lambda a, b: flat[a:b], phase)

    def submit_scatter(self, flat: torch.Tensor, group: Group, member: int, *,
                       phase: str = "backward") -> PendingReduce:
        """Queue the sum reduce-scatter of ``flat`` over ``group`` as a distributed optimizer's (Megatron's):
        ``flat`` is cut into ``group.size`` equal shards, and the group's ``member`` (its index in the group)
        gets the sum of its shard written in place at :meth:`PendingReduce.wait`; the rest of ``flat`` is left as
        it is. Micro-op j reduce-scatters the j-th slice of every shard (copied together: ``group.size`` slices),
        so each shard is summed over the same ranks as by the host's one collective, and a micro-op moves about
        ``micro_op_bytes``."""
        size = group.size
        if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() % size:
            raise ValueError(f"flat must be a contiguous 1-D buffer whose length divides into {size} shards, got "
                             f"shape {tuple(flat.shape)}")
        if not 0 <= member < size:
            raise ValueError(f"member ({member}) must be an index into the group of {size}")
        shard = flat.numel() // size
        chunk = max(1, micro_op_elements(self.micro_op_bytes, flat.element_size()) // size) if self.priority else 0
        shards_GS = flat.view(size, shard)
        return self._queue("reduce_scatter", group, flat, member * shard, micro_op_slices(shard, chunk),
                           lambda a, b: shards_GS[:, a:b].reshape(-1), phase)

    def _queue(self, op: str, group: Group, flat: torch.Tensor, base: int, slices: Iterable[Tuple[int, int]],
               piece: Callable[[int, int], torch.Tensor], phase: str) -> PendingReduce:
        """One background micro-op of ``op`` per slice [a, b) (``piece(a, b)`` its input), its result landing at
        flat[base + a: base + b]."""
        parts = [(base + a, base + b, self.engine.issue(op, group, piece(a, b), priority=BACKGROUND, layer=self.name,
                                                        phase=phase, yields=self.priority))
                 for a, b in slices]
        return PendingReduce(flat, parts)
