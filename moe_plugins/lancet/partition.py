"""Lancet's batch partitions in the MoE layer (Part 2): the layer's chunks follow partitions of the batch, so that
one partition's exchange flies while another partition computes (docs/lancet.md).

The gate sees the whole batch: the routing (experts, slots, drops, combine weights, aux loss) is computed once,
on all S tokens, exactly as without partitions. Partition p owns the token rows [a_p, b_p) (whole samples: the
block executor, :mod:`moe_plugins.lancet.blocks`, partitions along the batch) and carries only its own kept
routes, with the slots the whole-batch gate gave them. A partition's routes to an expert are not one slot
interval of capacity in general (top-2 places every first choice before every second one), so a partition moves
its rows in the ragged layout (:mod:`moe_plugins.core.ragged`): its kept routes in (expert, slot) order, one
uneven ``all_to_all_single`` each way. The expert FFN acts on rows one by one, so every row's output equals the
padded layer's (fp64: equal to <= 1e-12, the same dropped routes).

One call (:func:`start_partitions`), in the order the planner (:mod:`moe_plugins.lancet.plan`) models:

1. the gate, on the whole batch; the kept routes per (expert, partition) to every EP member: one even all-to-all
   of E P integers and one host read (the uneven exchanges' split sizes);
2. every partition's dispatch is *issued* on the engine's pipeline lane (when it has one: else inline);
3. partition by partition: wait for its dispatch, run the experts on its rows, issue its combine on the lane;
4. :meth:`PartitionedCall.output` (p): wait for partition p's combine and combine its rows into y_p.

While partition p's experts run, the dispatches of p+1.. fly; while the caller computes on y_p (the block
executor runs the following attention and dense layers on it), the combines of p+1.. fly. In backward each
exchange's gradient is the reverse uneven exchange. On an engine with a pipeline lane it is issued there when
autograd reaches the landing (``_Landed``) and waited for at an anchor on the exchange's input (``_Anchor``), made
before the other partitions' work, which autograd therefore runs in between (it runs later-made nodes first): the
backward pipelines the partitions too; the anchor runs Lancet's deferred weight gradients (the Recorder's
``while_in_flight``) before it waits. Without a lane the reverse exchange runs inline (:func:`reverse_exchange`).

Supported: ESP 1 and MP 1 (the baseline's data flow without the ESP all-gather and the replicas); others are
refused by :func:`partition_layout_problems`. Shapes: S tokens, M model dim, E experts (E_l local), P EP members,
R rows this rank sends for a partition, Q rows it receives, n rows per local expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from moe_plugins.core.comm import Recorder
from moe_plugins.core.engine import PIPELINE
from moe_plugins.core.gating import Routing
from moe_plugins.core.groups import Group, MoEProcessGroups
from moe_plugins.core.ops import CommError
from moe_plugins.core.ragged import (RouteOrder, combine_rows, exchange_counts, expert_rows, route_order,
                                     split_sizes)

# ---- pure pieces -----------------------------------------------------------------------------------------


MAX_PARTITIONS = 8      # the largest count "auto" and "tune" consider (and `moe-plugins plan lancet` by default)


def partition_counts(samples: int, most: Optional[int] = None) -> List[int]:
    """The partition counts that cut ``samples`` samples evenly (its divisors), up to ``most`` (None: all)."""
    top = samples if most is None else min(most, samples)
    return [k for k in range(1, top + 1) if samples % k == 0]


def partitions_problem(samples: int, parts: Any, path: str = "moe_plugins.lancet.partitions") -> Optional[str]:
    """Why ``parts`` partitions cannot cut a batch of ``samples`` samples (None when they can): they must be an
    integer >= 1 that divides it, so that every partition holds whole samples and the same number of them."""
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        return f"{path} ({parts!r}) must be an integer >= 1"
    if samples % parts:
        return (f"{path} ({parts}) must divide the batch ({samples} samples per rank): each partition holds the "
                f"same whole samples; use one of {partition_counts(samples)}")
    return None


def partition_bounds(samples: int, parts: int, rows_per_sample: int = 1) -> List[Tuple[int, int]]:
    """The rows [a, b) of each of ``parts`` equal partitions of ``samples`` samples of ``rows_per_sample`` rows."""
    problem = partitions_problem(samples, parts)
    if problem is not None:
        raise ValueError(problem)
    size = samples // parts * rows_per_sample
    return [(p * size, (p + 1) * size) for p in range(parts)]


def routing_rows(routing: Routing, a: int, b: int) -> Routing:
    """The routes of tokens [a, b) of a whole-batch routing: their experts, slots (dropped: -1) and weights as
    the whole batch gave them; capacity, aux loss and counts are the whole batch's."""
    return Routing(expert_SK=routing.expert_SK[a:b], slot_SK=routing.slot_SK[a:b], weight_SK=routing.weight_SK[a:b],
                   capacity=routing.capacity, aux_loss=routing.aux_loss, exp_counts_E=routing.exp_counts_E)


@dataclass(frozen=True)
class PartPlan:
    """One partition's exchange: rows per EP member it sends and receives, and the received rows per source and
    local expert (for :func:`~moe_plugins.core.ragged.expert_rows`)."""

    send: Tuple[int, ...]
    recv: Tuple[int, ...]
    recv_PL: Tuple[Tuple[int, ...], ...]


def part_plans(mine_EP: Sequence[Sequence[int]], recv_SLP: Sequence[Sequence[Sequence[int]]],
               members: int) -> List[PartPlan]:
    """Every partition's plan from this rank's kept routes per (expert, partition) and those each source s sends
    for each local expert l and partition p, ``recv_SLP[s][l][p]`` (pure)."""
    parts = len(mine_EP[0]) if mine_EP else 0
    plans = []
    for p in range(parts):
        recv_PL = tuple(tuple(cell[p] for cell in src) for src in recv_SLP)
        plans.append(PartPlan(send=tuple(split_sizes([cell[p] for cell in mine_EP], members)),
                              recv=tuple(sum(src) for src in recv_PL), recv_PL=recv_PL))
    return plans


# ---- the exchange, issued now and landed later ----------------------------------------------------------

class Backlog:
    """One partitioned call's reverse exchanges in backward: how many were issued and not yet waited for, at most
    (``peak``; 2 or more: the backward pipelines partitions against each other)."""

    def __init__(self) -> None:
        self.in_flight, self.peak = 0, 0

    def issue(self) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    def landed(self) -> None:
        self.in_flight -= 1


@dataclass
class _Reverse:
    """The reverse exchange of one landed exchange: issued by ``_Landed``'s backward, waited for by ``_Anchor``'s."""

    backlog: Backlog
    handle: Any = None


@dataclass(frozen=True)
class Pending:
    """An uneven exchange issued on the engine (``handle``: its result, None when the group is one rank);
    ``x``: its input behind the anchor that waits for its reverse exchange in backward."""

    x: torch.Tensor
    handle: Any
    send: Tuple[int, ...]
    recv: Tuple[int, ...]
    group: Group
    rec: Recorder
    reverse: Optional[_Reverse] = None


def issue_exchange(x_RM: torch.Tensor, send: Sequence[int], recv: Sequence[int], group: Group,
                   rec: Recorder, backlog: Optional[Backlog] = None) -> Pending:
    """Start one uneven ``all_to_all_single`` of ``x_RM``'s rows: on the engine's pipeline lane when it has one
    (returns at once), else inline. :func:`land` gives its result, with the reverse exchange as its gradient:
    issued when autograd reaches the landing and waited for when it reaches the anchor put on ``x_RM`` here, which
    autograd reaches later (it runs the nodes made later first: the other partitions' work in between)."""
    send, recv = tuple(int(n) for n in send), tuple(int(n) for n in recv)
    if group.size == 1:
        return Pending(x_RM, None, send, recv, group, rec)
    lane = PIPELINE if rec.engine.has_lane(PIPELINE) else None
    handle = rec.engine.issue("all_to_all", group, x_RM.detach().contiguous(), lane=lane, layer=rec.layer,
                              phase="forward", ledger=rec.ledger, splits=(send, recv))
    if lane is None:                  # inline both ways: the reverse exchange runs where autograd reaches it
        return Pending(x_RM, handle, send, recv, group, rec)
    reverse = _Reverse(backlog if backlog is not None else Backlog())
    return Pending(_Anchor.apply(x_RM, reverse, rec), handle, send, recv, group, rec, reverse)


class _Anchor(torch.autograd.Function):
    """Identity in forward; in backward, waits for the reverse exchange its landing issued (running the Recorder's
    ``while_in_flight`` work meanwhile) and passes its result on as the gradient."""

    @staticmethod
    def forward(ctx, x, reverse, rec):
        ctx.reverse, ctx.rec = reverse, rec
        return x.view_as(x)

    @staticmethod
    def backward(ctx, _placeholder):
        reverse = ctx.reverse
        handle, reverse.handle = reverse.handle, None
        try:
            return ctx.rec.wait_overlapped(handle), None, None
        finally:
            reverse.backlog.landed()


class _Landed(torch.autograd.Function):
    """y = the exchange of x issued earlier (forward: wait for it); backward: the reverse exchange, issued here and
    waited for by the anchor on x (a zero placeholder passes between them)."""

    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        try:
            return pending.handle.wait()
        except CommError as exc:    # a peer gone: name the layer and schedule too, as inline ops do
            raise pending.rec.failed(exc) from exc

    @staticmethod
    def backward(ctx, g):
        pending = ctx.pending
        if pending.reverse is None:
            return reverse_exchange(g.contiguous(), pending), None
        rec = pending.rec
        try:
            pending.reverse.handle = rec.engine.issue("all_to_all", pending.group, g.contiguous(), lane=PIPELINE,
                                                      layer=rec.layer, phase="backward", ledger=rec.ledger,
                                                      splits=(pending.recv, pending.send))
        except CommError as exc:
            raise rec.failed(exc) from exc
        pending.reverse.backlog.issue()
        return g.new_zeros(()).expand(pending.x.shape), None


def reverse_exchange(g_QM: torch.Tensor, pending: Pending) -> torch.Tensor:
    """The gradient of a landed exchange: the reverse uneven exchange. When the layer's Recorder carries a
    ``while_in_flight`` callback (Lancet's deferred dW) and the engine a pipeline lane, it is issued on the lane and
    the callback runs while it flies, as the core's all-to-all backward does; else inline."""
    return pending.rec.issue_overlapped("all_to_all", pending.group, g_QM, "backward",
                                        splits=(pending.recv, pending.send))


def land(pending: Pending) -> torch.Tensor:
    """The received rows of an issued exchange (autograd: its backward is the reverse uneven exchange)."""
    if pending.handle is None:
        return pending.x
    return _Landed.apply(pending.x, pending)


# ---- one partitioned layer call ----------------------------------------------------------------------------

def partition_layout_problems(groups: MoEProcessGroups) -> List[str]:
    """Why batch partitions cannot run on ``groups``' layout (empty when they can)."""
    problems = []
    if groups.esp.size != 1:
        problems.append(f"esp ({groups.esp.size}): Lancet's batch partitions run with ESP 1 in this version")
    if groups.mp.size != 1:
        problems.append(f"mp ({groups.mp.size}): Lancet's batch partitions run with MP 1 in this version")
    return problems


@dataclass(frozen=True)
class _Part:
    routing: Routing
    order: RouteOrder
    plan: PartPlan


class PartitionedCall:
    """One MoE layer call on a batch cut into partitions (module docstring): built by :func:`start_partitions`
    with every partition's experts run and combine issued; :meth:`output` lands partition p's rows."""

    def __init__(self, routing: Routing, parts: List[_Part], combines: List[Pending], backlog: Backlog):
        self.routing, self._parts, self._combines, self.backlog = routing, parts, combines, backlog
        self._landed = [False] * len(parts)
        self.block_order: Optional[List[int]] = None     # the memory order the block sees the MoE output in

    @property
    def aux_loss(self) -> torch.Tensor:
        return self.routing.aux_loss

    @property
    def exp_counts_E(self) -> torch.Tensor:
        return self.routing.exp_counts_E

    @property
    def dropped(self) -> torch.Tensor:
        return self.routing.dropped

    def __len__(self) -> int:
        return len(self._parts)

    def output(self, p: int) -> torch.Tensor:
        """y of partition p's tokens (rows [a_p, b_p) of the layer's output), landing its combine. Each once, in
        order: the exchanges are collective, so every rank lands them in the same order."""
        if p != sum(self._landed):
            raise ValueError(f"partition {p}: outputs are landed once each, in order; next is {sum(self._landed)} "
                             f"of {len(self._parts)}")
        self._landed[p] = True
        part = self._parts[p]
        r_RM = land(self._combines[p])
        return combine_rows(r_RM, part.order.pos_NSK[0], part.routing)


def _experts_on(e_QM: torch.Tensor, plan: PartPlan, experts: Callable[[torch.Tensor], torch.Tensor], ep: int,
                num_local: int) -> torch.Tensor:
    """The local experts on a partition's received rows (grouped per local expert, padded locally, as the
    ragged baseline does), back in received order."""
    model_dim = e_QM.shape[-1]
    gather, back, rows = expert_rows(plan.recv_PL, multiple=ep)        # DeepSpeed's experts split rows by EP
    padded = torch.cat([e_QM, e_QM.new_zeros(1, model_dim)])
    x_ElnM = padded.index_select(0, torch.tensor(gather, dtype=torch.long, device=e_QM.device))
    y_ElnM = experts(x_ElnM.view(num_local, rows, model_dim))
    return y_ElnM.reshape(-1, model_dim).index_select(0, torch.tensor(back, dtype=torch.long, device=e_QM.device))


def start_partitions(x_SM: torch.Tensor, bounds: Sequence[Tuple[int, int]], *,
                     router: Callable[[torch.Tensor], Routing], experts: Callable[[torch.Tensor], torch.Tensor],
                     groups: MoEProcessGroups, num_experts: int, rec: Recorder) -> PartitionedCall:
    """Gate ``x_SM`` whole, then run steps 1-3 of the module docstring for the partitions ``bounds`` (rows
    [a, b), covering the tokens in order). ``router`` and ``experts`` are the layer's (``LayerParams``'s)."""
    problems = partition_layout_problems(groups)
    if problems:
        raise ValueError(f"layer {rec.layer!r}: " + "; ".join(problems))
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != x_SM.shape[0] or any(
            b0 != a1 for (_, b0), (a1, _) in zip(bounds, bounds[1:])):
        raise ValueError(f"partition bounds {list(bounds)} must cover the layer's {x_SM.shape[0]} tokens in order")
    ep = groups.ep
    routing = router(x_SM)
    routings = [routing_rows(routing, a, b) for a, b in bounds]
    orders = [route_order([r], num_experts) for r in routings]
    counts_EP = torch.cat([o.counts_EN for o in orders], dim=1)
    mine_EP, recv_SLP, _ = exchange_counts(RouteOrder(token_X=counts_EP, pos_NSK=counts_EP, counts_EN=counts_EP,
                                                      top_EN=counts_EP), ep, rec)        # the one host read
    plans = part_plans(mine_EP, recv_SLP, ep.size)
    parts = [_Part(r, o, plan) for r, o, plan in zip(routings, orders, plans)]
    backlog = Backlog()
    dispatches = []
    for (a, b), part in zip(bounds, parts):
        kept = sum(part.plan.send)
        d_RM = x_SM[a:b].index_select(0, part.order.token_X[:kept])
        dispatches.append(issue_exchange(d_RM, part.plan.send, part.plan.recv, ep, rec, backlog))
    combines = []
    for part, pending in zip(parts, dispatches):
        o_QM = _experts_on(land(pending), part.plan, experts, ep.size, num_experts // ep.size)
        combines.append(issue_exchange(o_QM, part.plan.recv, part.plan.send, ep, rec, backlog))
    return PartitionedCall(routing, parts, combines, backlog)


def layer_start(layer: Any, x: torch.Tensor, parts: int, rows_per_sample: int = 1) -> PartitionedCall:
    """:func:`start_partitions` for the core :class:`~moe_plugins.core.layer.MoELayer` ``layer`` on ``x`` (its
    leading dimension: samples of ``rows_per_sample`` tokens), cut into ``parts`` equal partitions of samples."""
    from functools import partial

    from moe_plugins.core.experts import sharded_experts
    from moe_plugins.core.router import route_tokens

    x_SM = x.reshape(-1, x.shape[-1])
    bounds = partition_bounds(x_SM.shape[0] // rows_per_sample, parts, rows_per_sample)
    router = partial(route_tokens, wg_EM=layer.wg_EM, config=layer.config, groups=layer.groups, rec=layer.rec)
    experts = partial(sharded_experts, weights=layer.expert_weights, activation=layer.config.activation,
                      esp=layer.groups.esp, rec=layer.rec)
    return start_partitions(x_SM, bounds, router=router, experts=experts, groups=layer.groups,
                            num_experts=layer.config.num_experts, rec=layer.rec)
