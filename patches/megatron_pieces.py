"""The part of each expert parameter that Megatron-core's distributed optimizer steps on this rank, moved with the
expert by Hecate's re-sharding (patches/megatron_hecate_reshard.py) at any expert-DP.

``DistributedOptimizer`` shards each param-and-grad buffer over its data-parallel group (expert-DP for the experts'
buffer): expert-DP rank d steps the d-th equal range of every bucket, so an expert parameter's master (bf16/fp16: an
fp32 tensor, ``param.main_param``; fp32: a flat view of the parameter) and its Adam moments exist here only for
the part of the flattened parameter inside that range: a :class:`Piece`, maybe empty, maybe the whole (expert-DP 1).
Which part depends on the slot (the local expert's place in the buffer), so an expert moving from slot i of one EP
rank to slot j of another needs on its new owner parts this rank never held.

:class:`GatheredPieces` therefore hands the move each expert parameter's master and moments whole: each rank puts
its piece at its offset in a parameter-sized fp32 tensor of zeros, and one sum over the expert-DP group (pieces
are disjoint and cover the parameter) gives every replica the whole, bitwise. After the move, ``done()`` writes
each slot's piece of what arrived into the optimizer's tensors, and the whole master into the parameter (its
values cast to the parameter's dtype, as Megatron's copy of the masters to the parameters does): the hook runs
inside the optimizer step, after that copy and before Megatron all-gathers the parameter buffer over expert-DP,
when only this rank's range of a parameter holds the stepped values. ``main_grad`` (DDP's buffer) moves whole. An
EP group's members hold the same ranges (the same buffer layout: compared when the optimizer is built,
:func:`check_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist



@dataclass(frozen=True)
class Piece:
    """One expert parameter's part in this rank's shard: ``main`` (None: no part here) is the flat tensor the
    torch ``optimizer`` steps for elements [start, end) of the flattened parameter; ``group``: the expert-DP group
    the parameter is sharded over (its buffer's, which the optimizer's own data-parallel group need not be: Lina's
    fixed packing builds the buffers on the packed layout's group; None: one rank)."""

    optimizer: torch.optim.Optimizer
    main: Optional[torch.Tensor]
    start: int
    end: int
    group: Optional[Any]


def pieces(opt: Any, params: Sequence[torch.nn.Parameter]) -> Dict[int, Piece]:
    """Per parameter id, its :class:`Piece` under the distributed optimizer ``opt`` (its buffers hold ``params``)."""
    fp32 = {id(p): s for model, shard in zip(opt.model_fp32_groups, opt.shard_fp32_groups)
            for p, s in zip(model, shard)}
    sharded = {p: b.data_parallel_group for b in opt.buffers for p in b.param_index_map}   # the buffer's DP group
    out = {}
    for p in params:
        group = sharded[p] if sharded[p].size() > 1 else None
        where = opt.model_param_gbuf_map.get(p)
        if where is None:                       # no element of it in this rank's shard
            out[id(p)] = Piece(opt.optimizer, None, 0, 0, group)
            continue
        buffer, dtype, bucket = where
        span = opt.gbuf_ranges[buffer][dtype][bucket]["param_map"][p]["param"]
        main = fp32[id(p)] if p.dtype == torch.float32 else p.main_param
        out[id(p)] = Piece(opt.optimizer, main, span.start, span.end, group)
    return out


def first_state(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The torch optimizer's state of its first stepped tensor (empty before any step)."""
    return next((s for s in optimizer.state.values() if s), {})


def state_keys(optimizer: torch.optim.Optimizer) -> List[str]:
    """The torch optimizer's state tensors (Adam's moments): the same on every rank once it has stepped."""
    return sorted(k for k, v in first_state(optimizer).items() if torch.is_tensor(v) and v.dim() > 0)


def whole_state(piece: Piece, param: torch.nn.Parameter, keys: Sequence[str]) -> torch.Tensor:
    """[1 + len(keys), numel] fp32: ``param``'s master and its ``keys`` moments whole, from every expert-DP rank's
    piece placed at its offset (module docstring; collective over ``piece.group``)."""
    state = piece.optimizer.state.get(piece.main, {}) if piece.main is not None else {}
    whole_KN = torch.zeros(1 + len(keys), param.numel(), dtype=torch.float32, device=param.device)
    with torch.no_grad():
        if piece.main is not None:
            for i, part in enumerate([piece.main] + [state[k] for k in keys]):
                whole_KN[i, piece.start:piece.end] = part
        if piece.group is not None:
            dist.all_reduce(whole_KN, group=piece.group)
    return whole_KN


class GatheredPieces:
    """A move's ``extra`` (moe_plugins.hecate.rehome) for parameters with a :class:`Piece` (module docstring):
    ``main_grad`` whole, then the whole master and moments (:func:`whole_state`, collective over the expert-DP
    group: every member moves the same layers' slots in the same order); ``done()`` writes them back."""

    def __init__(self, found: Dict[int, Piece]) -> None:
        self.found = found
        self.pending: List[Tuple[torch.nn.Parameter, torch.Tensor, List[torch.Tensor]]] = []
        self._keys: Dict[int, List[str]] = {}

    def keys(self, optimizer: torch.optim.Optimizer) -> List[str]:
        if id(optimizer) not in self._keys:
            self._keys[id(optimizer)] = state_keys(optimizer)
        return self._keys[id(optimizer)]

    def __call__(self, param: torch.nn.Parameter) -> List[torch.Tensor]:
        piece = self.found[id(param)]
        master, *moments = [row.clone() for row in whole_state(piece, param, self.keys(piece.optimizer))]
        self.pending.append((param, master, moments))
        grad = [param.main_grad] if getattr(param, "main_grad", None) is not None else []
        return grad + [master] + moments

    def done(self) -> None:
        """Each moved parameter's values from its whole master, its piece of the master and moments from theirs."""
        pending, self.pending = self.pending, []
        with torch.no_grad():
            for param, master, moments in pending:
                piece = self.found[id(param)]
                write_piece(piece, param, master, dict(zip(self.keys(piece.optimizer), moments)))


def write_piece(piece: Piece, param: torch.nn.Parameter, master: torch.Tensor,
                moments: Dict[str, torch.Tensor], scalars: Optional[Dict[str, Any]] = None) -> None:
    """``param``'s values from its whole ``master`` (cast to its dtype, as Megatron's copy of the masters to the
    parameters does), and ``piece``'s range of the master (bf16/fp16: its own tensor; fp32: a view of the
    parameter) and of each moment; with ``scalars`` (Adam's ``step``) the piece's optimizer state is made anew
    from them and the moments."""
    with torch.no_grad():
        param.data.view(-1).copy_(master)
        if piece.main is None:
            return
        if param.dtype != torch.float32:
            piece.main.copy_(master[piece.start:piece.end])
        state = piece.optimizer.state[piece.main]
        if scalars is not None:
            state.clear()
            state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
        for key, whole in moments.items():
            part = whole[piece.start:piece.end]
            if key in state:
                state[key].copy_(part)
            else:
                state[key] = part.clone()


__all__ = ["GatheredPieces", "Piece", "first_state", "pieces", "state_keys", "whole_state", "write_piece"]
