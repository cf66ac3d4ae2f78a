"""DeepSpeed 0.19's data flow for tensor parallelism (``drop_tokens`` / ``gather_tokens`` in sharded_moe).

    gate -> MP-Split(capacity) -> EP-AlltoAll -> [ESP-AllGather(capacity)] -> experts -> [ESP-AllReduce ->
    ESP-Split(capacity)] -> EP-AlltoAll -> MP-AllGather(capacity) -> combine

The bracketed steps run when experts are sharded (ESP > 1), in which case the ESP groups must be the MP
groups (DeepSpeed's expert tensor parallelism uses the TP group). Each MP rank sends a distinct 1/N_MP of
the capacity, so no replica is processed twice. Capacity buffers are padded to a multiple of N_MP with
empty slots; which routes are dropped is decided by the unpadded capacity, so the math is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Type

import torch

from moe_plugins.core import comm
from moe_plugins.core.dispatch import combine, dispatch
from moe_plugins.core.gating import Routing
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.ragged import (ChunkPlan, chunk_plan, combine_rows, exchange_counts, experts_on_rows,
                                     gather_rows, ragged_all_to_all, route_order, split_rows)
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, Schedule


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
class _TPCall:
    """One call of the ragged baseline-tp: the routing, each route's row, this MP rank's exchange plan (its
    capacity slice), every MP rank's slice rows (the MP split and gather) and the ESP members' received rows."""

    routing: Routing
    pos_SK: torch.Tensor
    plan: ChunkPlan
    mp_order: torch.Tensor        # the layer's rows, MP rank by MP rank (each its capacity slice)
    mp_sizes: Tuple[int, ...]
    esp_recv_PL: Tuple[Tuple[int, ...], ...]   # rows per (ESP member, source) and local expert, member-major
    esp_sizes: Tuple[int, ...]


class RaggedBaselineTPSchedule(BaselineTPSchedule):
    """baseline-tp with the ragged exchange: MP rank m sends the kept routes of its capacity slice
    [m c, (m+1) c) (c = C / N_MP, C rounded up to N_MP), in one uneven EP all-to-all each way; the ESP
    all-gather and split of the capacity and the final MP all-gather are uneven too (core/ragged.py). One host
    read per call (the split sizes). Pipeline degree 1 only."""

    exchange_mode = "ragged"
    ragged_chunks = False
    _call: Optional[_TPCall] = None      # per call: what exchange_in, expert and exchange_out read

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
        bounds = [(m * width, (m + 1) * width) for m in range(mp.size)]
        # an EP peer sends its own MP rank's slice; the MP ranks hold the same tokens, hence the same counts
        sources = [bounds[groups.layout.coords(r)["mp"]] for r in ep.ranks]
        slices = [chunk_plan(mine_EN, recv_PLN, ep.size, a, b, sources) for a, b in bounds]
        # esp = mp: the ESP members are this MP group's ranks, and member j's EP peers all send slice j
        esp_recv = ([chunk_plan(mine_EN, recv_PLN, ep.size, *bounds[j], [bounds[j]] * ep.size).recv_PL
                     for j in range(esp.size)] if esp.size > 1 else [slices[mp.rank].recv_PL])
        call = _TPCall(routing=routing, pos_SK=order.pos_NSK[0], plan=slices[mp.rank],
                       mp_order=torch.tensor([r for p in slices for r in p.rows], dtype=torch.long,
                                             device=x_SM.device),
                       mp_sizes=tuple(len(p.rows) for p in slices),
                       esp_recv_PL=tuple(src for member in esp_recv for src in member),
                       esp_sizes=tuple(sum(map(sum, member)) for member in esp_recv))
        self._call = call
        kept = sum(map(sum, mine_EN))
        rows_RM = x_SM.index_select(0, order.token_X[:kept]).index_select(0, call.mp_order)
        d_rM = split_rows(rows_RM, call.mp_sizes, mp, self.rec)               # this MP rank's capacity slice
        return Dispatched(d=d_rM, cap_dim=0, state=call, aux_loss=routing.aux_loss,
                          exp_counts_E=routing.exp_counts_E, dropped=routing.dropped)

    def routing_of(self, dispatched: Dispatched) -> Routing:
        return dispatched.state.routing

    def chunks(self, dispatched: Dispatched, degree: int) -> List[torch.Tensor]:
        if degree != 1:
            raise ValueError(f"schedule 'baseline-tp' with the ragged exchange runs pipeline_degree 1, not {degree}")
        return [dispatched.d]

    def exchange_in(self, d_rM: torch.Tensor) -> torch.Tensor:
        plan = self._call.plan
        e_QM = ragged_all_to_all(d_rM, plan.send, plan.recv, self.groups.ep, self.rec)
        return gather_rows(e_QM, self._call.esp_sizes, self.groups.esp, self.rec)

    def expert(self, e_QM: torch.Tensor, params: LayerParams) -> torch.Tensor:
        return experts_on_rows(e_QM, self._call.esp_recv_PL, params.experts, self.groups.ep.size)

    def exchange_out(self, o_QM: torch.Tensor) -> torch.Tensor:
        plan = self._call.plan
        o_QM = split_rows(o_QM, self._call.esp_sizes, self.groups.esp, self.rec)
        return ragged_all_to_all(o_QM, plan.recv, plan.send, self.groups.ep, self.rec)

    def finish(self, r_rM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        call: _TPCall = dispatched.state
        self._call = None
        r_RM = gather_rows(r_rM, call.mp_sizes, self.groups.mp, self.rec)         # MP rank by MP rank
        r_RM = r_RM.index_select(0, torch.argsort(call.mp_order))                 # the layer's row order
        return combine_rows(r_RM, call.pos_SK, call.routing)
