"""DeepSpeed 0.19's data flow for tensor parallelism (``drop_tokens`` / ``gather_tokens`` in sharded_moe).

    gate -> MP-Split(capacity) -> EP-AlltoAll -> [ESP-AllGather(capacity)] -> experts -> [ESP-AllReduce ->
    ESP-Split(capacity)] -> EP-AlltoAll -> MP-AllGather(capacity) -> combine

The bracketed steps run when experts are sharded (ESP > 1), in which case the ESP groups must be the MP
groups (DeepSpeed's expert tensor parallelism uses the TP group). Each MP rank sends a distinct 1/N_MP of
the capacity, so no replica is processed twice. Capacity buffers are padded to a multiple of N_MP with
empty slots; which routes are dropped is decided by the unpadded capacity, so the math is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, List, Optional, Tuple, Type

import torch

from moe_plugins.core import comm
from moe_plugins.core.dispatch import combine, dispatch
from moe_plugins.core.gating import Routing
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.ragged import (ChunkPlan, PieceQueue, SharesCall, chunk_plan, combine_rows, exchange_counts,
                                     experts_on_rows, gather_rows, joined, pieces_of, ragged_all_to_all,
                                     route_order, slot_rows, split_rows)
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, Schedule, chunk_bounds


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class BaselineTPSchedule(Schedule):
    name = "baseline-tp"

    def exchange(self, d: torch.Tensor) -> Exchange:
        return Exchange("ep", 1.0, self.groups.esp.size)   # then an ESP all-gather of the capacity

    @classmethod
    def exchange_variant(cls, exchange: str) -> Optional[Type[Schedule]]:
        return {"padded": BaselineTPSchedule, "ragged": RaggedBaselineTPSchedule}.get(exchange)

    @classmethod
    def layout_problems(cls, layout: ParallelLayout) -> List[str]:
        if layout.esp not in (1, layout.mp):
            return [f"schedule 'baseline-tp' needs esp ({layout.esp}) equal to 1 or to mp ({layout.mp}): "
                    "DeepSpeed shards experts over the tensor-parallel group"]
        return []

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        cfg, mp = self.config, self.groups.mp
        routing = params.router(x_SM)
        d_ECM = dispatch(x_SM, routing, cfg.num_experts, slots=_round_up(routing.capacity, mp.size))
        d_EcM = comm.split(d_ECM, mp, self.rec, dim=1)
        return Dispatched(d=d_EcM, cap_dim=1, state=routing, aux_loss=routing.aux_loss,
                          exp_counts_E=routing.exp_counts_E, dropped=routing.dropped)

    def exchange_in(self, d_EcM: torch.Tensor) -> torch.Tensor:
        e_EcM = comm.all_to_all(d_EcM, self.groups.ep, self.rec)
        return comm.all_gather(e_EcM, self.groups.esp, self.rec, dim=1, bwd="split")

    def expert(self, e_EcM: torch.Tensor, params: LayerParams) -> torch.Tensor:
        return self.run_experts(e_EcM, params)

    def exchange_out(self, o_EcM: torch.Tensor) -> torch.Tensor:
        o_EcM = comm.split(o_EcM, self.groups.esp, self.rec, dim=1)
        return comm.all_to_all(o_EcM, self.groups.ep, self.rec)

    def routing_of(self, dispatched: Dispatched) -> Routing:
        """The gate's routing of a call this schedule prepared."""
        return dispatched.state

    def finish(self, r_EcM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        routing = self.routing_of(dispatched)
        r_ECM = comm.all_gather(r_EcM, self.groups.mp, self.rec, dim=1, bwd="split")
        return combine(r_ECM, routing)


@dataclass(frozen=True)
class _TPPiece:
    """One piece of a ragged baseline-tp call (the whole slice, or one PipeMoE chunk of it): this MP rank's EP
    exchange plan, the received rows per (ESP member, source) and local expert, member-major, and the ESP
    members' row counts; ``at``: its rows' positions in the dispatched slice (None: all of them, in order)."""

    plan: ChunkPlan
    esp_recv_PL: Tuple[Tuple[int, ...], ...]
    esp_sizes: Tuple[int, ...]
    at: Optional[torch.Tensor] = None


def _tp_piece(counts: Tuple, members: int, slot_bounds, sources: List[int], mp_rank: int, esp_size: int,
              a: int, b: int) -> _TPPiece:
    """The piece of slots [a, b) of every MP rank's slice (``slot_bounds[m]``: slice m's first slot; pure):
    each EP peer sends its own MP rank's slice (``sources``: their MP coordinates), and with ESP = MP member j
    receives slice j from every peer."""
    mine_EN, recv_PLN = counts

    def cut(m: int) -> Tuple[int, int]:
        return slot_bounds[m] + a, slot_bounds[m] + b

    plan = chunk_plan(mine_EN, recv_PLN, members, *cut(mp_rank), [cut(m) for m in sources])
    esp_recv = ([chunk_plan(mine_EN, recv_PLN, members, *cut(j), [cut(j)] * members).recv_PL
                 for j in range(esp_size)] if esp_size > 1 else [plan.recv_PL])
    return _TPPiece(plan=plan, esp_recv_PL=tuple(src for member in esp_recv for src in member),
                    esp_sizes=tuple(sum(map(sum, member)) for member in esp_recv))


class SlicedCall(PieceQueue):
    """One ragged call whose capacity is split over MP (baseline-tp's, and Parm's S2 in parm/ragged.py), shared
    with the schedule's lane twin: the routing, each route's row, every MP rank's slice rows (the MP split and
    gather), ``cut(a, b)``: the piece of slots [a, b) of every slice of ``width`` slots, and the pieces, which
    exchange_in, expert and exchange_out each take in order."""

    def __init__(self, routing: Routing, pos_SK: torch.Tensor, slices: List[List[int]],
                 cut: Callable[[int, int], object], width: int, device: torch.device):
        super().__init__()
        self.routing, self.pos_SK, self.cut, self.width = routing, pos_SK, cut, width
        self.mp_order = torch.tensor([r for rows in slices for r in rows], dtype=torch.long, device=device)
        self.mp_sizes = tuple(map(len, slices))
        self.whole = cut(0, width)
        self.pieces = [self.whole]

    def combine(self, r_RM: torch.Tensor) -> torch.Tensor:
        """The layer's output from every MP rank's slice rows, MP rank by MP rank."""
        return combine_rows(r_RM.index_select(0, torch.argsort(self.mp_order)), self.pos_SK, self.routing)


class SlicedChunks:
    """``chunks`` / ``join`` of a ragged schedule whose call state (``dispatched.state``) is a :class:`SlicedCall`:
    chunk j is the j-th piece of every MP rank's slice; the outputs go back in the slice's row order."""

    def chunks(self, dispatched: Dispatched, degree: int) -> List[torch.Tensor]:
        return [dispatched.d] if degree == 1 else pieces_of(dispatched.d, dispatched.state.chunked(degree))

    def join(self, outs: List[torch.Tensor], dispatched: Dispatched) -> torch.Tensor:
        return outs[0] if len(outs) == 1 else joined(outs, dispatched.state.pieces)


class _TPCall(SlicedCall):
    """One call of the ragged baseline-tp (:class:`SlicedCall`); its pieces are :class:`_TPPiece`s."""

    schedule = "baseline-tp"

    def __init__(self, routing: Routing, pos_SK: torch.Tensor, slices: List[List[int]],
                 cut: Callable[[int, int], _TPPiece], width: int, mp_rank: int, device: torch.device):
        super().__init__(routing, pos_SK, slices, cut, width, device)
        self.slice_rows = slices[mp_rank]               # this MP rank's slice: the dispatched rows, in order

    def chunked(self, degree: int) -> List[_TPPiece]:
        """The call cut into ``degree`` capacity chunks of every slice (:func:`chunk_bounds` of the slice width),
        each piece's rows located in the dispatched slice."""
        at = {row: i for i, row in enumerate(self.slice_rows)}
        device = self.mp_order.device
        self.pieces = [replace(piece, at=torch.tensor([at[r] for r in piece.plan.rows], dtype=torch.long,
                                                      device=device))
                       for piece in (self.cut(a, b) for a, b in chunk_bounds(self.width, degree))]
        return self.pieces

    def own_load(self) -> Tuple[int, int, int]:
        """The whole slice's rows sent over EP and gathered over ESP for the experts, and the slice's width."""
        return sum(self.whole.plan.send), sum(self.whole.esp_sizes), self.width

    def rows_in(self, piece: _TPPiece, step: str) -> int:
        return sum(piece.plan.send if step == "exchange_in" else piece.esp_sizes)


class RaggedBaselineTPSchedule(SharesCall, SlicedChunks, BaselineTPSchedule):
    """baseline-tp with the ragged exchange: MP rank m sends the kept routes of its capacity slice
    [m c, (m+1) c) (c = C / N_MP, C rounded up to N_MP), in one uneven EP all-to-all each way per piece; the ESP
    all-gather and split of the capacity and the final MP all-gather are uneven too (core/ragged.py). One host
    read per call (the split sizes). Pipeline degree r > 1 cuts every slice into r capacity chunks (the same
    [a, b) of each slice), one exchange each way per chunk."""

    exchange_mode = "ragged"

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        cfg, groups = self.config, self.groups
        mp, ep, esp = groups.mp, groups.ep, groups.esp
        routing = params.router(x_SM)
        order = route_order([routing], cfg.num_experts)
        mine_EN, recv_PLN, contiguous = exchange_counts(order, ep, self.rec)     # the one host read
        if not contiguous:
            raise ValueError("schedule 'baseline-tp' with the ragged exchange cuts each MP rank's capacity slice "
                             "from every expert's kept slots 0..n-1; this gate left gaps: use the padded exchange")
        width = -(-routing.capacity // mp.size)
        firsts = [m * width for m in range(mp.size)]
        # an EP peer sends its own MP rank's slice; the MP ranks hold the same tokens, hence the same counts
        sources = [groups.layout.coords(r)["mp"] for r in ep.ranks]
        cells = [n for cell_N in mine_EN for n in cell_N]
        slices = [slot_rows(cells, first, first + width) for first in firsts]     # each MP rank's slice rows
        cut = partial(_tp_piece, (mine_EN, recv_PLN), ep.size, firsts, sources, mp.rank, esp.size)
        call = self._box.call = _TPCall(routing, order.pos_NSK[0], slices, cut, width, mp.rank, x_SM.device)
        kept = sum(map(sum, mine_EN))
        rows_RM = x_SM.index_select(0, order.token_X[:kept]).index_select(0, call.mp_order)
        d_rM = split_rows(rows_RM, call.mp_sizes, mp, self.rec)               # this MP rank's capacity slice
        return Dispatched(d=d_rM, cap_dim=0, state=call, aux_loss=routing.aux_loss,
                          exp_counts_E=routing.exp_counts_E, dropped=routing.dropped)

    def routing_of(self, dispatched: Dispatched) -> Routing:
        return dispatched.state.routing

    def exchange_in(self, d_rM: torch.Tensor) -> torch.Tensor:
        piece = self._take("exchange_in", d_rM.shape[0])
        e_QM = ragged_all_to_all(d_rM, piece.plan.send, piece.plan.recv, self.groups.ep, self.rec)
        return gather_rows(e_QM, piece.esp_sizes, self.groups.esp, self.rec)

    def expert(self, e_QM: torch.Tensor, params: LayerParams) -> torch.Tensor:
        piece = self._take("expert", e_QM.shape[0])
        return experts_on_rows(e_QM, piece.esp_recv_PL, params.experts, self.groups.ep.size)

    def exchange_out(self, o_QM: torch.Tensor) -> torch.Tensor:
        piece = self._take("exchange_out", o_QM.shape[0])
        o_QM = split_rows(o_QM, piece.esp_sizes, self.groups.esp, self.rec)
        return ragged_all_to_all(o_QM, piece.plan.recv, piece.plan.send, self.groups.ep, self.rec)

    def finish(self, r_rM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        call: _TPCall = dispatched.state
        self._box.call = None
        return call.combine(gather_rows(r_rM, call.mp_sizes, self.groups.mp, self.rec))   # MP rank by MP rank
