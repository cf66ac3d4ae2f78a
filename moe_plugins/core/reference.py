"""Single-process reference MoE: every kept route computed token by token with the full expert weights.

It shares only the gate (tested on its own in tests/test_gating.py) with the distributed layer; it does not
use the capacity layout, dispatch/combine or any collective, so it checks all of those.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from moe_plugins.core.config import MoEConfig
from moe_plugins.core.experts import ACTIVATIONS, ExpertWeights
from moe_plugins.core.gating import Routing, route


def reference_moe(x_SM: torch.Tensor, wg_EM: torch.Tensor, full: ExpertWeights, cfg: MoEConfig,
                  dropless_capacity: Optional[int] = None) -> Tuple[torch.Tensor, Routing]:
    """y_SM = sum over kept routes (s, j) of weight_sj * FFN_{expert_sj}(x_s)."""
    routing = route(x_SM, wg_EM, k=cfg.k, capacity_factor=cfg.capacity_factor, min_capacity=cfg.min_capacity,
                    drop_tokens=cfg.drop_tokens, dropless_capacity=dropless_capacity)
    kept_R = (routing.slot_SK >= 0).reshape(-1)
    token_R = torch.arange(x_SM.shape[0]).repeat_interleave(cfg.k)[kept_R]
    expert_R = routing.expert_SK.reshape(-1)[kept_R]
    weight_R = routing.weight_SK.reshape(-1)[kept_R]
    x_RM = x_SM[token_R]
    h_RH = ACTIVATIONS[cfg.activation](torch.einsum("rm,rmh->rh", x_RM, full.w1_EMH[expert_R]) + full.b1_EH[expert_R])
    y_RM = torch.einsum("rh,rhm->rm", h_RH, full.w2_EHM[expert_R]) + full.b2_EM[expert_R]
    y_RM = y_RM * weight_R.to(y_RM.dtype).unsqueeze(1)
    y_SM = torch.zeros_like(x_SM).index_add(0, token_R, y_RM)
    return y_SM, routing
