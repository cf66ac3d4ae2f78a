"""SparseAllGather (spAG) and SparseReduceScatter (spRS) (hecate.txt §3.1), each ONE uneven all-to-all.

Every expert's flat parameters (F elements) are cut into contiguous shards, one per rank of the FSSDP group,
in rank order (:class:`ShardSpec`: evenly over all ranks, :func:`even_shards`, or the whole expert on one
owner, :func:`whole_shards`, the paper's and stock expert parallelism's layout). A rank's owned buffer
``w_owned_O`` holds its shard of expert 0, then of expert 1, ... (O = its shards' elements).

- **spAG** builds, on every rank r, full copies of the experts a :class:`~moe_plugins.hecate.plan.Placement`
  gives it: ``w_copies_CF`` (C = its experts, in expert order; F = an expert's elements). Each other rank s
  sends r its shard of each of those experts: one ``all_to_all_single`` with split sizes. A rank's own shard
  never travels (it is read locally), so the bytes recorded are the bytes on the wire.
- **spRS** is its adjoint: the copies' gradients go back along the same pieces (the reverse uneven
  all-to-all) and every owner sums, per shard, its own copy's gradient and the ones received.

:func:`sparse_all_gather` is an autograd function, ``W_copies = spAG(W_owned)``, whose backward is spRS; so an
owner's parameter (a host's own, with its gradient hooks) gets one gradient, the sum over all copies. Both go
through the layer's communication engine as urgent ops, recorded in its ledger as ops ``spag`` and ``sprs``
(bytes: the elements this rank sends; inter-node bytes: those sent to members on other nodes).

Volumes: :func:`sparse_bytes` gives each rank's bytes exactly (what the ledger records); :func:`eq2_bytes` is the
paper's Eq. 2, the AllReduce volume a rearranging system pays for the same copies. Where each expert is owned
whole by one of its copies (the paper's setting), spAG + spRS move 2 (c_e - 1) B_e bytes in all for an expert
with c_e copies of B_e bytes: c_e times its Eq. 2 term, the ring AllReduce of its c_e copies summed over them.

A rank must let its copies reach the loss (an empty (0, F) output too), or its peers wait in spRS for it.

Re-materialisation (:func:`spag_again`) runs the same spAG again in backward, recorded as ``spag`` in phase
``backward``: with it a layer's ``spag`` bytes per step double (the price of freeing the copies), ``sprs``'s do
not change.

Letters: E experts, R ranks of the group, F elements per expert, C experts copied on this rank, O elements
this rank owns, X elements it sends, Q elements it receives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import Group
from moe_plugins.core.ops import CommError, Handle
from moe_plugins.hecate.plan import Placement

SPAG, SPRS = "spag", "sprs"        # their ledger op names
Piece = Tuple[int, int, int]      # (buffer: 0 received / 1 owned, start, length)


# ---- shards ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardSpec:
    """``sizes_ER[e][r]``: the elements of expert e that rank r owns; expert e's F elements are its shards
    concatenated in rank order."""

    numel: int
    sizes_ER: Tuple[Tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not (isinstance(self.numel, int) and self.numel >= 1):
            raise ValueError(f"numel ({self.numel!r}) must be an integer >= 1 (elements per expert)")
        ranks = {len(row) for row in self.sizes_ER}
        if len(ranks) > 1 or not self.sizes_ER:
            raise ValueError(f"sizes_ER must hold one row per expert, each of the same number of ranks; got row "
                             f"lengths {sorted(ranks)}")
        for e, row in enumerate(self.sizes_ER):
            if any(n < 0 for n in row) or sum(row) != self.numel:
                raise ValueError(f"sizes_ER[{e}] ({list(row)}) must be sizes >= 0 summing to numel ({self.numel})")

    @property
    def num_experts(self) -> int:
        return len(self.sizes_ER)

    @property
    def num_ranks(self) -> int:
        return len(self.sizes_ER[0])

    def owned(self, rank: int) -> int:
        """O: the elements ``rank`` owns (the length of its ``w_owned_O``)."""
        return sum(row[rank] for row in self.sizes_ER)

    def own_start(self, expert: int, rank: int) -> int:
        """Where ``rank``'s shard of ``expert`` starts in its owned buffer."""
        return sum(row[rank] for row in self.sizes_ER[:expert])

    def expert_start(self, expert: int, rank: int) -> int:
        """Where ``rank``'s shard starts in ``expert``'s F elements."""
        return sum(self.sizes_ER[expert][:rank])

    def shard(self, flat_EF: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s owned buffer cut from all experts' full parameters ``flat_EF`` (E, F) (tests, loading)."""
        return torch.cat([flat_EF[e, self.expert_start(e, rank):self.expert_start(e, rank) + row[rank]]
                          for e, row in enumerate(self.sizes_ER)])


def even_shards(numel: int, num_experts: int, num_ranks: int) -> ShardSpec:
    """Every expert over all ranks: F // R elements each, the first F % R ranks one more."""
    if not (isinstance(num_experts, int) and num_experts >= 1 and isinstance(num_ranks, int) and num_ranks >= 1):
        raise ValueError(f"num_experts ({num_experts!r}) and num_ranks ({num_ranks!r}) must be integers >= 1")
    base, rest = divmod(numel, num_ranks)
    row = tuple(base + (1 if r < rest else 0) for r in range(num_ranks))
    return ShardSpec(numel=numel, sizes_ER=(row,) * num_experts)


def whole_shards(numel: int, homes_E: Sequence[int], num_ranks: int) -> ShardSpec:
    """Expert e whole on rank ``homes_E[e]`` (expert parallelism's owners), nothing elsewhere."""
    if not all(isinstance(h, int) and 0 <= h < num_ranks for h in homes_E):
        raise ValueError(f"homes_E ({list(homes_E)}) must be ranks in [0, {num_ranks})")
    return ShardSpec(numel=numel, sizes_ER=tuple(tuple(numel if r == h else 0 for r in range(num_ranks))
                                                 for h in homes_E))


# ---- the exchange of one rank (pure) -----------------------------------------------------------------------

@dataclass(frozen=True)
class SparseExchange:
    """One rank's spAG: the ``experts`` it copies (rows of its output), elements sent to / received from each
    member (``send``, ``recv``; 0 to itself), the owned pieces it sends in send order ``send_pieces`` ((start,
    length)) and, in output order, where each piece of its copies comes from (``copy_pieces``)."""

    experts: Tuple[int, ...]
    numel: int
    send: Tuple[int, ...]
    recv: Tuple[int, ...]
    send_pieces: Tuple[Tuple[int, int], ...]
    copy_pieces: Tuple[Piece, ...]


def sparse_exchange(placement: Placement, shards: ShardSpec, rank: int) -> SparseExchange:
    """``rank``'s part of the spAG that materialises ``placement`` from ``shards`` (pure; every rank's parts
    agree: what s sends r is what r expects from s, in the same order)."""
    problems = []
    if placement.num_ranks != shards.num_ranks:
        problems.append(f"placement has {placement.num_ranks} ranks, shards {shards.num_ranks}")
    if len(placement.copies_E) != shards.num_experts:
        problems.append(f"placement has {len(placement.copies_E)} experts, shards {shards.num_experts}")
    if not 0 <= rank < shards.num_ranks:
        problems.append(f"rank ({rank}) must lie in [0, {shards.num_ranks})")
    if problems:
        raise ValueError("sparse exchange: " + "; ".join(problems))
    ranks = shards.num_ranks
    send, send_pieces = [], []
    for dst in range(ranks):
        pieces = [] if dst == rank else [(shards.own_start(e, rank), shards.sizes_ER[e][rank])
                                         for e in placement.experts_on(dst) if shards.sizes_ER[e][rank]]
        send.append(sum(n for _, n in pieces))
        send_pieces += pieces
    mine = placement.experts_on(rank)
    recv_start: Dict[Tuple[int, int], int] = {}
    recv, at = [], 0
    for src in range(ranks):
        first = at
        for e in mine:
            if src != rank and shards.sizes_ER[e][src]:
                recv_start[(src, e)] = at
                at += shards.sizes_ER[e][src]
        recv.append(at - first)
    copy_pieces: List[Piece] = []
    for e in mine:
        for src in range(ranks):
            n = shards.sizes_ER[e][src]
            if n:
                copy_pieces.append((1, shards.own_start(e, rank), n) if src == rank else (0, recv_start[(src, e)], n))
    return SparseExchange(experts=mine, numel=shards.numel, send=tuple(send), recv=tuple(recv),
                          send_pieces=tuple(send_pieces), copy_pieces=tuple(copy_pieces))


# ---- volumes (pure) ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SparseBytes:
    """One rank's bytes in spAG: ``sent`` (spRS receives as many), ``received`` (spRS sends as many), and
    ``sent_inter_node`` / ``received_inter_node``: those to / from members on other nodes."""

    sent: int
    received: int
    sent_inter_node: int
    received_inter_node: int


def sparse_bytes(placement: Placement, shards: ShardSpec, rank: int, elsize: int) -> SparseBytes:
    """``rank``'s spAG bytes (the ledger's ``spag`` record; its ``sprs`` record sends ``received``): every shard
    of an expert copied on another rank, and every shard of its copies owned by another rank."""
    sparse_exchange(placement, shards, rank)                 # the same checks of placement, shards and rank
    nodes, sent, received, sent_x, received_x = placement.nodes_R, 0, 0, 0, 0
    for e, copies in enumerate(placement.copies_E):
        for dst in copies:
            if dst != rank:
                sent += shards.sizes_ER[e][rank]
                sent_x += shards.sizes_ER[e][rank] if nodes[dst] != nodes[rank] else 0
        if rank in copies:
            for src, n in enumerate(shards.sizes_ER[e]):
                if src != rank:
                    received += n
                    received_x += n if nodes[src] != nodes[rank] else 0
    return SparseBytes(sent * elsize, received * elsize, sent_x * elsize, received_x * elsize)


def eq2_bytes(copies_E: Sequence[int], expert_bytes: int) -> float:
    """The paper's Eq. 2: sum over the experts with more than one copy of 2 (|D_i| - 1) / |D_i| * S / |C|,
    the bytes each member of a ring AllReduce sends to reduce an expert's gradient over its |D_i| copies
    (S / |C| = ``expert_bytes``)."""
    if any(c < 1 for c in copies_E) or expert_bytes < 0:
        raise ValueError(f"copies_E ({list(copies_E)}) must be counts >= 1 and expert_bytes ({expert_bytes}) >= 0")
    return sum(2 * (c - 1) / c * expert_bytes for c in copies_E if c > 1)


# ---- the collectives ---------------------------------------------------------------------------------------

def issue_exchange(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group: Group, rec: Recorder,
                   name: str, phase: str) -> Handle:
    """Issue spAG's (or spRS's: ``name``) uneven all-to-all of ``x`` through ``rec``'s engine, recorded as
    ``name``; on a lane's thread ``group`` must be the lane's twin."""
    return rec.engine.issue("all_to_all", group, x, layer=rec.layer, phase=phase, ledger=rec.ledger,
                            splits=(tuple(send), tuple(recv)), record_as=name)


def send_buffer(w_owned_O: torch.Tensor, ex: SparseExchange) -> torch.Tensor:
    """This rank's spAG send buffer: its owned pieces in send order (X,)."""
    return _take([w_owned_O], [(0, s, n) for s, n in ex.send_pieces], w_owned_O)


def _exchange(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group: Group, rec: Recorder, name: str,
              phase: str) -> torch.Tensor:
    handle = issue_exchange(x, send, recv, group, rec, name, phase)
    try:
        return handle.wait()
    except CommError as exc:      # a peer gone: name the schedule too
        raise rec.failed(exc) from exc


def _take(buffers: Sequence[torch.Tensor], pieces: Sequence[Piece], like: torch.Tensor) -> torch.Tensor:
    if not pieces:
        return like.new_empty(0)
    return torch.cat([buffers[b].narrow(0, start, n) for b, start, n in pieces])


def _put(sizes: Sequence[int], pieces: Sequence[Piece], g_X: torch.Tensor) -> List[torch.Tensor]:
    """The adjoint of :func:`_take`: zero buffers of ``sizes`` with ``g_X``'s pieces added where they came from."""
    out = [g_X.new_zeros(n) for n in sizes]
    at = 0
    for b, start, n in pieces:
        out[b].narrow(0, start, n).add_(g_X.narrow(0, at, n))
        at += n
    return out


def spag_raw(w_owned_O: torch.Tensor, ex: SparseExchange, group: Group, rec: Recorder,
             phase: str = "forward", received: Optional[torch.Tensor] = None) -> torch.Tensor:
    """spAG without autograd: ``w_copies_CF`` from this rank's owned buffer (``received``: the exchange's result,
    when it ran earlier: Hecate's early gather, moe_plugins/hecate/early.py)."""
    recv_Q = received
    if recv_Q is None:
        send_X = send_buffer(w_owned_O, ex)
        recv_Q = _exchange(send_X, ex.send, ex.recv, group, rec, SPAG, phase) if group.size > 1 else send_X
    return _take([recv_Q, w_owned_O], ex.copy_pieces, w_owned_O).view(len(ex.experts), ex.numel)


def sprs_raw(g_copies_CF: torch.Tensor, ex: SparseExchange, owned: int, group: Group, rec: Recorder,
             phase: str = "backward") -> torch.Tensor:
    """spRS without autograd: this rank's owned buffer of gradients (O,), the sum over all copies of each shard."""
    g_recv_Q, g_own_O = _put((sum(ex.recv), owned), ex.copy_pieces, g_copies_CF.reshape(-1))
    if group.size > 1:
        g_back_X = _exchange(g_recv_Q, ex.recv, ex.send, group, rec, SPRS, phase)
        (back_O,) = _put((owned,), [(0, s, n) for s, n in ex.send_pieces], g_back_X)
        g_own_O = g_own_O + back_O
    return g_own_O


def spag_again(w_owned_O: torch.Tensor, placement: Placement, shards: ShardSpec, group: Group,
               rec: Recorder) -> torch.Tensor:
    """The same spAG once more, without autograd, recorded as ``spag`` in phase ``backward``: re-materialisation's
    re-gather of this rank's copies (C, F) right before the layer's backward (moe_plugins/hecate/remat.py)."""
    with torch.no_grad():
        return spag_raw(w_owned_O, sparse_exchange(placement, shards, group.rank), group, rec, "backward")


class _SparseAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w_owned_O, ex, group, rec, received):
        ctx.ex, ctx.group, ctx.rec, ctx.owned = ex, group, rec, w_owned_O.numel()
        return spag_raw(w_owned_O, ex, group, rec, "forward", received)

    @staticmethod
    def backward(ctx, g_copies_CF):
        g_owned_O = sprs_raw(g_copies_CF.contiguous(), ctx.ex, ctx.owned, ctx.group, ctx.rec, "backward")
        return g_owned_O, None, None, None, None


def sparse_all_gather(w_owned_O: torch.Tensor, placement: Placement, shards: ShardSpec, group: Group,
                      rec: Recorder, received: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``w_copies_CF = spAG(w_owned_O)``: full copies (C, F) of the experts ``placement`` gives this rank (in
    expert order, :meth:`Placement.experts_on`), from every rank's owned shards; backward is spRS into
    ``w_owned_O``'s gradient. Collective over ``group``: every member calls it with the same placement, unless
    the exchange ran earlier (``received``: its result, from the same values of ``w_owned_O``; then nothing is
    sent here)."""
    problems = []
    if placement.num_ranks != group.size:
        problems.append(f"placement has {placement.num_ranks} ranks, the {group.kind} group {group.size}")
    if w_owned_O.dim() != 1 or w_owned_O.numel() != shards.owned(group.rank):
        problems.append(f"w_owned_O (shape {tuple(w_owned_O.shape)}) must be 1-d with this rank's "
                        f"{shards.owned(group.rank)} owned elements")
    if problems:
        raise ValueError("sparse_all_gather: " + "; ".join(problems))
    ex = sparse_exchange(placement, shards, group.rank)
    if received is not None and received.shape != (sum(ex.recv),):
        raise ValueError(f"sparse_all_gather: received (shape {tuple(received.shape)}) must hold the "
                         f"{sum(ex.recv)} elements this placement sends this rank")
    return _SparseAllGather.apply(w_owned_O, ex, group, rec, received)
