"""The core's router: top-k gate plus capacity, with dropless capacity made uniform across ranks."""

from __future__ import annotations

import torch

from . import comm
from .comm import Recorder
from .config import MoEConfig
from .gating import Routing, apply_capacity, assign_topk, capacity, gate_logits
from .groups import MoEProcessGroups


def uniform_capacity(local_max: int, groups: MoEProcessGroups, rec: Recorder) -> int:
    """Dropless capacity: the largest expert count over the fused EP&ESP group and the MP group, which
    covers every rank whose buffers must have the same shape. O(1) integers, not tokens."""
    cap = comm.all_reduce_max(local_max, groups.ep_esp, rec)
    return max(1, comm.all_reduce_max(cap, groups.mp, rec))


def route_tokens(x_SM: torch.Tensor, *, wg_EM: torch.Tensor, config: MoEConfig, groups: MoEProcessGroups,
                 rec: Recorder) -> Routing:
    assign = assign_topk(gate_logits(x_SM, wg_EM), config.k)
    if config.drop_tokens:
        cap = capacity(x_SM.shape[0], config.num_experts, config.k, config.capacity_factor, config.min_capacity)
    else:
        cap = uniform_capacity(assign.max_count, groups, rec)
    return apply_capacity(assign, cap)
