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

A group of size 1 is a no-op and records nothing. gloo lacks list-form all_to_all, so only the
``_single`` / ``_into_tensor`` forms are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from moe_plugins.core.groups import Group
from moe_plugins.core.ledger import CommLedger, CommRecord


@dataclass(frozen=True)
class Recorder:
    """Where a layer's collectives are recorded: the ledger (may be None) and the layer's name."""

    ledger: Optional[CommLedger]
    layer: str

    def record(self, op: str, group: Group, numel: int, elsize: int, remote_elems: float, phase: str) -> None:
        if self.ledger is None:
            return
        self.ledger.add(CommRecord(layer=self.layer, op=op, group=group.kind, group_ranks=tuple(group.ranks),
                                   numel=int(numel), bytes=int(numel) * elsize,
                                   inter_node_bytes=int(round(remote_elems * elsize)), phase=phase))


# ---- raw collectives (no autograd), each records one ledger entry -------------------------------------

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same semantics on flat buffers).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x: torch.Tensor, group: Group, dim: int, rec: Recorder, phase: str) -> torch.Tensor:
    flat = x.contiguous().reshape(-1)
    buf = torch.empty(group.size * flat.numel(), dtype=x.dtype, device=x.device)
    _all_gather_flat(buf, flat, group=group.pg)
    rec.record("all_gather", group, buf.numel(), x.element_size(), group.remote_peers * x.numel(), phase)
    return torch.cat(list(buf.view((group.size,) + tuple(x.shape)).unbind(0)), dim=dim)


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
    out = torch.empty(stacked[0].numel(), dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, stacked.reshape(-1), group=group.pg)
    out = out.view(stacked.shape[1:])
    rec.record("reduce_scatter", group, x.numel(), x.element_size(),
               group.remote_peers * x.numel() / group.size, phase)
    return out


def _all_reduce(x: torch.Tensor, group: Group, rec: Recorder, phase: str) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group.pg)
    rec.record("all_reduce", group, x.numel(), x.element_size(),
               2 * group.remote_peers * x.numel() / group.size, phase)
    return x


def _all_to_all(x: torch.Tensor, group: Group, rec: Recorder, phase: str) -> torch.Tensor:
    if x.shape[0] % group.size:
        raise ValueError(f"all_to_all: dim 0 ({x.shape[0]}) is not divisible by the {group.kind} group size "
                         f"({group.size})")
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group.pg)
    rec.record("all_to_all", group, x.numel(), x.element_size(),
               group.remote_peers * x.numel() / group.size, phase)
    return out


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
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    rec.record("all_reduce_max", group, 1, t.element_size(), 2 * group.remote_peers / group.size, "forward")
    return int(t.item())
