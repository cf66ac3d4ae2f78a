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
from typing import List, Optional, Tuple, Type

import torch

from moe_plugins.core import comm
from moe_plugins.core.dispatch import combine, dispatch
from moe_plugins.core.gating import Routing
from moe_plugins.core.ragged import combine_rows, exchange_counts, expert_rows, ragged_all_to_all, route_order, \
    split_sizes
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, Schedule, routing_stats


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


@dataclass(frozen=True)
class _RaggedCall:
    """One call of the ragged baseline: the blocks' routings, each route's row, the split sizes (rows to and
    from each EP member) and the per-local-expert grouping of the received rows (core/ragged.py)."""

    routings: List[Routing]
    pos_NSK: torch.Tensor
    send: Tuple[int, ...]
    recv: Tuple[int, ...]
    gather: torch.Tensor     # (E_l * n,) received row of every expert slot (Q: a padding row)
    back: torch.Tensor       # (Q,) expert slot of every received row
    rows: int                # n: rows per local expert in the expert step (local padding only)


class RaggedBaselineSchedule(BaselineSchedule):
    """The baseline with the ragged exchange (``"exchange": "ragged"``): the same gate, drops and expert math;
    only the kept routes travel, in one uneven all-to-all each way (core/ragged.py). One host read per call
    (the split sizes). Runs whole layers (pipeline degree 1)."""

    exchange_mode = "ragged"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._call: Optional[_RaggedCall] = None     # per call: what exchange_in, expert and exchange_out read

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        cfg, esp, ep = self.config, self.groups.esp, self.groups.ep
        if esp.size == 1:
            x_NSM, routings = x_SM.unsqueeze(0), [params.router(x_SM)]
            counts, dropped = routings[0].exp_counts_E, routings[0].dropped
        else:
            x_NSM, routings = self.gate_blocks(x_SM, params)
            counts, dropped = routing_stats(routings[esp.rank:esp.rank + 1])
        order = route_order(routings, cfg.num_experts)
        mine_E, recv_PL = exchange_counts(order.counts_E, ep, self.rec)       # the one host read
        gather, back, rows = expert_rows(recv_PL, multiple=ep.size)    # DeepSpeed's experts split rows over EP
        device = x_SM.device
        self._call = _RaggedCall(routings=routings, pos_NSK=order.pos_NSK, send=tuple(split_sizes(mine_E, ep.size)),
                                 recv=tuple(sum(src) for src in recv_PL),
                                 gather=torch.tensor(gather, dtype=torch.long, device=device),
                                 back=torch.tensor(back, dtype=torch.long, device=device), rows=rows)
        d_RM = x_NSM.reshape(-1, x_SM.shape[-1]).index_select(0, order.token_X[:sum(mine_E)])
        return Dispatched(d=d_RM, cap_dim=0, state=self._call, aux_loss=routings[esp.rank].aux_loss,
                          exp_counts_E=counts, dropped=dropped)

    def _current(self, rows: int, what: str) -> _RaggedCall:
        call = self._call
        if call is None or rows != sum(call.send if what == "exchange_in" else call.recv):
            raise ValueError(f"schedule 'baseline' with the ragged exchange: {what} got {rows} rows, not this "
                             "call's; the ragged exchange runs a layer's rows whole (pipeline_degree must be 1)")
        return call

    def exchange_in(self, d_RM: torch.Tensor) -> torch.Tensor:
        call = self._current(d_RM.shape[0], "exchange_in")
        return ragged_all_to_all(d_RM, call.send, call.recv, self.groups.ep, self.rec)

    def expert(self, e_QM: torch.Tensor, params: LayerParams) -> torch.Tensor:
        call, model_dim = self._current(e_QM.shape[0], "expert"), e_QM.shape[-1]
        e_l, replicas = self.config.num_experts // self.groups.ep.size, self.groups.mp.size
        padded = torch.cat([e_QM, e_QM.new_zeros(1, model_dim)])
        x_ElnM = padded.index_select(0, call.gather).view(e_l, call.rows, model_dim)
        if replicas > 1:
            x_ElnM = comm.grad_scale(x_ElnM, float(replicas))
        y_ElnM = params.experts(x_ElnM)
        if replicas > 1:
            y_ElnM = comm.grad_scale(y_ElnM, 1.0 / replicas)
        return y_ElnM.reshape(-1, model_dim).index_select(0, call.back)

    def exchange_out(self, o_QM: torch.Tensor) -> torch.Tensor:
        call = self._current(o_QM.shape[0], "exchange_out")
        return ragged_all_to_all(o_QM, call.recv, call.send, self.groups.ep, self.rec)

    def finish(self, r_RM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        call: _RaggedCall = dispatched.state
        if len(call.routings) == 1:
            return combine_rows(r_RM, call.pos_NSK[0], call.routings[0])
        y_NSM = torch.stack([combine_rows(r_RM, call.pos_NSK[i], rt) for i, rt in enumerate(call.routings)])
        return comm.split(y_NSM, self.groups.esp, self.rec, dim=0).squeeze(0)
