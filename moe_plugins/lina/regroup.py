"""Regrouping MoE layers onto a packed (or unpacked) layout: the expert parameters, their gradients and their
optimizer state move with one all-to-all per fine EP group (``packing.move_plan``); global expert ids stay.

Collective over every rank of the layout, at a step boundary (after ``optimizer.step()``, before the next
forward). The parameters stay the same ``nn.Parameter`` objects (their ``.data`` is replaced), so the
optimizer's parameter groups and any hooks on them remain valid; their optimizer state tensors shaped like
the parameter (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's ``momentum_buffer``) are replaced by the moved ones,
and scalar state (Adam's ``step``) is kept.

The engine has no uneven all-to-all, so the move runs ``torch.distributed.all_to_all_single`` with split
sizes on the fine EP group's process group (gloo and NCCL both have it), and records itself in the layer's
engine (ledger/timeline) as ``all_to_all@ep``, phase ``"regroup"``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.comm import Recorder
from moe_plugins.core.executor import Sequential
from moe_plugins.core.groups import Group, MoEProcessGroups, int_spread
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.lina.packing import EXPERT_KEYS, expert_block, move_plan, regroup_problems
from moe_plugins.lina.probe import rebuild_schedule

log = logging.getLogger(__name__)

Moved = Tuple[torch.nn.Parameter, str, torch.Tensor]     # (parameter, "data" | "grad" | optimizer key, tensor)


def regroup_layers(layers: Sequence[Any], groups: MoEProcessGroups, optimizer: Optional[Any] = None) -> None:
    """Move ``layers`` (core ``MoELayer``s sharing one layout and expert count) onto ``groups``' layout, with
    the gradients and the ``optimizer`` state of their expert parameters. Every check runs before anything
    moves; a ValueError lists every problem."""
    if not layers:
        raise ValueError("regroup_layers needs at least one MoE layer")
    old = layers[0].groups
    num_experts = layers[0].config.num_experts
    problems = regroup_problems(old.layout, groups.layout, num_experts)
    for layer in layers:
        if layer.groups.layout != old.layout or layer.config.num_experts != num_experts:
            problems.append(f"layer {layer.name!r}: every layer must share the layout and num_experts of "
                            f"{layers[0].name!r} ({num_experts})")
        if not isinstance(layer.executor, Sequential):
            problems.append(f"layer {layer.name!r} runs {layer.executor!r}: its engine's lane groups belong to the "
                            "old layout; regroup the layers of a Sequential executor (rebuild a pipelined one "
                            "on the new groups' engine)")
    if problems:
        raise ValueError("cannot regroup: " + "; ".join(problems))
    schedules = [rebuild_schedule(layer.schedule, groups) for layer in layers]   # raises before moving
    if old.layout.ep != groups.layout.ep:
        items = [item for layer in layers for item in _moved(layer, optimizer)]
        new = move_experts([t for _, _, t in items], num_experts, old, groups, layers[0].rec)
        for (param, slot, _), tensor in zip(items, new):
            _assign(param, slot, tensor, optimizer)
        log.info("lina packing: regrouped %d MoE layers from ep %d to ep %d (%d experts; %d tensors moved)",
                 len(layers), old.layout.ep, groups.layout.ep, num_experts, len(items))
    for layer, schedule in zip(layers, schedules):
        layer.groups, layer.schedule = groups, schedule


def _moved(layer: Any, optimizer: Optional[Any]) -> List[Moved]:
    """What moves with each expert parameter: its values, its gradient (if any) and its optimizer state
    shaped like it, in a fixed order (the same on every rank in lockstep training; checked before moving)."""
    items: List[Moved] = []
    for name in EXPERT_KEYS:
        param = getattr(layer, name)
        items.append((param, "data", param.data))
        if param.grad is not None:
            items.append((param, "grad", param.grad))
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        for key in sorted(state, key=str):
            if torch.is_tensor(state[key]) and state[key].shape == param.shape:
                items.append((param, key, state[key]))
    return items


def _assign(param: torch.nn.Parameter, slot: str, tensor: torch.Tensor, optimizer: Optional[Any]) -> None:
    if slot == "data":
        param.data = tensor
    elif slot == "grad":
        param.grad = tensor
    else:
        optimizer.state[param][slot] = tensor


def move_experts(items: Sequence[Sequence[torch.Tensor]], num_experts: int, old_groups: MoEProcessGroups,
                 new_groups: MoEProcessGroups, rec: Optional[Recorder] = None) -> List[torch.Tensor]:
    """Whole experts moved from ``old_groups``' layout to ``new_groups``' (EP degrees dividing one another):
    ``items[n][i]`` is item ``n``'s tensor for this rank's ``i``-th local expert under the old layout (a stacked
    ``[E_l, ...]`` tensor or a list of per-expert tensors; every item holds one tensor per local expert); the
    result, per item, is the stacked ``[E_l', ...]`` tensor for the new local experts. One all-to-all per dtype
    (one in practice) on this rank's EP group of the finer layout, recorded in ``rec``'s engine and ledger."""
    old, new = old_groups.layout, new_groups.layout
    fine = (old_groups if old.ep >= new.ep else new_groups).ep
    plan = move_plan(num_experts, old.ep, new.ep)
    j = fine.rank
    old_ids = expert_block(plan.num_experts, old.ep, j % old.ep)
    new_ids = expert_block(plan.num_experts, new.ep, j % new.ep)
    out: List[Optional[torch.Tensor]] = [None] * len(items)
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for n, t in enumerate(items):
        if len(t) != len(old_ids):
            raise ValueError(f"item {n} holds {len(t)} experts; this rank holds {len(old_ids)} under ep {old.ep}")
        by_dtype.setdefault(t[0].dtype, []).append(n)
    _check_same_everywhere(sum(t[0].numel() for t in items), len(items), len(by_dtype), fine)
    for idx in by_dtype.values():
        tensors = [items[n] for n in idx]
        widths = [t[0].numel() for t in tensors]
        width = sum(widths)
        rows = [torch.cat([t[e - old_ids.start].reshape(-1) for t in tensors])
                for i in range(plan.size) for e in plan.sends[j][i]]
        send = torch.cat(rows) if rows else tensors[0][0].new_empty(0)
        in_splits = [len(plan.sends[j][i]) * width for i in range(plan.size)]
        out_splits = [len(plan.sends[i][j]) * width for i in range(plan.size)]
        recv = send.new_empty(sum(out_splits))
        if fine.pg is None:
            recv.copy_(send)
        else:
            start = time.perf_counter_ns()
            dist.all_to_all_single(recv, send.contiguous(), out_splits, in_splits, group=fine.pg)
            _record(rec, fine, send, in_splits, new, start)
        order = plan.received(j)
        got = recv.view(len(order), width)
        rows_by_id = {e: got[k] for k, e in enumerate(order)}
        stacked = torch.stack([rows_by_id[e] for e in new_ids])       # new local order
        offset = 0
        for n, t, w in zip(idx, tensors, widths):
            out[n] = stacked[:, offset:offset + w].reshape((len(new_ids),) + tuple(t[0].shape)).clone()
            offset += w
    return out


def _check_same_everywhere(width: int, count: int, dtypes: int, fine: Group) -> None:
    """Every member must move the same tensors (else the all-to-all's splits disagree): compare max and min of
    (elements per expert, tensors, dtypes) over the fine EP group."""
    mine = [width, count, dtypes]
    high, low = int_spread(mine, fine.pg)
    if high != mine or low != mine:
        raise ValueError(f"expert tensors to move differ across EP group {list(fine.ranks)}: (elements per expert, "
                         f"tensors, dtypes) here {mine}, max {high}, min {low}; regroup at a step boundary with "
                         "the same gradients and optimizer state on every rank (e.g. after zero_grad on all)")


def _record(rec: Optional[Recorder], fine: Group, send: torch.Tensor, in_splits: List[int], layout: ParallelLayout,
            start_ns: int) -> None:
    if rec is None:
        return
    engine = rec.engine
    me = layout.node_of(fine.ranks[fine.rank])
    remote = sum(n for r, n in zip(fine.ranks, in_splits) if layout.node_of(r) != me)
    engine.record(layer="lina-packing", op="all_to_all", group=fine, numel=send.numel(), elsize=send.element_size(),
                  remote_elems=remote, phase="regroup", ledger=rec.ledger, start_ns=start_ns)
