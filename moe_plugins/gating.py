"""Top-k gating with capacity (GShard / Switch), as pure functions.

Shapes: S tokens, E experts, K = k routes per token, M model dim.

Semantics (those of DeepSpeed-MoE's TopKGate with ``drop_policy="position"``):
- gates_SE = softmax(x_SM @ wg_EM^T), computed in at least float32;
- the k experts of a token are its k largest gates; route j of every token is placed after all
  routes j-1 of all tokens (GShard's order), in token order;
- drop mode: capacity C = max(ceil(k * f * S / E), min_capacity), and a route whose position is
  >= C is dropped; dropless: C is the largest per-expert count (made uniform across ranks by the caller);
- combine weights: k = 1 the raw gate (Switch); k >= 2 the gates renormalised over the kept routes;
- aux loss = E * sum_e mean_s(gates_SE[:, e]) * mean_s(first_choice_SE[:, e]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Routing:
    """Where every route of every token goes. ``slot_SK == -1`` marks a dropped route."""

    expert_SK: torch.Tensor
    slot_SK: torch.Tensor
    weight_SK: torch.Tensor
    capacity: int
    aux_loss: torch.Tensor
    exp_counts_E: torch.Tensor   # routes per expert before dropping

    @property
    def num_tokens(self) -> int:
        return self.expert_SK.shape[0]

    @property
    def dropped(self) -> int:
        return int((self.slot_SK < 0).sum())


def capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """Expert capacity T = ceil(k * f * S / E), at least ``min_capacity`` (parm.txt's T, DeepSpeed's rule)."""
    if num_tokens < 1 or num_experts < 1 or k < 1:
        raise ValueError(f"capacity needs num_tokens ({num_tokens}), num_experts ({num_experts}) and k ({k}) >= 1")
    return max(int(math.ceil(k * capacity_factor * num_tokens / num_experts)), int(min_capacity))


def gate_logits(x_SM: torch.Tensor, wg_EM: torch.Tensor) -> torch.Tensor:
    dtype = torch.promote_types(x_SM.dtype, torch.float32)
    return F.linear(x_SM.to(dtype), wg_EM.to(dtype))


@dataclass(frozen=True)
class Assignment:
    """Capacity-independent part of routing: chosen experts and their positions before dropping."""

    gates_SE: torch.Tensor
    expert_SK: torch.Tensor
    position_SK: torch.Tensor
    exp_counts_E: torch.Tensor
    aux_loss: torch.Tensor

    @property
    def max_count(self) -> int:
        return int(self.exp_counts_E.max()) if self.exp_counts_E.numel() else 0


def assign_topk(logits_SE: torch.Tensor, k: int) -> Assignment:
    """Pick k experts per token and their positions in each expert's buffer (GShard order)."""
    num_tokens, num_experts = logits_SE.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k ({k}) must be between 1 and num_experts ({num_experts})")
    gates_SE = torch.softmax(logits_SE, dim=1)
    expert_SK = torch.topk(gates_SE.detach(), k=k, dim=1).indices
    onehot_KSE = F.one_hot(expert_SK.t(), num_experts)                 # K, S, E
    filled_E = torch.zeros(num_experts, dtype=torch.long, device=logits_SE.device)
    positions = []
    for j in range(k):
        loc_SE = torch.cumsum(onehot_KSE[j], dim=0) - 1 + filled_E
        positions.append(loc_SE.gather(1, expert_SK[:, j:j + 1]).squeeze(1))
        filled_E = filled_E + onehot_KSE[j].sum(0)
    me_E = gates_SE.mean(0)
    ce_E = onehot_KSE[0].to(gates_SE.dtype).mean(0)
    aux = (me_E * ce_E).sum() * num_experts
    return Assignment(gates_SE=gates_SE, expert_SK=expert_SK, position_SK=torch.stack(positions, 1),
                      exp_counts_E=filled_E, aux_loss=aux)


def apply_capacity(assign: Assignment, cap: int) -> Routing:
    """Drop routes at positions >= cap and compute the combine weights of the kept ones."""
    kept_SK = assign.position_SK < cap
    slot_SK = torch.where(kept_SK, assign.position_SK, torch.full_like(assign.position_SK, -1))
    gate_SK = assign.gates_SE.gather(1, assign.expert_SK) * kept_SK.to(assign.gates_SE.dtype)
    if assign.expert_SK.shape[1] > 1:
        denom_S1 = gate_SK.sum(1, keepdim=True).clamp(min=torch.finfo(gate_SK.dtype).eps)
        gate_SK = gate_SK / denom_S1
    return Routing(expert_SK=assign.expert_SK, slot_SK=slot_SK, weight_SK=gate_SK, capacity=int(cap),
                   aux_loss=assign.aux_loss, exp_counts_E=assign.exp_counts_E)


def route(x_SM: torch.Tensor, wg_EM: torch.Tensor, *, k: int, capacity_factor: float, min_capacity: int,
          drop_tokens: bool, dropless_capacity: Optional[int] = None) -> Routing:
    """Gate a token block. In dropless mode, pass the uniform capacity (>= every local count)."""
    assign = assign_topk(gate_logits(x_SM, wg_EM), k)
    if drop_tokens:
        cap = capacity(x_SM.shape[0], wg_EM.shape[0], k, capacity_factor, min_capacity)
    else:
        cap = assign.max_count if dropless_capacity is None else dropless_capacity
        if cap < assign.max_count:
            raise ValueError(f"dropless capacity ({cap}) is below the largest expert count ({assign.max_count})")
    return apply_capacity(assign, cap)
