"""Parm's S1 and S2 with the ragged exchange (``"exchange": "ragged"``, core/ragged.py): only kept routes travel.

The padded S1 / S2 dump each EP block's slots to its N_ESP expert shards and move the whole buffer in one
EP&ESP all-to-all (Fig. 4c), then sum the shards' partials (Fig. 4d). Here the same steps move rows:

    parm-s1  MP-Split(tokens) -> gate -> this block's kept routes, in (expert, slot) order -> dump rows
             -> uneven EP&ESP-A2A -> expert partials -> uneven EP&ESP-A2A -> local combine (index_add over
             the dump) -> combine rows -> MP-AllGather(tokens)
    parm-s2  gate -> kept routes of this MP rank's capacity slice [p w, (p+1) w) (split with an uneven
             MP all-gather in backward) -> dump rows -> uneven EP&ESP-A2A -> expert partials -> uneven
             EP&ESP-A2A -> local combine -> uneven MP-AllGather(rows) -> combine rows

The counts go first (one even all-to-all of E_l integers per fused-group member, the dumped counts) and are
read on the host once per call, as in the ragged baseline. Every row holds the value its padded slot holds and
the combine does the same arithmetic, so outputs, gradients, aux loss and dropped routes equal the padded
schedules' (to the GEMM blocking of other row counts, and the order of the ESP partials' sum at N_ESP > 2).

S1 runs PipeMoE's capacity chunks (pieces [a, b) of every expert's kept slots 0..n-1, the bound agreed over the
fused group at the first cut); S2 cuts the same chunks [a, b) of every MP rank's slice (as the ragged
baseline-tp), and so do the ragged parm-s2-saa (saa_ragged.py), parm-auto and parm-tune (ragged_auto.py). Each
answers ``row_load`` (PipeMoE's degree words).

Shapes: E experts (E_l per EP block), G = N_EP * N_ESP fused-group members (member g serves EP block
g // N_ESP), R kept routes of this rank (or of its MP slice), D = the dumped rows, Q received rows, M model dim.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from moe_plugins.core import comm
from moe_plugins.core.baseline import RaggedBaselineSchedule, _RaggedCall
from moe_plugins.core.baseline_tp import SlicedCall, SlicedChunks
from moe_plugins.core.gating import Routing
from moe_plugins.core.ragged import (ChunkPlan, SharesCall, chunk_plan, clip, combine_rows, exchange_counts,
                                     experts_on_rows, gather_rows, offsets, ragged_all_to_all, route_order, slot_rows,
                                     split_rows, split_sizes)
from moe_plugins.core.schedule import Dispatched, LayerParams, RowLoad, chunk_bounds
from moe_plugins.parm.steps import _ParmSchedule, _round_up, expert_partials

# ---- pure pieces -----------------------------------------------------------------------------------------


def dumped_experts(num_experts: int, members: int, esp: int) -> List[int]:
    """The expert of each (member, local expert) cell of the dumped layout: member g = b N_ESP + j gets EP block
    b's experts [b E_l, (b+1) E_l), as the padded dump (pure)."""
    if members % esp or num_experts % (members // esp):
        raise ValueError(f"{num_experts} experts over {members} members at esp {esp} do not split evenly")
    per = num_experts // (members // esp)
    return [(g // esp) * per + l for g in range(members) for l in range(per)]


def dump_index(block_rows: Sequence[int], esp: int) -> List[int]:
    """The dumped buffer's rows as rows of the undumped one (pure): EP block b's rows [start_b, start_b + n_b),
    once for each of its N_ESP members, block by block."""
    starts = offsets(block_rows)
    return [starts[b] + i for b, n in enumerate(block_rows) for _ in range(esp) for i in range(n)]


def undumped(cells_GL: Sequence[Sequence[int]], num_experts: int, members: int, esp: int) -> List[int]:
    """Per-expert kept routes from the dumped cells (one token block each; every member of an EP block holds
    the same counts): each expert's first cell (pure)."""
    kept_E: List[Optional[int]] = [None] * num_experts
    for cell, expert in zip(cells_GL, dumped_experts(num_experts, members, esp)):
        if kept_E[expert] is None:
            kept_E[expert] = int(cell[0])
    return [int(n) for n in kept_E]


# ---- shared steps ----------------------------------------------------------------------------------------


def _index(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=like.device)


def dump_rows(x_RM: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
    """The dumped rows (backward: each row's gradient summed over its N_ESP copies)."""
    return x_RM.index_select(0, _index(index, x_RM))


def local_combine(r_DM: torch.Tensor, index: Sequence[int], rows: int) -> torch.Tensor:
    """Fig. 4d on rows: each row's N_ESP partials summed (backward: the gradient dumped again)."""
    return r_DM.new_zeros(rows, r_DM.shape[-1]).index_add(0, _index(index, r_DM), r_DM)


def dumped_counts(order, num_experts: int, groups, rec) -> Tuple:
    """The counts exchange on the fused group: this rank's kept routes per dumped cell to every member, read
    on the host once (:func:`moe_plugins.core.ragged.exchange_counts`)."""
    cells = _index(dumped_experts(num_experts, groups.ep_esp.size, groups.esp.size), order.counts_EN)
    dumped = replace(order, counts_EN=order.counts_EN.index_select(0, cells),
                     top_EN=order.top_EN.index_select(0, cells))
    return exchange_counts(dumped, groups.ep_esp, rec)


class _RowSteps(_ParmSchedule):
    """The steps S1 and S2 share on rows: the two uneven EP&ESP all-to-alls and the experts' partials, each on
    the exchange plan the schedule's :meth:`_plan` gives for that step."""

    @abstractmethod
    def _plan(self, step: str, rows: int) -> ChunkPlan:
        """The plan of this call's piece that ``step`` (exchange_in, expert, exchange_out) runs on ``rows``."""

    def exchange_in(self, d_DM: torch.Tensor) -> torch.Tensor:
        plan = self._plan("exchange_in", d_DM.shape[0])
        return ragged_all_to_all(d_DM, plan.send, plan.recv, self.groups.ep_esp, self.rec)

    def expert(self, e_QM: torch.Tensor, params: LayerParams) -> torch.Tensor:
        plan, esp = self._plan("expert", e_QM.shape[0]), self.groups.esp
        return experts_on_rows(e_QM, plan.recv_PL, expert_partials(params, esp), self.groups.ep_esp.size,
                               params.row_experts if esp.size == 1 else None)   # Megatron's: the kept rows only

    def exchange_out(self, o_QM: torch.Tensor) -> torch.Tensor:
        plan = self._plan("exchange_out", o_QM.shape[0])
        return ragged_all_to_all(o_QM, plan.recv, plan.send, self.groups.ep_esp, self.rec)


# ---- S1 --------------------------------------------------------------------------------------------------


class _S1Call(_RaggedCall):
    """One ragged S1 call: the dumped cells' exchange plans (whole, or per capacity chunk; the chunks' slot bound
    is agreed over the fused group at the first cut), the dump, and this block's routing."""

    schedule = "parm-s1"

    def __init__(self, local: Routing, pos_sK: torch.Tensor, counts: Tuple, dump: List[int], rows: int,
                 num_tokens: int, block_slots: torch.Tensor, groups, rec):
        super().__init__([local], pos_sK.unsqueeze(0), 0, counts, groups.ep_esp.size)
        self.dump, self.rows, self.num_tokens, self._groups, self._rec = dump, rows, num_tokens, groups, rec
        self.block_slots = block_slots      # the padded S1's C_l before the max over EP&ESP (0-dim; parm-auto's)

    def local_slots(self) -> int:
        return self.slots or max((n for cell in self.mine_EN for n in cell), default=0)

    def row_load(self, groups, rec) -> RowLoad:
        load = super().row_load(groups, rec)
        self.slots = self.slots or max(1, load.slots)        # the chunks' bound, agreed over EP&ESP and MP
        return load

    def cut(self, degree: int) -> List[ChunkPlan]:
        if degree > 1 and not self.slots:
            self.slots = max(1, comm.all_reduce_max(self.local_slots(), self._groups.ep_esp, self._rec))
        return super().cut(degree)


class RaggedParmS1Schedule(SharesCall, _RowSteps):
    """parm-s1 with the ragged exchange: this MP rank's token block's kept routes, dumped to the N_ESP shards of
    their EP block, in one uneven EP&ESP all-to-all each way per piece."""

    name = "parm-s1"
    exchange_mode = "ragged"
    chunks = RaggedBaselineSchedule.chunks        # the pieces are plans of the call in dispatched.state
    join = RaggedBaselineSchedule.join

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        num_experts, groups = self.config.num_experts, self.groups
        x_sM, block, local = self._block_routing(x_SM, params)
        order = route_order([local], num_experts)
        counts = dumped_counts(order, num_experts, groups, self.rec)              # the one host read
        kept_E = undumped(counts[0], num_experts, groups.ep_esp.size, groups.esp.size)
        per_block = split_sizes(kept_E, groups.ep_esp.size // groups.esp.size)
        dump = dump_index(per_block, groups.esp.size)
        rows = sum(per_block)
        call = self._box.call = _S1Call(local, order.pos_NSK[0], counts, dump, rows, x_SM.shape[0],
                                        block.kept_PE.max(), groups, self.rec)
        d_DM = dump_rows(x_sM.index_select(0, order.token_X[:rows]), dump)
        return Dispatched(d=d_DM, cap_dim=0, state=call, aux_loss=local.aux_loss, exp_counts_E=local.exp_counts_E,
                          dropped=block.dropped)

    def _plan(self, step: str, rows: int) -> ChunkPlan:
        return self._take(step, rows)

    def finish(self, r_DM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        call: _S1Call = dispatched.state
        if self._box.call is call:
            self._box.call = None
        y_sM = combine_rows(local_combine(r_DM, call.dump, call.rows), call.pos_NSK[0], call.routings[0])
        return comm.all_gather(y_sM, self.groups.mp, self.rec, dim=0, bwd="split")[:call.num_tokens]


# ---- S2 --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _S2Piece:
    """One piece of a ragged S2 call (the whole slice, or one PipeMoE chunk [a, b) of every MP rank's slice): this
    rank's exchange plan, every MP rank's rows per EP block (SAA's gathers), the dump of this rank's rows, and
    ``at``: the piece's rows in the dispatched buffer (None: all of them, in order)."""

    plan: ChunkPlan
    blocks_PB: Tuple[Tuple[int, ...], ...]
    dump: Tuple[int, ...]
    at: Optional[torch.Tensor] = None


def s2_piece(counts: Tuple, kept_E: Sequence[int], members: int, esp: int, firsts: Sequence[int],
             sources: Sequence[int], mp_rank: int, a: int, b: int) -> _S2Piece:
    """Slots [a, b) of every MP rank's slice (slice m starts at slot ``firsts[m]``; ``sources``: the MP
    coordinate of each fused-group member, whose own slice it sends) (pure)."""
    mine, recv_PLN = counts

    def cut(m: int) -> Tuple[int, int]:
        return firsts[m] + a, firsts[m] + b

    plan = chunk_plan(mine, recv_PLN, members, *cut(mp_rank), [cut(m) for m in sources])
    blocks_PB = tuple(tuple(split_sizes([clip(n, *cut(m)) for n in kept_E], members // esp))
                      for m in range(len(firsts)))
    return _S2Piece(plan=plan, blocks_PB=blocks_PB, dump=tuple(dump_index(blocks_PB[mp_rank], esp)))


def piece_rows(cells: Sequence[int], firsts: Sequence[int], width: int, a: int, b: int) -> List[int]:
    """Where slots [a, b) of each slice lie in a buffer of the slices laid end to end, slice m holding slots
    [firsts[m], firsts[m] + width) of every cell (each cell's kept slots 0..n-1) (pure)."""
    rows, start = [], 0
    for first in firsts:
        within = [clip(n, first, first + width) for n in cells]
        rows.extend(start + r for r in slot_rows(within, a, b))
        start += sum(within)
    return rows


class _S2Call(SlicedCall):
    """One ragged S2 call (:class:`moe_plugins.core.baseline_tp.SlicedCall`; its pieces :class:`_S2Piece`s).
    ``cells``/``firsts``: the dispatched buffer's cells and its slices' first slots (S2: this rank's dumped slice;
    SAA: every MP rank's slice, undumped)."""

    schedule = "parm-s2"

    def __init__(self, routing: Routing, pos_SK: torch.Tensor, slices: List[List[int]],
                 cut: Callable[[int, int], _S2Piece], width: int, saa: bool, cells: List[int], firsts: List[int],
                 device: torch.device):
        super().__init__(routing, pos_SK, slices, cut, width, device)
        self.saa, self.cells, self.firsts = saa, cells, firsts

    def chunked(self, degree: int) -> List[_S2Piece]:
        """The call cut into ``degree`` capacity chunks of every slice, each located in the dispatched buffer."""
        device = self.mp_order.device
        self.pieces = [replace(self.cut(a, b), at=torch.tensor(piece_rows(self.cells, self.firsts, self.width, a, b),
                                                              dtype=torch.long, device=device))
                       for a, b in chunk_bounds(self.width, degree)]
        return self.pieces

    def own_load(self) -> Tuple[int, int, int]:
        return sum(self.whole.plan.send), sum(self.whole.plan.recv), self.width

    def rows_in(self, piece: _S2Piece, step: str) -> int:
        if step != "exchange_in":
            return sum(piece.plan.recv)
        return sum(map(sum, piece.blocks_PB)) if self.saa else sum(piece.plan.send)


class RaggedParmS2Schedule(SharesCall, SlicedChunks, _RowSteps):
    """parm-s2 with the ragged exchange: MP rank p sends the kept routes of its capacity slice [p w, (p+1) w)
    (w = C / N_MP, C rounded up to N_MP), dumped to their EP block's N_ESP shards, in one uneven EP&ESP
    all-to-all each way per piece; the MP split and gather are uneven too. Pipeline degree r > 1 cuts every
    slice into r capacity chunks (the same [a, b) of each slice)."""

    name = "parm-s2"
    exchange_mode = "ragged"

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        call, rows_RM = self._route(x_SM, params)
        d_rM = split_rows(rows_RM, call.mp_sizes, self.groups.mp, self.rec)              # this MP rank's slice
        return self._dispatched(dump_rows(d_rM, call.whole.dump), call)

    @staticmethod
    def _dispatched(d: torch.Tensor, call: _S2Call) -> Dispatched:
        return Dispatched(d=d, cap_dim=0, state=call, aux_loss=call.routing.aux_loss,
                          exp_counts_E=call.routing.exp_counts_E, dropped=call.routing.dropped)

    def _route(self, x_SM: torch.Tensor, params: LayerParams) -> Tuple[_S2Call, torch.Tensor]:
        """The call (gate, counts, plans; the one host read) and every MP rank's slice rows, MP rank by MP rank."""
        num_experts, groups = self.config.num_experts, self.groups
        routing = params.router(x_SM)
        order = route_order([routing], num_experts)
        mine, recv_PLN, contiguous = dumped_counts(order, num_experts, groups, self.rec)   # the one host read
        if not contiguous:
            raise ValueError(f"schedule {self.name!r} with the ragged exchange cuts each MP rank's capacity slice from "
                             "every expert's kept slots 0..n-1; this gate left gaps: use the padded exchange")
        p, width = groups.mp.size, _round_up(routing.capacity, groups.mp.size) // groups.mp.size
        firsts = [m * width for m in range(p)]
        sources = [groups.layout.coords(r)["mp"] for r in groups.ep_esp.ranks]
        kept_E = undumped(mine, num_experts, groups.ep_esp.size, groups.esp.size)
        slices = [slot_rows(kept_E, first, first + width) for first in firsts]
        cut = partial(s2_piece, (mine, recv_PLN), kept_E, groups.ep_esp.size, groups.esp.size, firsts, sources,
                      groups.mp.rank)
        # the dispatched buffer: SAA's every MP rank's slice, undumped; S2's this rank's slice, dumped
        cells, starts = (kept_E, firsts) if self.saa else ([cell[0] for cell in mine], [firsts[groups.mp.rank]])
        call = self._box.call = _S2Call(routing, order.pos_NSK[0], slices, cut, width, self.saa, cells, starts,
                                        x_SM.device)
        return call, x_SM.index_select(0, order.token_X[:sum(kept_E)]).index_select(0, call.mp_order)

    def _plan(self, step: str, rows: int) -> ChunkPlan:
        return self._take(step, rows).plan

    def _done(self, dispatched: Dispatched) -> _S2Call:
        call: _S2Call = dispatched.state
        if self._box.call is call:
            self._box.call = None
        return call

    def finish(self, r_DM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        call = self._done(dispatched)
        r_rM = local_combine(r_DM, call.whole.dump, sum(call.whole.blocks_PB[self.groups.mp.rank]))
        return call.combine(gather_rows(r_rM, call.mp_sizes, self.groups.mp, self.rec))   # MP rank by MP rank
