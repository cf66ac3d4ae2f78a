"""Lina's inference exchange (§5.2, §6.2 "All-to-all coordination"): each expert's kept tokens split over the
expert's replicas by one uneven ``all_to_all_single``, computed where the replica sits, sent back by the reverse
uneven all-to-all, and combined with the gate's weights.

Shapes: S tokens, M model dim, E experts, K routes per token, C capacity, R kept routes of this rank, N EP ranks
(devices of the placement; EP index = device).

The gate's :class:`~moe_plugins.core.gating.Routing` decides, as in the stock layer, which routes are kept, in
which slot and with which weight. A kept route is identified by its slot ``flat = expert * C + slot`` of the
stock (E, C, M) buffer; this rank's kept routes are ordered by that slot (:func:`kept_routes`), so each expert's
are in slot order, which is the order :func:`~moe_plugins.lina.placement.split_tokens` hands them to the
replicas. Only kept routes travel (the stock layer sends the whole padded buffer). The expert FFN is row-wise,
so where a row is computed does not change its value: placement moves work, never results.

gloo has no list-form all_to_all; ``all_to_all_single`` with split sizes is uneven on gloo, NCCL and MPI. Both
exchanges are the core's :func:`~moe_plugins.core.ragged.uneven_all_to_all`: urgent ops of the layer's
communication engine, recorded in its ledger as ``all_to_all@ep`` with their true bytes; a failure is a
``CommError`` naming the layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import torch

from moe_plugins.core.comm import Recorder
from moe_plugins.core.dispatch import combine
from moe_plugins.core.gating import Routing
from moe_plugins.core.groups import Group
from moe_plugins.core.ragged import uneven_all_to_all
from moe_plugins.lina.placement import Placement, Splits


Compute = Callable[[int, torch.Tensor], torch.Tensor]     # (expert, x_nM) -> y_nM, on this device


@dataclass(frozen=True)
class KeptRoutes:
    """This rank's kept routes in slot order: their tokens, slots and the count per expert (host ints)."""
    token_R: torch.Tensor
    flat_R: torch.Tensor
    counts_E: Tuple[int, ...]


def kept_routes(routing: Routing, num_experts: int) -> KeptRoutes:
    """The routes the gate kept, ordered by their slot of the stock (E, C, M) buffer. One host read (the counts
    decide the uneven split sizes)."""
    slot_SK, expert_SK = routing.slot_SK, routing.expert_SK
    kept_SK = slot_SK >= 0
    token_SK = torch.arange(slot_SK.shape[0], device=slot_SK.device).unsqueeze(1).expand_as(slot_SK)
    flat_R = (expert_SK * routing.capacity + slot_SK)[kept_SK]
    order_R = torch.argsort(flat_R, stable=True)
    flat_R, token_R = flat_R[order_R], token_SK[kept_SK][order_R]
    counts_E = torch.bincount(expert_SK[kept_SK], minlength=num_experts)
    return KeptRoutes(token_R=token_R, flat_R=flat_R, counts_E=tuple(int(c) for c in counts_E.tolist()))


def send_order(splits: Splits, source: int, counts_E: Sequence[int]) -> List[int]:
    """Positions (into the kept routes in slot order) of ``source``'s rows in its send buffer: by destination
    device, then expert; each expert's routes consumed in slot order (pure)."""
    offsets, start = [], 0
    for c in counts_E:
        offsets.append(start)
        start += c
    taken = [0] * len(counts_E)
    order: List[int] = []
    for _device, expert, n in splits.pieces[source]:
        first = offsets[expert] + taken[expert]
        order.extend(range(first, first + n))
        taken[expert] += n
    if taken != list(counts_E):
        raise ValueError(f"the split of source {source} covers {taken} routes per expert; it kept {list(counts_E)}")
    return order


def receive_segments(splits: Splits, device: int) -> List[Tuple[int, int, int]]:
    """(expert, first row, rows) of ``device``'s receive buffer: the sources in rank order, each source's pieces
    for this device by expert (pure)."""
    segments, row = [], 0
    for pieces in splits.pieces:
        for d, expert, n in pieces:
            if d == device:
                segments.append((expert, row, n))
                row += n
    return segments


def replica_exchange(x_SM: torch.Tensor, routing: Routing, kept: KeptRoutes, placement: Placement, splits: Splits,
                     group: Group, rec: Recorder, compute: Compute) -> Tuple[torch.Tensor, float]:
    """The layer's output for this rank's tokens, each kept route computed on the replica ``splits`` gives it;
    and the wall milliseconds of the two token all-to-alls."""
    me, num_experts = group.rank, placement.num_experts
    order = torch.tensor(send_order(splits, me, kept.counts_E), dtype=torch.long, device=x_SM.device)
    send_rows = x_SM.index_select(0, kept.token_R.index_select(0, order))
    recv_sizes = [splits.send_RD[r][me] for r in range(len(splits.send_RD))]
    t0 = time.perf_counter()
    got_RM = uneven_all_to_all(send_rows, splits.send_RD[me], recv_sizes, group, rec)
    ms = (time.perf_counter() - t0) * 1e3
    out_RM = torch.empty_like(got_RM)
    by_expert: dict = {}
    for expert, first, n in receive_segments(splits, me):
        by_expert.setdefault(expert, []).append(torch.arange(first, first + n, device=x_SM.device))
    for expert, parts in sorted(by_expert.items()):
        rows = torch.cat(parts)
        if rows.numel():
            out_RM.index_copy_(0, rows, compute(expert, got_RM.index_select(0, rows)).to(out_RM.dtype))
    t1 = time.perf_counter()
    back_RM = uneven_all_to_all(out_RM, recv_sizes, splits.send_RD[me], group, rec)
    ms += (time.perf_counter() - t1) * 1e3
    y_flat = x_SM.new_zeros((num_experts * routing.capacity, x_SM.shape[1]))
    y_flat.index_copy_(0, kept.flat_R.index_select(0, order), back_RM)
    return combine(y_flat.view(num_experts, routing.capacity, -1), routing), ms
