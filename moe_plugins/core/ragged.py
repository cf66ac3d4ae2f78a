"""The ragged exchange (``"exchange": "ragged"``): only occupied capacity slots travel.

The padded exchange sends the whole (E, C, M) buffer, empty slots included (dropless: every expert padded to
the hottest). The ragged one sends a layer's kept routes only:

1. the split sizes go first: this rank's kept routes per expert (E integers), one even ``all_to_all`` over EP,
   so every rank learns how many rows each source sends to each of its local experts;
2. one host read of those counts (the uneven exchange's split sizes must be known on the host);
3. the rows, ordered by (expert, token block, slot), in ONE uneven ``all_to_all_single`` (gloo supports uneven
   split sizes, and has no list-form all_to_all); its backward is the reverse uneven exchange;
4. the experts run on the received rows grouped per local expert (padded locally, never on the wire, to the
   busiest local expert's rows so that every host's ``experts(x_ElNM)`` contract holds; a host whose experts
   take ragged groups, Megatron's, gets the rows without padding through ``LayerParams.row_experts``);
5. the reverse uneven exchange brings the outputs back, and the combine reads each route's row.

At pipeline degree r (PipeMoE), steps 3-5 run per capacity chunk [a, b): the rows of every (expert, block) cell
whose slot lies in [a, b) (:func:`chunk_plan`; a cell's kept slots are 0..n-1), each chunk one uneven exchange
each way, sized from the counts already read (no further host read). A degree word ("auto", "tune") prices the
call by :func:`agreed_load`: the busiest rank's rows, one small max over the layer's groups and a second host
read, paid only where a word picks the degree.

Every row holds the value it holds in the padded buffer, and the combine does the same arithmetic, so outputs,
gradients, aux loss and dropped routes equal the padded exchange's (bitwise, except where a GEMM's blocking
differs with its row count).

The pure pieces (:func:`route_order`'s layout, :func:`split_sizes`, :func:`offsets`, :func:`expert_rows`) are
small functions of host integers or tensors; :func:`ragged_all_to_all` is the autograd exchange, issued through
the layer's communication engine (an urgent op, recorded in its ledger with the true bytes).

Shapes: N token blocks, S tokens per block, K routes per token, E experts (E_l local), P EP sources, R rows
(kept routes) this rank sends, Q rows it receives, M model dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from moe_plugins.core.comm import Recorder
from moe_plugins.core.gating import Routing
from moe_plugins.core.groups import Group, MoEProcessGroups
from moe_plugins.core.schedule import RowLoad

# ---- pure pieces -----------------------------------------------------------------------------------------

def split_sizes(counts: Sequence[int], members: int) -> List[int]:
    """Per-expert counts (E, experts of member j contiguous: [j E_l, (j+1) E_l)) summed per member (pure)."""
    if members < 1 or len(counts) % members:
        raise ValueError(f"counts ({len(counts)} experts) must split evenly over {members} members")
    per = len(counts) // members
    return [sum(counts[j * per:(j + 1) * per]) for j in range(members)]


def offsets(sizes: Sequence[int]) -> List[int]:
    """Exclusive prefix sums: where each piece starts in the concatenation (pure)."""
    out, start = [], 0
    for n in sizes:
        out.append(start)
        start += n
    return out


def expert_rows(recv_PL: Sequence[Sequence[int]], multiple: int = 1) -> Tuple[List[int], List[int], int]:
    """Group a received buffer per local expert (pure).

    ``recv_PL[p][l]``: rows source p sent for local expert l; the buffer holds them source-major (source 0's
    rows for experts 0..E_l-1, then source 1's, ...). Returns ``(gather, back, n)``: the (E_l, n) layout the
    experts run on, each expert's rows source by source and then padding, as ``gather`` (buffer row for every
    (l, j); Q, one past the buffer, for a padding slot); ``back[q]``, the (l, j) position (``l n + j``) of
    buffer row q; and ``n``, the busiest local expert's rows (at least 1, so that no expert call is empty)
    rounded up to ``multiple``."""
    num_local = len(recv_PL[0]) if recv_PL else 0
    per_expert = [sum(src[l] for src in recv_PL) for l in range(num_local)]
    n = max(max(per_expert, default=0), 1)
    n = -(-n // multiple) * multiple
    total = sum(per_expert)
    gather = [total] * (num_local * n)
    back = [0] * total
    filled = [0] * num_local
    row = 0
    for src in recv_PL:
        for l, count in enumerate(src):
            for _ in range(count):
                pos = l * n + filled[l]
                gather[pos], back[row] = row, pos
                filled[l] += 1
                row += 1
    return gather, back, n


def grouped_rows(recv_PL: Sequence[Sequence[int]]) -> Tuple[List[int], List[int]]:
    """:func:`expert_rows`' grouping without its padding slots (pure): ``(order, counts)``, the buffer row of every
    grouped row and each local expert's rows."""
    gather, _, n = expert_rows(recv_PL)
    counts = [sum(src[l] for src in recv_PL) for l in range(len(recv_PL[0]) if recv_PL else 0)]
    return [gather[l * n + j] for l, count in enumerate(counts) for j in range(count)], counts


def experts_on_rows(e_QM: torch.Tensor, recv_PL: Sequence[Sequence[int]], experts: Callable, multiple: int,
                    row_experts: Optional[Callable] = None) -> torch.Tensor:
    """The local experts on received rows (source-major; ``recv_PL[p][l]`` rows from source p for local expert l),
    outputs in the received order: through ``row_experts(x_RM, counts)`` on the kept rows grouped per expert when
    given (Megatron's experts), else through ``experts(x_ElnM)`` on the rows grouped per expert and padded locally
    to the busiest expert's, rounded up to ``multiple`` (:func:`expert_rows`)."""
    model_dim, device = e_QM.shape[-1], e_QM.device
    if row_experts is not None:
        order, counts = grouped_rows(recv_PL)
        idx = torch.tensor(order, dtype=torch.long, device=device)
        return row_experts(e_QM.index_select(0, idx), counts).index_select(0, torch.argsort(idx))
    gather, back, rows = expert_rows(recv_PL, multiple=multiple)
    padded = torch.cat([e_QM, e_QM.new_zeros(1, model_dim)])
    x_ElnM = padded.index_select(0, torch.tensor(gather, dtype=torch.long, device=device))
    y_ElnM = experts(x_ElnM.view(len(recv_PL[0]), rows, model_dim))
    return y_ElnM.reshape(-1, model_dim).index_select(0, torch.tensor(back, dtype=torch.long, device=device))


# ---- the layer's route layout ----------------------------------------------------------------------------

@dataclass(frozen=True)
class RouteOrder:
    """This rank's routes in ragged order (expert, block, slot): ``token_X`` (into the N*S tokens, for the
    first R = sum(counts) entries), ``pos_NSK`` (each route's row; R, a zero row, for a dropped route), the kept
    routes per expert and block ``counts_EN`` and one past the largest kept slot ``top_EN`` (tensors, read once
    on the host with the received counts; equal where the kept slots are 0..n-1, as every gate here makes them)."""

    token_X: torch.Tensor
    pos_NSK: torch.Tensor
    counts_EN: torch.Tensor
    top_EN: torch.Tensor


def route_order(routings: Sequence[Routing], num_experts: int) -> RouteOrder:
    """The ragged order of the kept routes of N blocks' routings (no host read: a full sort, dropped last)."""
    slots = max(r.capacity for r in routings) + 1
    blocks, tokens = len(routings), routings[0].slot_SK.shape[0]
    expert_NSK = torch.stack([r.expert_SK for r in routings])
    slot_NSK = torch.stack([r.slot_SK for r in routings])
    kept_NSK = slot_NSK >= 0
    block_NSK = torch.arange(blocks, device=slot_NSK.device).view(-1, 1, 1).expand_as(slot_NSK)
    key_NSK = (expert_NSK * blocks + block_NSK) * slots + slot_NSK
    key_NSK = torch.where(kept_NSK, key_NSK, torch.full_like(key_NSK, num_experts * blocks * slots))
    order_X = torch.argsort(key_NSK.reshape(-1), stable=True)
    token_NSK = (block_NSK * tokens + torch.arange(tokens, device=slot_NSK.device).view(1, -1, 1)).expand_as(slot_NSK)
    rank_X = torch.empty_like(order_X)
    rank_X[order_X] = torch.arange(order_X.numel(), device=order_X.device)
    cell_X = torch.where(kept_NSK, expert_NSK * blocks + block_NSK, num_experts * blocks).reshape(-1)
    counts_EN = torch.bincount(cell_X, minlength=num_experts * blocks + 1)[:-1].view(num_experts, blocks)
    top_EN = torch.zeros(num_experts * blocks + 1, dtype=torch.long, device=slot_NSK.device).scatter_reduce(
        0, cell_X, (slot_NSK + 1).reshape(-1).long(), reduce="amax")[:-1].view(num_experts, blocks)
    kept = counts_EN.sum()
    pos_NSK = torch.where(kept_NSK, rank_X.view_as(slot_NSK), kept.expand_as(slot_NSK))
    return RouteOrder(token_X=token_NSK.reshape(-1)[order_X], pos_NSK=pos_NSK, counts_EN=counts_EN, top_EN=top_EN)


@dataclass(frozen=True)
class ChunkPlan:
    """One exchange of the layer's rows, whole or a capacity chunk [a, b): ``rows`` (this rank's rows it sends,
    indices into the layer's rows; None: all of them, in order), the split sizes ``send`` and ``recv`` per EP
    member, and the received rows per source and local expert ``recv_PL`` (for :func:`expert_rows`)."""

    rows: Optional[Tuple[int, ...]]
    send: Tuple[int, ...]
    recv: Tuple[int, ...]
    recv_PL: Tuple[Tuple[int, ...], ...]


def clip(n: int, a: int, b: int) -> int:
    """How many of a cell's kept slots 0..n-1 lie in [a, b) (pure)."""
    return max(0, min(n, b) - a)


def slot_rows(cells: Sequence[int], a: int, b: int) -> List[int]:
    """Rows of the kept routes whose slot lies in [a, b), where cell i holds slots 0..n_i-1 at rows
    [start_i, start_i + n_i), cells laid end to end (pure)."""
    rows, start = [], 0
    for n in cells:
        rows.extend(range(start + a, start + a + clip(n, a, b)))
        start += n
    return rows


def chunk_plan(mine_EN: Sequence[Sequence[int]], recv_PLN: Sequence[Sequence[Sequence[int]]], members: int,
               a: int = 0, b: Optional[int] = None,
               recv_bounds: Optional[Sequence[Tuple[int, int]]] = None) -> ChunkPlan:
    """The exchange of the kept routes whose slot lies in [a, b) (b None: all), given this rank's kept routes
    per (expert, block) and those each source p sends for each local expert and block, ``recv_PLN[p][l][i]``
    (pure). A (expert, block) cell with n kept routes holds slots 0..n-1, so [a, b) takes its slots a..min(n, b)-1:
    rows ``[start + a, start + min(n, b))`` of the cell that starts at row ``start``. ``recv_bounds[p]``: the
    slot range source p sends, where sources send different ranges (baseline-tp: each its MP rank's)."""
    if recv_bounds is not None:
        plan = chunk_plan(mine_EN, recv_PLN, members, a, b)
        recv_PL = tuple(tuple(sum(clip(n, pa, pb) for n in cell) for cell in src)
                        for src, (pa, pb) in zip(recv_PLN, recv_bounds))
        return ChunkPlan(rows=plan.rows, send=plan.send, recv=tuple(map(sum, recv_PL)), recv_PL=recv_PL)
    if b is None:
        send_E = [sum(cell) for cell in mine_EN]
        return ChunkPlan(rows=None, send=tuple(split_sizes(send_E, members)),
                         recv=tuple(sum(map(sum, src)) for src in recv_PLN),
                         recv_PL=tuple(tuple(sum(cell) for cell in src) for src in recv_PLN))
    rows = slot_rows([n for cell_N in mine_EN for n in cell_N], a, b)
    send_E = [sum(clip(n, a, b) for n in cell_N) for cell_N in mine_EN]
    recv_PL = tuple(tuple(sum(clip(n, a, b) for n in cell) for cell in src) for src in recv_PLN)
    return ChunkPlan(rows=tuple(rows), send=tuple(split_sizes(send_E, members)),
                     recv=tuple(sum(src) for src in recv_PL), recv_PL=recv_PL)


def combine_rows(r_QM: torch.Tensor, pos_SK: torch.Tensor, routing: Routing) -> torch.Tensor:
    """out_SM = sum_k weight_SK * r[pos_SK]: the padded combine's arithmetic, on the rows (row ``len(r)`` is
    the zero row of a dropped route)."""
    padded = torch.cat([r_QM, r_QM.new_zeros(1, r_QM.shape[-1])])
    routed_SKM = padded.index_select(0, pos_SK.reshape(-1)).view(*pos_SK.shape, r_QM.shape[-1])
    dtype = torch.promote_types(routed_SKM.dtype, routing.weight_SK.dtype)
    out_SM = (routed_SKM.to(dtype) * routing.weight_SK.to(dtype).unsqueeze(-1)).sum(1)
    return out_SM.to(r_QM.dtype)


def pieces_of(d_RM: torch.Tensor, pieces: Sequence) -> List[torch.Tensor]:
    """Each piece's rows of a dispatched buffer, taken at the piece's ``at`` (positions in the buffer)."""
    return [d_RM.index_select(0, piece.at) for piece in pieces]


def joined(outs: Sequence[torch.Tensor], pieces: Sequence) -> torch.Tensor:
    """The pieces' outputs back in the dispatched buffer's row order (the inverse of :func:`pieces_of`)."""
    return torch.cat(list(outs)).index_select(0, torch.argsort(torch.cat([piece.at for piece in pieces])))


# ---- the exchange ----------------------------------------------------------------------------------------

def uneven_all_to_all(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group: Group, rec: Recorder,
                      phase: str = "forward") -> torch.Tensor:
    """One uneven ``all_to_all_single`` along dim 0 (no autograd): ``send[j]`` rows to member j, ``recv[j]`` from
    it: :meth:`Recorder.issue` with the splits, an urgent op of the layer's engine recorded in its ledger with the
    true bytes; a failure is a ``CommError`` naming the layer and schedule. A group of one returns a copy."""
    return rec.issue("all_to_all", group, x, phase, splits=(tuple(send), tuple(recv)))


class _RaggedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group, rec):
        ctx.send, ctx.recv, ctx.group, ctx.rec = send, recv, group, rec
        return uneven_all_to_all(x, send, recv, group, rec, "forward")

    @staticmethod
    def backward(ctx, g):
        return uneven_all_to_all(g.contiguous(), ctx.recv, ctx.send, ctx.group, ctx.rec, "backward"), None, None, None, None


def ragged_all_to_all(x_RM: torch.Tensor, send: Sequence[int], recv: Sequence[int], group: Group,
                      rec: Recorder) -> torch.Tensor:
    """One uneven ``all_to_all_single`` over ``group``: ``send[j]`` rows of ``x_RM`` to member j, ``recv[j]``
    from it (in member order); backward is the reverse exchange. A group of one returns ``x_RM``."""
    if group.size == 1:
        return x_RM
    return _RaggedAllToAll.apply(x_RM, tuple(int(n) for n in send), tuple(int(n) for n in recv), group, rec)


class _GatherRows(torch.autograd.Function):
    """Every member's rows, member by member (an uneven all-gather: one all_to_all_single of this rank's rows
    repeated, ``sizes[j]`` rows from member j). Backward: this rank's block, whose gradient every member holds
    whole (the mirror of :class:`_SplitRows`, as ``comm.all_gather(bwd="split")``)."""

    @staticmethod
    def forward(ctx, x, sizes, group, rec):
        ctx.sizes, ctx.group = sizes, group
        send = (x.shape[0],) * group.size
        return uneven_all_to_all(x.repeat(group.size, 1), send, sizes, group, rec, "forward")

    @staticmethod
    def backward(ctx, g):
        start = sum(ctx.sizes[:ctx.group.rank])
        return g.narrow(0, start, ctx.sizes[ctx.group.rank]), None, None, None


class _SplitRows(torch.autograd.Function):
    """This member's block of rows laid out member by member (``sizes``); backward gathers every member's."""

    @staticmethod
    def forward(ctx, x, sizes, group, rec):
        ctx.sizes, ctx.group, ctx.rec = sizes, group, rec
        return x.narrow(0, sum(sizes[:group.rank]), sizes[group.rank]).clone()

    @staticmethod
    def backward(ctx, g):
        send = (g.shape[0],) * ctx.group.size
        return uneven_all_to_all(g.contiguous().repeat(ctx.group.size, 1), send, ctx.sizes, ctx.group, ctx.rec,
                       "backward"), None, None, None


def gather_rows(x_RM: torch.Tensor, sizes: Sequence[int], group: Group, rec: Recorder) -> torch.Tensor:
    """Uneven all-gather of rows over ``group`` (``sizes[j]``: member j's rows), member by member."""
    return x_RM if group.size == 1 else _GatherRows.apply(x_RM, tuple(int(n) for n in sizes), group, rec)


def split_rows(x_RM: torch.Tensor, sizes: Sequence[int], group: Group, rec: Recorder) -> torch.Tensor:
    """This member's rows of a member-by-member layout; backward: the uneven all-gather of the gradient."""
    return x_RM if group.size == 1 else _SplitRows.apply(x_RM, tuple(int(n) for n in sizes), group, rec)


def exchange_counts(order: RouteOrder, group: Group, rec: Recorder):
    """Steps 1 and 2: this rank's kept routes per expert and block to every EP member (one even all_to_all of
    E N integers) and ONE host read of them, the received ones and ``top_EN``. Returns (this rank's counts
    ``[e][i]``, received counts ``[p][l][i]``: rows source p sends for its block i to local expert l, and
    whether every kept cell holds slots 0..n-1)."""
    counts_EN = order.counts_EN.to(torch.int64)
    num, blocks = counts_EN.shape
    got_EN = counts_EN if group.size == 1 else rec.issue("all_to_all", group, counts_EN, "forward")
    flat = torch.cat([counts_EN.reshape(-1), got_EN.reshape(-1), order.top_EN.reshape(-1)]).tolist()  # the host read
    mine = [flat[e * blocks:(e + 1) * blocks] for e in range(num)]
    got = flat[num * blocks:2 * num * blocks]
    per = num // group.size
    recv_PLN = [[got[(p * per + l) * blocks:(p * per + l + 1) * blocks] for l in range(per)]
                for p in range(group.size)]
    return mine, recv_PLN, flat[2 * num * blocks:] == flat[:num * blocks]


def agreed_load(sent: int, received: int, slots: int, groups: MoEProcessGroups, rec: Recorder) -> RowLoad:
    """The most rows any rank of the layer's EP&ESP and MP groups sends and receives, and the most capacity slots,
    from this rank's (one max over each group of three integers, then one host read): what a degree word
    prices a ragged call by, the same on every rank that runs the call's pieces."""
    t = torch.tensor([int(sent), int(received), int(slots)], dtype=torch.int64)
    for group in (groups.ep_esp, groups.mp):
        if group.size > 1:
            t = rec.issue("all_reduce", group, t, "forward", reduce="max")
    most_sent, most_received, most_slots = t.tolist()                  # the host read
    return RowLoad(sent=most_sent, received=most_received, slots=most_slots)


class PieceQueue:
    """A ragged call's pieces (the whole call, or PipeMoE's capacity chunks), which ``exchange_in``, ``expert``
    and ``exchange_out`` each take in order (a count per step), on the schedule and on its lane twin alike. A
    subclass says how many rows each step of a piece gets (:meth:`rows_in`); a step handed other rows was not run
    through ``Schedule.chunks`` / ``join``, and is refused naming the schedule."""

    schedule = ""                  # named in its errors

    def __init__(self) -> None:
        self.pieces: List = []
        self.taken = {"exchange_in": 0, "expert": 0, "exchange_out": 0}
        self.load: Optional[RowLoad] = None

    def rows_in(self, piece, step: str) -> int:
        raise ValueError(f"{type(self).__name__} does not say how many rows each step of a piece gets (rows_in)")

    def own_load(self) -> Tuple[int, int, int]:
        """This rank's rows sent and received in the whole call's exchange, and the capacity slots it cuts."""
        raise ValueError(f"{type(self).__name__} does not say what its call sends and receives (own_load)")

    def row_load(self, groups: MoEProcessGroups, rec: Recorder) -> RowLoad:
        """:meth:`own_load` agreed over the layer's groups (:func:`agreed_load`), once per call."""
        if self.load is None:
            self.load = agreed_load(*self.own_load(), groups, rec)
        return self.load

    def take(self, step: str, rows: int):
        index = self.taken[step]
        piece = self.pieces[index] if index < len(self.pieces) else None
        if piece is None or rows != self.rows_in(piece, step):
            raise ValueError(f"schedule {self.schedule!r} with the ragged exchange: {step} got {rows} rows, not "
                             f"those of its piece {index} of {len(self.pieces)}; run the layer's pieces through "
                             "Schedule.chunks and Schedule.join")
        self.taken[step] = index + 1
        return piece


class CallBox:
    """The call in flight, shared by a schedule and its lane twin (set by ``prepare`` on the caller's thread)."""

    call: Optional[PieceQueue] = None


class SharesCall:
    """Mixed into a ragged schedule (before its Schedule base) whose per-call state, a :class:`PieceQueue` in a
    :class:`CallBox`, its lane twin shares: the box, the twin, the next piece of a step, and the call's agreed
    load for a degree word."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._box = CallBox()

    def twin(self, groups):
        twin = type(self)(self.config, groups, self.rec)
        twin._box = self._box
        return twin

    def _take(self, step: str, rows: int):
        if self._box.call is None:
            raise ValueError(f"schedule {self.name!r} with the ragged exchange: {step} before prepare")
        return self._box.call.take(step, rows)

    def row_load(self, dispatched) -> RowLoad:
        return dispatched.state.row_load(self.groups, self.rec)
