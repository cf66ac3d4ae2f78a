"""The baseline schedule: DeepSpeed-MoE's data flow for MP+EP+ESP (parm.txt Fig. 3a, §IV-A).

    ESP-AllGather(tokens) -> gate -> EP-AlltoAll -> experts -> ESP-AllReduce -> EP-AlltoAll -> combine -> ESP-Split

Per-op volumes (forward, and the same again in backward): AG_ESP(BLM*N_ESP), A2A_EP(ETM*N_ESP) twice,
AR_ESP(ETM*N_ESP). In backward the ESP-Split becomes the all-gather and the all-reduce moves in front of
the expert shard (its input gradient is a partial sum over H).

Tokens of an MP group are replicas (one logical copy). This schedule processes every replica, which is
the redundancy Parm removes; the expert weights' gradients are scaled by 1/N_MP so that they equal the
gradient of the once-counted loss.

Shapes: N = N_ESP token blocks, S tokens per block, C capacity, E_l = E / N_EP local experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import List, Optional, Tuple, Type

import torch

from moe_plugins.core import comm
from moe_plugins.core.dispatch import combine, dispatch
from moe_plugins.core.gating import Routing
from moe_plugins.core.ragged import (ChunkPlan, PieceQueue, SharesCall, chunk_plan, combine_rows, exchange_counts,
                                     experts_on_rows, ragged_all_to_all, route_order)
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, Schedule, chunk_bounds, routing_stats


@dataclass(frozen=True)
class _State:
    routings: List[Routing]
    num_tokens: int


class BaselineSchedule(Schedule):
    name = "baseline"

    def exchange(self, d: torch.Tensor) -> Exchange:
        return Exchange("ep", 1.0, 1.0)              # the EP all-to-all keeps the rows

    @classmethod
    def exchange_variant(cls, exchange: str) -> Optional[Type[Schedule]]:
        return {"padded": BaselineSchedule, "ragged": RaggedBaselineSchedule}.get(exchange)

    def gate_blocks(self, x_SM: torch.Tensor, params: LayerParams) -> Tuple[torch.Tensor, List[Routing]]:
        """The ESP group's token blocks x_NSM (all-gathered) and their routings (ESP > 1)."""
        esp = self.groups.esp
        x_NSM = comm.all_gather(x_SM.unsqueeze(0), esp, self.rec, dim=0, bwd="split")
        routings = []
        for i in range(esp.size):
            if i == esp.rank:
                routings.append(params.router(x_NSM[i]))
            else:  # another member's block: gated again here, only its routing decisions are used
                with torch.no_grad():
                    routings.append(params.router(x_NSM[i]))
        return x_NSM, routings

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        cfg, esp = self.config, self.groups.esp
        if esp.size == 1:        # views only: a stack / select of one block costs a copy and a zero-filled grad
            routing = params.router(x_SM)
            return Dispatched(d=dispatch(x_SM, routing, cfg.num_experts).unsqueeze(1), cap_dim=2,
                              state=_State([routing], x_SM.shape[0]), aux_loss=routing.aux_loss,
                              exp_counts_E=routing.exp_counts_E, dropped=routing.dropped)
        x_NSM, routings = self.gate_blocks(x_SM, params)
        slots = max(r.capacity for r in routings)
        d_ENCM = torch.stack([dispatch(x_NSM[i], r, cfg.num_experts, slots) for i, r in enumerate(routings)], 1)
        counts, dropped = routing_stats(routings[esp.rank:esp.rank + 1])
        return Dispatched(d=d_ENCM, cap_dim=2, state=_State(routings, x_SM.shape[0]),
                          aux_loss=routings[esp.rank].aux_loss, exp_counts_E=counts, dropped=dropped)

    def exchange_in(self, d_ENcM: torch.Tensor) -> torch.Tensor:
        return comm.all_to_all(d_ENcM, self.groups.ep, self.rec)          # rows now: source-major, E_l local

    def expert(self, e_ENcM: torch.Tensor, params: LayerParams) -> torch.Tensor:
        return self.run_experts(e_ENcM, params, replicas=self.groups.mp.size)

    def exchange_out(self, o_ENcM: torch.Tensor) -> torch.Tensor:
        return comm.all_to_all(o_ENcM, self.groups.ep, self.rec)

    def finish(self, r_ENCM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        st: _State = dispatched.state
        if len(st.routings) == 1:                                  # ESP 1: no stack, no split (see prepare)
            return combine(r_ENCM.squeeze(1), st.routings[0])
        y_NSM = torch.stack([combine(r_ENCM[:, i], rt) for i, rt in enumerate(st.routings)])
        return comm.split(y_NSM, self.groups.esp, self.rec, dim=0).squeeze(0)


def _replicated(experts, replicas: int, x_ElnM: torch.Tensor) -> torch.Tensor:
    """``experts`` on rows that arrive ``replicas`` times: input gradients exact, weight gradients divided."""
    return comm.grad_scale(experts(comm.grad_scale(x_ElnM, float(replicas))), 1.0 / replicas)


class _RaggedCall(PieceQueue):
    """One call of the ragged baseline, shared with the schedule's twin (PipeMoE's lane runs the exchanges): the
    blocks' routings, each route's row, the counts read on the host, and the exchange plans (the whole layer,
    or one per capacity chunk), which exchange_in, expert and exchange_out each take in order."""

    schedule = "baseline"          # named in its errors

    def __init__(self, routings: List[Routing], pos_NSK: torch.Tensor, slots: int, counts: Tuple, members: int):
        super().__init__()
        self.routings, self.pos_NSK, self.slots, self.members = routings, pos_NSK, slots, members
        self.mine_EN, self.recv_PLN, self.contiguous = counts
        self.pieces = [chunk_plan(self.mine_EN, self.recv_PLN, members)]

    def local_slots(self) -> int:
        """The capacity slots this rank's chunks cut (the gate's capacity)."""
        return self.slots

    def own_load(self) -> Tuple[int, int, int]:
        sent, received = sum(map(sum, self.mine_EN)), sum(sum(map(sum, src)) for src in self.recv_PLN)
        return sent, received, self.local_slots()

    def cut(self, degree: int) -> List[ChunkPlan]:
        if degree > 1 and not self.contiguous:
            raise ValueError("the ragged exchange cuts capacity chunks from each expert's kept slots 0..n-1; this "
                             "gate left gaps in them: use pipeline_degree 1 or the padded exchange")
        bounds = chunk_bounds(self.slots, degree) if degree > 1 else [(0, None)]
        self.pieces = [chunk_plan(self.mine_EN, self.recv_PLN, self.members, a, b) for a, b in bounds]
        return self.pieces

    def rows_in(self, piece: ChunkPlan, step: str) -> int:
        return sum(piece.send if step == "exchange_in" else piece.recv)


class RaggedBaselineSchedule(SharesCall, BaselineSchedule):
    """The baseline with the ragged exchange (``"exchange": "ragged"``): the same gate, drops and expert math;
    only the kept routes travel, in one uneven all-to-all each way per piece (core/ragged.py). One host read
    per call (the split sizes). Pipeline degree r > 1 cuts capacity chunks [a, b) of every expert's kept slots."""

    exchange_mode = "ragged"

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        cfg, esp, ep = self.config, self.groups.esp, self.groups.ep
        if esp.size == 1:
            x_NSM, routings = x_SM.unsqueeze(0), [params.router(x_SM)]
            counts, dropped = routings[0].exp_counts_E, routings[0].dropped
        else:
            x_NSM, routings = self.gate_blocks(x_SM, params)
            counts, dropped = routing_stats(routings[esp.rank:esp.rank + 1])
        order = route_order(routings, cfg.num_experts)
        counted = exchange_counts(order, ep, self.rec)                # the one host read
        call = self._box.call = _RaggedCall(routings, order.pos_NSK, max(r.capacity for r in routings), counted,
                                            ep.size)
        kept = sum(map(sum, call.mine_EN))
        d_RM = x_NSM.reshape(-1, x_SM.shape[-1]).index_select(0, order.token_X[:kept])
        return Dispatched(d=d_RM, cap_dim=0, state=call, aux_loss=routings[esp.rank].aux_loss,
                          exp_counts_E=counts, dropped=dropped)

    def chunks(self, dispatched: Dispatched, degree: int) -> List[torch.Tensor]:
        d_RM, plans = dispatched.d, dispatched.state.cut(degree)
        if len(plans) == 1:
            return [d_RM]
        return [d_RM.index_select(0, torch.tensor(p.rows, dtype=torch.long, device=d_RM.device)) for p in plans]

    def join(self, outs: List[torch.Tensor], dispatched: Dispatched) -> torch.Tensor:
        plans = dispatched.state.pieces
        if len(outs) == 1:
            return outs[0]
        rows = torch.tensor([r for p in plans for r in p.rows], dtype=torch.long, device=outs[0].device)
        return torch.cat(outs).index_select(0, torch.argsort(rows))      # back to the layer's row order

    def exchange_in(self, d_RM: torch.Tensor) -> torch.Tensor:
        plan = self._take("exchange_in", d_RM.shape[0])
        return ragged_all_to_all(d_RM, plan.send, plan.recv, self.groups.ep, self.rec)

    def expert(self, e_QM: torch.Tensor, params: LayerParams) -> torch.Tensor:
        plan, replicas = self._take("expert", e_QM.shape[0]), self.groups.mp.size
        if replicas == 1:       # Megatron's experts (row_experts) get the kept rows only
            return experts_on_rows(e_QM, plan.recv_PL, params.experts, self.groups.ep.size, params.row_experts)
        # MP replicas: every row arrives N_MP times, so the weight gradients are divided by it (run_experts);
        # DeepSpeed splits rows by EP, hence the multiple
        return experts_on_rows(e_QM, plan.recv_PL, partial(_replicated, params.experts, replicas), self.groups.ep.size)

    def exchange_out(self, o_QM: torch.Tensor) -> torch.Tensor:
        plan = self._take("exchange_out", o_QM.shape[0])
        return ragged_all_to_all(o_QM, plan.recv, plan.send, self.groups.ep, self.rec)

    def finish(self, r_RM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        call: _RaggedCall = dispatched.state
        if self._box.call is call:
            self._box.call = None       # the exchanges are done: hold nothing of this call past the layer
        if len(call.routings) == 1:
            return combine_rows(r_RM, call.pos_NSK[0], call.routings[0])
        y_NSM = torch.stack([combine_rows(r_RM, call.pos_NSK[i], rt) for i, rt in enumerate(call.routings)])
        return comm.split(y_NSM, self.groups.esp, self.rec, dim=0).squeeze(0)
