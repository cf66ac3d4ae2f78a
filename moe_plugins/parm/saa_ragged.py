"""SAA on rows: parm-s2-saa with the ragged exchange (:mod:`moe_plugins.parm.saa` on padded blocks, here on the
kept routes of :mod:`moe_plugins.parm.ragged`'s S2).

The combine side: the uneven EP&ESP all-to-all back is posted as point-to-point sends and receives of row
blocks; as soon as the N_ESP members of one EP block b have returned their partials, they are summed (Parm's
local combine on rows) and the block's rows are all-gathered over MP, asynchronously and unevenly (one
``all_to_all_single`` of the block repeated: MP rank p holds n_pb rows of block b), while other blocks are still
in flight. Blocks go in :func:`moe_plugins.parm.saa.block_order`, the same on every MP rank. The result is every
MP rank's slice rows, MP rank by MP rank, each slice block by block (its (expert, slot) order).

    saa(o)          = AG_MP,uneven( sum_ESP( A2A_EP&ESP,uneven(o) ) )        combine side, forward
    saa_adjoint(g)  = A2A_EP&ESP,uneven( dump_ESP( own MP slice of g ) )     its backward; the dispatch side

Shapes: Q rows this rank received (source-major), D its dumped slice rows, R every MP rank's slice rows, M model
dim; ``blocks_PB[p][b]``: MP rank p's rows of EP block b.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.comm import Recorder
from moe_plugins.core.engine import now_ns
from moe_plugins.core.groups import Group
from moe_plugins.core.ragged import offsets, uneven_all_to_all
from moe_plugins.core.schedule import Dispatched, LayerParams
from moe_plugins.parm.ragged import RaggedParmS2Schedule, _S2Piece, dump_rows
from moe_plugins.parm.saa import block_order


@dataclass(frozen=True)
class RowSAA:
    """One call's sizes (host ints): the fused exchange's rows per member (``send``: this rank's dumped slice
    rows to member g, ``recv``: rows member g sent), each MP rank's rows per EP block, this rank's dump, the
    groups and the block order."""

    send: Tuple[int, ...]
    recv: Tuple[int, ...]
    blocks_PB: Tuple[Tuple[int, ...], ...]
    dump: Tuple[int, ...]
    ep_esp: Group
    mp: Group
    esp: int
    order: Tuple[int, ...]


def _saa_rows(o_QM: torch.Tensor, s: RowSAA, rec: Recorder, phase: str) -> torch.Tensor:
    """The combine side without autograd: o (Q, M) -> every MP rank's slice rows (R, M), overlapped."""
    start_ns, o = now_ns(), o_QM.contiguous()
    model_dim, ep_esp, mp = o.shape[-1], s.ep_esp, s.mp
    got = o.new_empty(sum(s.send), model_dim)
    back, into = offsets(s.recv), offsets(s.send)
    recvs, sends = {}, []
    for g in range(ep_esp.size):
        if g == ep_esp.rank:
            got[into[g]:into[g] + s.send[g]].copy_(o[back[g]:back[g] + s.recv[g]])
            continue
        if s.send[g]:
            recvs[g] = dist.irecv(got[into[g]:into[g] + s.send[g]], src=ep_esp.ranks[g], group=ep_esp.pg)
        if s.recv[g]:
            sends.append(dist.isend(o[back[g]:back[g] + s.recv[g]], dst=ep_esp.ranks[g], group=ep_esp.pg))
    mine, sizes_B = s.blocks_PB[mp.rank], [list(col) for col in zip(*s.blocks_PB)]
    gathered = {}
    for b in s.order:
        members = range(b * s.esp, (b + 1) * s.esp)
        for g in members:
            if g in recvs:
                recvs.pop(g).wait()
        rows_bM = sum(got[into[g]:into[g] + mine[b]] for g in members)               # the local combine
        if mp.size == 1:
            gathered[b] = (rows_bM, None)
            continue
        buf = o.new_empty(sum(sizes_B[b]), model_dim)
        work = dist.all_to_all_single(buf, rows_bM.repeat(mp.size, 1), sizes_B[b], [mine[b]] * mp.size,
                                      group=mp.pg, async_op=True)
        gathered[b] = (buf, work)
    for work in sends:
        work.wait()
    for buf, work in gathered.values():
        if work is not None:
            work.wait()
    pieces = [gathered[b][0].narrow(0, sum(sizes_B[b][:p]), sizes_B[b][p]) if mp.size > 1 else gathered[b][0]
              for p in range(mp.size) for b in range(len(mine))]
    out = torch.cat(pieces) if pieces else o.new_empty(0, model_dim)
    rec.record("all_to_all", ep_esp, sum(s.recv) * model_dim, o.element_size(),
               ep_esp.remote_share(s.recv) * model_dim, phase, start_ns=start_ns)
    if mp.size > 1:
        rows = [sum(mine)] * mp.size
        rec.record("all_gather", mp, sum(rows) * model_dim, o.element_size(), mp.remote_share(rows) * model_dim,
                   phase, start_ns=start_ns)
    return out


def saa_rows(o_QM: torch.Tensor, s: RowSAA, rec: Recorder, phase: str) -> torch.Tensor:
    """:func:`_saa_rows` as one urgent composite of the layer's engine (background work held meanwhile); a failed
    send, receive or gather is a CommError naming the layer, the schedule and SAA."""
    with rec.engine.hold():
        try:
            return _saa_rows(o_QM, s, rec, phase)
        except RuntimeError as exc:                  # gloo/NCCL: the group's timeout, or a connection lost
            raise rec.failed(f"SAA on rows (all_to_all@{s.ep_esp.kind} + all_gather@{s.mp.kind}, {phase}) "
                             f"failed: {exc}") from exc


def saa_rows_adjoint(g_RM: torch.Tensor, s: RowSAA, rec: Recorder, phase: str) -> torch.Tensor:
    """The adjoint without autograd: this MP rank's slice of every MP rank's rows, dumped, in one uneven
    EP&ESP all-to-all."""
    sizes = [sum(row) for row in s.blocks_PB]
    own = g_RM.narrow(0, sum(sizes[:s.mp.rank]), sizes[s.mp.rank])
    return uneven_all_to_all(dump_rows(own, s.dump).contiguous(), s.send, s.recv, s.ep_esp, rec, phase)


class _Adjoints(torch.autograd.Function):
    """``fwd`` forward, its adjoint ``bwd`` backward (SAA on rows and the dispatch side are each other's)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, s, rec):
        ctx.bwd, ctx.s, ctx.rec = bwd, s, rec
        return fwd(x, s, rec, "forward")

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g, ctx.s, ctx.rec, "backward"), None, None, None, None


def saa_gather_rows(o_QM: torch.Tensor, s: RowSAA, rec: Recorder) -> torch.Tensor:
    """Combine side of the ragged S2: the rows back, summed over ESP and gathered over MP, overlapped."""
    return _Adjoints.apply(o_QM, saa_rows, saa_rows_adjoint, s, rec)


def saa_scatter_rows(rows_RM: torch.Tensor, s: RowSAA, rec: Recorder) -> torch.Tensor:
    """Dispatch side: every MP rank's rows -> the rows this rank's experts get; backward the overlapped SAA."""
    return _Adjoints.apply(rows_RM, saa_rows_adjoint, saa_rows, s, rec)


class RaggedParmS2SAASchedule(RaggedParmS2Schedule):
    """parm-s2-saa with the ragged exchange: ragged S2 whose EP&ESP all-to-all back and MP gather overlap block by
    block (:func:`saa_gather_rows`), and whose dispatch side is their adjoint (backward overlapped too); per piece
    at pipeline degree r > 1 (every MP rank's piece rows go in, come back)."""

    name = "parm-s2-saa"
    saa = True

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        call, rows_RM = self._route(x_SM, params)
        return self._dispatched(rows_RM, call)

    def _sizes(self, piece: _S2Piece) -> RowSAA:
        groups = self.groups
        return RowSAA(send=piece.plan.send, recv=piece.plan.recv, blocks_PB=piece.blocks_PB, dump=piece.dump,
                      ep_esp=groups.ep_esp, mp=groups.mp, esp=groups.esp.size,
                      order=tuple(block_order(groups.layout, groups.mp, groups.esp.size)))

    def exchange_in(self, rows_RM: torch.Tensor) -> torch.Tensor:
        return saa_scatter_rows(rows_RM, self._sizes(self._take("exchange_in", rows_RM.shape[0])), self.rec)

    def exchange_out(self, o_QM: torch.Tensor) -> torch.Tensor:
        return saa_gather_rows(o_QM, self._sizes(self._take("exchange_out", o_QM.shape[0])), self.rec)

    def finish(self, r_RM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return self._done(dispatched).combine(r_RM)
