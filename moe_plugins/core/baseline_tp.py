"""DeepSpeed 0.19's data flow for tensor parallelism (``drop_tokens`` / ``gather_tokens`` in sharded_moe).

    gate -> MP-Split(capacity) -> EP-AlltoAll -> [ESP-AllGather(capacity)] -> experts -> [ESP-AllReduce ->
    ESP-Split(capacity)] -> EP-AlltoAll -> MP-AllGather(capacity) -> combine

The bracketed steps run when experts are sharded (ESP > 1), in which case the ESP groups must be the MP
groups (DeepSpeed's expert tensor parallelism uses the TP group). Each MP rank sends a distinct 1/N_MP of
the capacity, so no replica is processed twice. Capacity buffers are padded to a multiple of N_MP with
empty slots; which routes are dropped is decided by the unpadded capacity, so the math is unchanged.
"""

from __future__ import annotations

from typing import List

import torch

from moe_plugins.core import comm
from moe_plugins.core.dispatch import combine, dispatch
from moe_plugins.core.gating import Routing
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, Schedule


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class BaselineTPSchedule(Schedule):
    name = "baseline-tp"

    def exchange(self, d: torch.Tensor) -> Exchange:
        return Exchange("ep", 1.0, self.groups.esp.size)   # then an ESP all-gather of the capacity

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

    def finish(self, r_EcM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        routing: Routing = dispatched.state
        r_ECM = comm.all_gather(r_EcM, self.groups.mp, self.rec, dim=1, bwd="split")
        return combine(r_ECM, routing)
