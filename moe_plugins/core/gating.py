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
    def dropped(self) -> torch.Tensor:
        """Routes dropped by capacity, a 0-dim tensor (no host read: ``int()`` it where a number is needed)."""
        return (self.slot_SK < 0).sum()


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


# ---- the same gate on one block of the tokens (Parm's S1: each MP rank gates 1/N_MP of them) -------------
#
# The MP group's S tokens are cut into P blocks of s rows (rows [p s, (p+1) s), the last ones padding). Each
# block picks its top-k locally; the only cross-block facts GShard's order needs are how many routes of each
# rank j each block sends to each expert, counts_PKE (k E integers per block), and, for the aux loss, the
# gate sums over all blocks (E floats). From those every block derives the positions, drops, capacity and
# aux loss that assign_topk + apply_capacity give on the concatenated blocks.

@dataclass(frozen=True)
class BlockCandidates:
    """One block's local top-k, before any cross-block reconciliation."""

    gates_sE: torch.Tensor
    expert_sK: torch.Tensor
    rank_sK: torch.Tensor        # order of the route among this block's routes of the same j to the same expert
    valid_s: torch.Tensor        # False on padding rows, which route nowhere and count nowhere
    counts_KE: torch.Tensor      # this block's routes per (route rank j, expert), valid rows only
    gate_sum_E: torch.Tensor     # sum of the valid rows' gates (differentiable)


@dataclass(frozen=True)
class BlockRouting:
    """A block's routing in the MP group's slot numbering, plus what S1 needs about the other blocks.

    ``routing`` covers the block's rows: slots in [0, capacity) as in the baseline's buffer, combine weights,
    and the group's aux loss and exp_counts_E (totals over all blocks)."""

    routing: Routing
    kept_PE: torch.Tensor        # kept routes per block and expert
    dropped: torch.Tensor        # routes dropped by capacity over all blocks (0-dim)


def block_candidates(logits_sE: torch.Tensor, k: int, valid_s: torch.Tensor) -> BlockCandidates:
    """Top-k of a block's rows and each route's rank within the block (per route rank j and expert)."""
    num_rows, num_experts = logits_sE.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k ({k}) must be between 1 and num_experts ({num_experts})")
    if tuple(valid_s.shape) != (num_rows,):
        raise ValueError(f"valid_s has shape {tuple(valid_s.shape)}; expected ({num_rows},), one flag per row")
    gates_sE = torch.softmax(logits_sE, dim=1)
    expert_sK = torch.topk(gates_sE.detach(), k=k, dim=1).indices
    onehot_KsE = F.one_hot(expert_sK.t(), num_experts) * valid_s.to(torch.long).unsqueeze(1)
    rank_sK = (onehot_KsE.cumsum(1) - 1).gather(2, expert_sK.t().unsqueeze(2)).squeeze(2).t()
    gate_sum_E = (gates_sE * valid_s.to(gates_sE.dtype).unsqueeze(1)).sum(0)
    return BlockCandidates(gates_sE=gates_sE, expert_sK=expert_sK, rank_sK=rank_sK, valid_s=valid_s,
                           counts_KE=onehot_KsE.sum(1), gate_sum_E=gate_sum_E)


def route_starts_PKE(counts_PKE: torch.Tensor) -> torch.Tensor:
    """First position of block p's routes of rank j in expert e's buffer (GShard order): all routes of ranks
    j' < j over all blocks, then those of rank j in blocks p' < p."""
    total_KE = counts_PKE.sum(0)
    earlier_ranks_KE = total_KE.cumsum(0) - total_KE
    earlier_blocks_PKE = counts_PKE.cumsum(0) - counts_PKE
    return earlier_ranks_KE.unsqueeze(0) + earlier_blocks_PKE


def kept_counts_PE(counts_PKE: torch.Tensor, cap: int) -> torch.Tensor:
    """Kept routes per block and expert: block p's routes of rank j to e fill positions
    [start, start + count), of which those below ``cap`` are kept."""
    start_PKE = route_starts_PKE(counts_PKE)
    return (cap - start_PKE).clamp(min=0).minimum(counts_PKE).sum(1)


def assign_block(cand: BlockCandidates, counts_PKE: torch.Tensor, block: int, gate_total_E: torch.Tensor,
                 num_tokens: int) -> Assignment:
    """The block's share of ``assign_topk`` on all S tokens: positions in GShard order, the group's
    exp_counts_E and its aux loss (me_E from the gate sums over all blocks, ce_E from the first choices)."""
    blocks, k, num_experts = counts_PKE.shape
    if not 0 <= block < blocks:
        raise ValueError(f"block ({block}) must be in [0, {blocks}), the number of blocks in counts_PKE")
    if tuple(cand.counts_KE.shape) != (k, num_experts):     # (its values, this block's own counts_KE: unread)
        raise ValueError(f"counts_PKE[{block}] must be this block's own counts_KE (shape {(k, num_experts)})")
    if num_tokens < 1:
        raise ValueError(f"num_tokens ({num_tokens}) must be >= 1")
    start_KE = route_starts_PKE(counts_PKE)[block]
    position_sK = start_KE.gather(1, cand.expert_sK.t()).t() + cand.rank_sK
    never = torch.iinfo(position_sK.dtype).max                       # padding rows: beyond any capacity
    position_sK = torch.where(cand.valid_s.unsqueeze(1), position_sK, torch.full_like(position_sK, never))
    me_E = gate_total_E / num_tokens
    ce_E = counts_PKE[:, 0].sum(0).to(me_E.dtype) / num_tokens
    aux = (me_E * ce_E).sum() * num_experts
    return Assignment(gates_SE=cand.gates_sE, expert_SK=cand.expert_sK, position_SK=position_sK,
                      exp_counts_E=counts_PKE.sum((0, 1)), aux_loss=aux)


def route_block(cand: BlockCandidates, counts_PKE: torch.Tensor, block: int, gate_total_E: torch.Tensor,
                num_tokens: int, cap: int) -> BlockRouting:
    """A block's routing with capacity ``cap`` (computed from all S tokens), equal row for row to
    ``apply_capacity(assign_topk(all logits), cap)`` on the block's rows."""
    assign = assign_block(cand, counts_PKE, block, gate_total_E, num_tokens)
    kept_PE = kept_counts_PE(counts_PKE, cap)
    return BlockRouting(routing=apply_capacity(assign, cap), kept_PE=kept_PE,
                        dropped=counts_PKE.sum() - kept_PE.sum())
