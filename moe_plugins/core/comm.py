"""Autograd-correct collectives that record themselves in a CommLedger.

Each op is a pair of forward/backward collectives (Megatron's mapping functions):

=====================  ========================  ==========================
op                      forward                   backward
=====================  ========================  ==========================
``all_gather``          all-gather along dim      own block (``bwd="split"``) or
                                                   reduce-scatter (``bwd="reduce_scatter"``)
``split``               own block along dim        all-gather
``all_reduce``          all-reduce (sum)           identity
``copy_to``             identity                   all-reduce (sum)
``all_to_all``          all-to-all on dim 0        all-to-all on dim 0
``reduce_scatter``      reduce-scatter along dim   all-gather
=====================  ========================  ==========================

A group of size 1 is a no-op and records nothing. Every collective goes through the Recorder's
communication engine (:mod:`moe_plugins.core.engine`) as an URGENT op, which times and records it; a Recorder
built without an engine gets an inline, urgent-only one of its own (no process groups, no threads).
gloo lacks list-form all_to_all, so only the ``_single`` / flat forms are used.

Work while an exchange flies: a Recorder may carry ``while_in_flight(handle)``. Then an all-to-all's backward
(a layer's backward exchange) is issued on the engine's pipeline lane, when it has one, the callback runs on
this thread while the exchange is in flight, and the result is waited for after it (Lancet runs deferred weight
gradients there). Without the callback or the lane, the exchange runs inline as any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from moe_plugins.core.engine import PIPELINE, URGENT, CommEngine
from moe_plugins.core.ops import CommError, Splits
from moe_plugins.core.groups import Group
from moe_plugins.core.ledger import CommLedger


@dataclass(frozen=True)
class Recorder:
    """Where a layer's collectives go: its engine (None: an inline, urgent-only one), the ledger that records
    them (may be None), the layer's name and its schedule's (named, with the op, when a collective fails)."""

    ledger: Optional[CommLedger]
    layer: str
    engine: Optional[CommEngine] = field(default=None, compare=False)
    schedule: str = field(default="", compare=False)
    # called with the Handle of a backward all-to-all in flight on the pipeline lane (module docstring)
    while_in_flight: Optional[Callable[[Any], None]] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.engine is None:
            object.__setattr__(self, "engine", CommEngine())

    def issue(self, op: str, group: Group, x: torch.Tensor, phase: str, reduce: str = "sum",
              splits: Splits = None) -> torch.Tensor:
        """Run ``op`` now as an urgent op of this layer (inline, or on the lane whose thread this is); ``splits``:
        an uneven all_to_all's (send, receive) rows per member. A failure is a CommError that names the layer, the
        schedule and the collective."""
        try:
            return self.engine.issue(op, group, x, priority=URGENT, reduce=reduce, layer=self.layer, phase=phase,
                                     ledger=self.ledger, splits=splits).wait()
        except CommError as exc:
            raise self.failed(exc) from exc

    def issue_overlapped(self, op: str, group: Group, x: torch.Tensor, phase: str,
                         splits: Splits = None) -> torch.Tensor:
        """``op`` on the engine's pipeline lane, ``while_in_flight(handle)`` run here meanwhile, then its result
        (:meth:`issue` when there is no callback or no pipeline lane). On the lane's own thread it runs inline."""
        if self.while_in_flight is None or not self.engine.has_lane(PIPELINE):
            return self.issue(op, group, x, phase, splits=splits)
        try:
            handle = self.engine.issue(op, group, x, priority=URGENT, lane=PIPELINE, layer=self.layer, phase=phase,
                                       ledger=self.ledger, splits=splits)
        except CommError as exc:
            raise self.failed(exc) from exc
        return self.wait_overlapped(handle)

    def wait_overlapped(self, handle: Any) -> torch.Tensor:
        """The result of an op in flight, ``while_in_flight(handle)`` run first when there is a callback; a failed
        collective raised naming the layer and schedule."""
        try:
            try:
                if self.while_in_flight is not None:
                    self.while_in_flight(handle)
            finally:
                out = handle.wait()          # the exchange is collective: wait for it even if the callback failed
            return out
        except CommError as exc:
            raise self.failed(exc) from exc

    def failed(self, exc: BaseException) -> CommError:
        """``exc`` (a collective of this layer failed) as a CommError that also names the schedule."""
        return CommError(f"layer {self.layer!r}, schedule {self.schedule or '?'!r}: {exc}")

    def record(self, op: str, group: Group, numel: int, elsize: int, remote_elems: float, phase: str, *,
               start_ns: int = 0) -> None:
        """Record a collective issued outside the engine (a composite such as Parm's SAA), ending now."""
        self.engine.record(layer=self.layer, op=op, group=group, numel=numel, elsize=elsize,
                           remote_elems=remote_elems, phase=phase, ledger=self.ledger, start_ns=start_ns)


# ---- raw collectives (no autograd), each one urgent engine op ------------------------------------------

def _gather(x: torch.Tensor, group: Group, dim: int, rec: Recorder, phase: str) -> torch.Tensor:
    flat = rec.issue("all_gather", group, x.contiguous().reshape(-1), phase)
    return torch.cat(list(flat.view((group.size,) + tuple(x.shape)).unbind(0)), dim=dim)


def _own_block(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the {group.kind} group "
                         f"size ({group.size})")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int, rec: Recorder, phase: str) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the {group.kind} group "
                         f"size ({group.size})")
    stacked = torch.stack(x.chunk(group.size, dim=dim), dim=0).contiguous()
    return rec.issue("reduce_scatter", group, stacked.reshape(-1), phase).view(stacked.shape[1:])


def _all_reduce(x: torch.Tensor, group: Group, rec: Recorder, phase: str) -> torch.Tensor:
    return rec.issue("all_reduce", group, x.contiguous(), phase)


def _all_to_all(x: torch.Tensor, group: Group, rec: Recorder, phase: str) -> torch.Tensor:
    if x.shape[0] % group.size:
        raise ValueError(f"all_to_all: dim 0 ({x.shape[0]}) is not divisible by the {group.kind} group size "
                         f"({group.size})")
    if phase == "backward":
        return rec.issue_overlapped("all_to_all", group, x.contiguous(), phase)
    return rec.issue("all_to_all", group, x.contiguous(), phase)


# ---- autograd functions -------------------------------------------------------------------------------

class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, bwd, rec):
        ctx.group, ctx.dim, ctx.bwd, ctx.rec = group, dim, bwd, rec
        return _gather(x, group, dim, rec, "forward")

    @staticmethod
    def backward(ctx, g):
        if ctx.bwd == "split":
            return _own_block(g, ctx.group, ctx.dim), None, None, None, None
        return _reduce_scatter(g, ctx.group, ctx.dim, ctx.rec, "backward"), None, None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, rec):
        ctx.group, ctx.dim, ctx.rec = group, dim, rec
        return _own_block(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, ctx.dim, ctx.rec, "backward"), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rec):
        return _all_reduce(x, group, rec, "forward")

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rec):
        ctx.group, ctx.rec = group, rec
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group, ctx.rec, "backward"), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rec):
        ctx.group, ctx.rec = group, rec
        return _all_to_all(x, group, rec, "forward")

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.group, ctx.rec, "backward"), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, rec):
        ctx.group, ctx.dim, ctx.rec = group, dim, rec
        return _reduce_scatter(x, group, dim, rec, "forward")

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, ctx.dim, ctx.rec, "backward"), None, None, None


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


# ---- public API ---------------------------------------------------------------------------------------

def all_gather(x: torch.Tensor, group: Group, rec: Recorder, dim: int = 0, bwd: str = "reduce_scatter"):
    if bwd not in ("split", "reduce_scatter"):
        raise ValueError(f"all_gather bwd ({bwd!r}) must be 'split' or 'reduce_scatter'")
    return x if group.size == 1 else _AllGather.apply(x, group, dim, bwd, rec)


def split(x: torch.Tensor, group: Group, rec: Recorder, dim: int = 0) -> torch.Tensor:
    return x if group.size == 1 else _Split.apply(x, group, dim, rec)


def all_reduce(x: torch.Tensor, group: Group, rec: Recorder) -> torch.Tensor:
    return x if group.size == 1 else _AllReduce.apply(x, group, rec)


def copy_to(x: torch.Tensor, group: Group, rec: Recorder) -> torch.Tensor:
    return x if group.size == 1 else _CopyTo.apply(x, group, rec)


def all_to_all(x: torch.Tensor, group: Group, rec: Recorder) -> torch.Tensor:
    return x if group.size == 1 else _AllToAll.apply(x, group, rec)


def reduce_scatter(x: torch.Tensor, group: Group, rec: Recorder, dim: int = 0) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatter.apply(x, group, dim, rec)


def grad_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by ``scale`` (used to normalise duplicated work)."""
    return x if scale == 1 else _GradScale.apply(x, scale)


def all_reduce_max(value: int, group: Group, rec: Recorder) -> int:
    """Max of an integer over the group (no autograd): O(1) elements, recorded like any collective."""
    if group.size == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    return int(rec.issue("all_reduce", group, t, "forward", reduce="max").item())
