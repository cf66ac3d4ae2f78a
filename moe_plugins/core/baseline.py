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
from typing import List

import torch

from moe_plugins.core import comm
from moe_plugins.core.dispatch import combine, dispatch
from moe_plugins.core.gating import Routing
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, Schedule, routing_stats


@dataclass(frozen=True)
class _State:
    routings: List[Routing]
    num_tokens: int


class BaselineSchedule(Schedule):
    name = "baseline"

    def exchange(self, d: torch.Tensor) -> Exchange:
        return Exchange("ep", 1.0, 1.0)              # the EP all-to-all keeps the rows

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        cfg, esp = self.config, self.groups.esp
        if esp.size == 1:        # views only: a stack / select of one block costs a copy and a zero-filled grad
            routing = params.router(x_SM)
            return Dispatched(d=dispatch(x_SM, routing, cfg.num_experts).unsqueeze(1), cap_dim=2,
                              state=_State([routing], x_SM.shape[0]), aux_loss=routing.aux_loss,
                              exp_counts_E=routing.exp_counts_E, dropped=routing.dropped)
        x_NSM = comm.all_gather(x_SM.unsqueeze(0), esp, self.rec, dim=0, bwd="split")
        routings = []
        for i in range(esp.size):
            if i == esp.rank:
                routings.append(params.router(x_NSM[i]))
            else:  # another member's block: gated again here, only its routing decisions are used
                with torch.no_grad():
                    routings.append(params.router(x_NSM[i]))
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
