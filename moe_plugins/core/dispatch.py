"""Dispatch tokens into the (E, C, M) capacity layout and combine them back; pure and autograd-friendly.

Each capacity slot holds at most one route and slots are independent, so splitting the buffer along C
(PipeMoE chunks, MP splits) is exact. ``slots`` may exceed the routing's capacity: extra slots stay empty.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_plugins.core.gating import Routing


def flat_slots(routing: Routing, num_experts: int, slots: int) -> torch.Tensor:
    """Index of every route in the flattened (E*slots) buffer; dropped routes point at scratch E*slots."""
    flat_SK = routing.expert_SK * slots + routing.slot_SK
    return torch.where(routing.slot_SK >= 0, flat_SK, torch.full_like(flat_SK, num_experts * slots))


def dispatch(x_SM: torch.Tensor, routing: Routing, num_experts: int, slots: Optional[int] = None) -> torch.Tensor:
    """Gather tokens into d_ECM (C = ``slots``, default the routing's capacity). Empty slots are zero."""
    slots = routing.capacity if slots is None else slots
    num_tokens, model_dim = x_SM.shape
    flat_SK = flat_slots(routing, num_experts, slots)
    source = torch.full((num_experts * slots + 1,), num_tokens, dtype=torch.long, device=x_SM.device)
    tokens_SK = torch.arange(num_tokens, device=x_SM.device).unsqueeze(1).expand_as(flat_SK)
    source.scatter_(0, flat_SK.reshape(-1), tokens_SK.reshape(-1))
    padded = torch.cat([x_SM, x_SM.new_zeros(1, model_dim)])
    return padded.index_select(0, source[:-1]).view(num_experts, slots, model_dim)


def combine(y_ECM: torch.Tensor, routing: Routing) -> torch.Tensor:
    """out_SM = sum_k weight_SK * y[expert_SK, slot_SK]; dropped routes contribute zero."""
    num_experts, slots, model_dim = y_ECM.shape
    flat_SK = flat_slots(routing, num_experts, slots)
    padded = torch.cat([y_ECM.reshape(-1, model_dim), y_ECM.new_zeros(1, model_dim)])
    routed_SKM = padded.index_select(0, flat_SK.reshape(-1)).view(*flat_SK.shape, model_dim)
    dtype = torch.promote_types(routed_SKM.dtype, routing.weight_SK.dtype)
    out_SM = (routed_SKM.to(dtype) * routing.weight_SK.to(dtype).unsqueeze(-1)).sum(1)
    return out_SM.to(y_ECM.dtype)
