"""DeepSpeed-MoE's top-1 / top-2 gate (``deepspeed.moe.sharded_moe.top1gating`` / ``top2gating``), reproduced
exactly without its (S, E) one-hot masks and cumsums, straight into the core's :class:`Routing`.

Shapes: S tokens, E experts, K routes per token (1 or 2), C capacity, R = K S routes.

What DeepSpeed computes, and how it is computed here (same experts, slots, drops, weights, aux loss, counts and
random draws, in the same order from torch's generator):

- gates_SE = softmax(logits_SE); the first expert is ``argmax`` over the gates (the first maximum), or, top-1 with
  ``noisy_gate_policy="RSample"``, over logits + Gumbel(0, 1) noise of shape (S, E). Top-2's second expert is the
  argmax over the logits (plus Gumbel noise when ``top2_2nd_expert_sampling``) with the first expert at -inf.
- A route's location in its expert's buffer is its rank among the routes to that expert: first choices in token
  order, then second choices in token order. DeepSpeed takes it from ``cumsum`` over one-hot (S, E) int64 masks;
  here one stable sort of the R expert ids gives it (rank = sorted index - the expert's first sorted index).
- Top-2 drops by position (location >= C). Top-1 keeps, per expert, the C tokens that ``torch.topk`` picks over
  dim 0 of mask_SE * U_SE (U uniform, shape (S, E), when ``use_rts``; the bare mask otherwise), then numbers the
  kept tokens in token order. Here the pick is a sort by U within each expert. Where ``topk``'s choice is not
  fixed by the values (tied U at an expert's capacity boundary, a drawn U of exactly 0, or no RTS with an expert
  over capacity: its tie order is the kernel's), the same ``topk`` runs on the same (S, E) tensor instead.
- Capacity: drop mode ``max(ceil(S / E * f * K), min_capacity)`` computed in torch's float32 as DeepSpeed does;
  dropless: the largest count, passed through ``dropless_capacity`` (DeepSpeed's all-reduce MAX over the EP group
  and tensor-parallel padding live in the host adapter), top-1 then at most S.
- Weights: top-1 the raw gate of a kept route; top-2 the kept gates over max(their sum, eps). Dropped routes
  weigh 0 and have slot -1 (their expert stays the chosen one). Gradients flow to the logits through the gates.
- l_aux: top-1 ``sum(me * ce) * E``, top-2 ``mean(me * ce) * E * E``, me = gates' mean over tokens, ce = first-choice
  share (used tokens only, top-1); exp_counts: routes per expert before dropping (used tokens only, top-1).

Checked bit for bit on CPU, gradients and generator state included (tests/test_fastgate.py). ce is count / S, which
is what CPU's ``torch.mean`` of the 0/1 mask gives; a device whose mean multiplies by 1 / S instead may differ from
DeepSpeed's l_aux in the last bit (not run here: no GPU). Not reproduced: ``topkgating`` (k > 2) and Tutel's cumsum;
``used_token`` must be a 0/1 bool or integer tensor (the host adapter falls back to DeepSpeed's gate otherwise).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from moe_plugins.core.gating import Routing

Sampler = Callable[[torch.Size, torch.device], torch.Tensor]
CapacityHook = Callable[[torch.Tensor], torch.Tensor]


def gumbel_sample(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise drawn as DeepSpeed's ``gumbel_rsample`` draws it (same generator calls)."""
    gumbel = torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=device), torch.tensor(1.0, device=device))
    return gumbel.rsample(shape)


def uniform_sample(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """U[0, 1) noise as DeepSpeed's random token selection draws it: ``Uniform(0., 1.).rsample`` is
    0 + rand * (1 - 0) on ``torch.rand`` in the default dtype, which is that ``torch.rand`` bit for bit."""
    return torch.rand(shape, dtype=torch.get_default_dtype(), device=device)


def drop_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> torch.Tensor:
    """DeepSpeed's ``_capacity``: ceil(S / E * f) in float32 (a 0-dim tensor), at least ``min_capacity``.
    Top-2 passes f * 2."""
    cap = torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor)).to(torch.int64)
    return torch.maximum(cap, torch.tensor(min_capacity).to(torch.int64))


def rank_within_key(key_R: torch.Tensor, num_keys: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """rank_R: how many earlier entries (in index order) share the entry's key; count_K: entries per key.
    One stable sort of R integers, no (R, K) tensor."""
    sorted_R, perm_R = torch.sort(key_R, stable=True)
    bounds = torch.searchsorted(sorted_R, torch.arange(num_keys + 1, device=key_R.device))
    rank_sorted_R = torch.arange(key_R.shape[0], device=key_R.device) - bounds[:-1][sorted_R]
    rank_R = torch.empty_like(rank_sorted_R).scatter_(0, perm_R, rank_sorted_R)
    return rank_R, bounds[1:] - bounds[:-1]


def _check_used(used_token_S: Optional[torch.Tensor], num_tokens: int) -> Optional[torch.Tensor]:
    """The used-token flags as bool. DeepSpeed multiplies its mask by ``used_token``; only 0/1 values of an
    integer or bool tensor keep that a mask (a float one changes DeepSpeed's result dtypes), so others are refused."""
    if used_token_S is None:
        return None
    if used_token_S.dtype.is_floating_point or used_token_S.dtype.is_complex:
        raise ValueError(f"used_token must be a bool or integer tensor, not {used_token_S.dtype}")
    if tuple(used_token_S.shape) != (num_tokens,):
        raise ValueError(f"used_token has shape {tuple(used_token_S.shape)}; expected ({num_tokens},)")
    if bool(((used_token_S != 0) & (used_token_S != 1)).any()):
        raise ValueError("used_token must hold only 0 and 1")
    return used_token_S != 0


def _topk_kept(expert_S: torch.Tensor, used_token_S: Optional[torch.Tensor], u_SE: Optional[torch.Tensor],
               num_experts: int, sel: int) -> torch.Tensor:
    """DeepSpeed's own top-1 selection, on the same (S, E) tensor (for the cases its tie order decides)."""
    mask_SE = F.one_hot(expert_S, num_experts)
    if used_token_S is not None:
        mask_SE = mask_SE * used_token_S.unsqueeze(1)
    score_SE = mask_SE * u_SE if u_SE is not None else mask_SE
    top_CE = torch.topk(score_SE, k=sel, dim=0)[1]
    picked_SE = torch.zeros_like(mask_SE).scatter_(0, top_CE, 1)
    return (mask_SE * picked_SE).gather(1, expert_S.unsqueeze(1)).squeeze(1) != 0


def _rts_kept(expert_S: torch.Tensor, used_S: torch.Tensor, u_S: torch.Tensor, count_E: torch.Tensor,
              sel: int) -> Optional[torch.Tensor]:
    """Per expert, the ``sel`` (>= 1) used tokens with the largest U (RTS with an expert over capacity); None when
    the values leave ``topk``'s choice open (equal U on both sides of an expert's boundary)."""
    num_experts = count_E.shape[0]
    key_S = torch.where(used_S, expert_S, num_experts)
    if u_S.dtype == torch.float32:      # one integer sort: expert, then U's bits (monotone on [0, 1)) descending
        one_bits = 0x3F800000           # IEEE-754 binary32 1.0
        order_S = torch.sort(key_S * (1 << 31) + (one_bits - u_S.view(torch.int32).long()), stable=True)[1]
    else:
        by_u = torch.argsort(u_S, descending=True, stable=True)
        order_S = by_u[torch.argsort(key_S[by_u], stable=True)]    # by expert, then U descending
    start_K = torch.cat([torch.cumsum(count_E, 0) - count_E, count_E.sum(0, keepdim=True)])
    u_sorted_S = u_S[order_S]
    edge = start_K[:num_experts][count_E > sel] + sel - 1
    if bool((u_sorted_S[edge] == u_sorted_S[edge + 1]).any()):
        return None
    rank_sorted_S = torch.arange(order_S.shape[0], device=u_S.device) - start_K[key_S[order_S]]
    rank_S = torch.empty_like(rank_sorted_S).scatter_(0, order_S, rank_sorted_S)
    return used_S & (rank_S < sel)


def top1_routing(logits_SE: torch.Tensor, capacity_factor: float, min_capacity: int, *,
                 used_token_S: Optional[torch.Tensor] = None, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, dropless_capacity: Optional[CapacityHook] = None,
                 gumbel: Sampler = gumbel_sample, uniform: Sampler = uniform_sample) -> Routing:
    """``top1gating(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens, use_rts)``
    as a Routing (K = 1). ``dropless_capacity`` maps the local largest count (0-dim int64) to the capacity every
    rank uses (default: itself). ``gumbel`` / ``uniform`` draw the noise (the host passes DeepSpeed's samplers)."""
    num_tokens, num_experts = logits_SE.shape
    used_S = _check_used(used_token_S, num_tokens)
    if noisy_gate_policy == "RSample":
        noisy_SE = logits_SE.detach() + gumbel(logits_SE.shape, logits_SE.device)
    gates_SE = F.softmax(logits_SE, dim=1)
    cap = drop_capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    with torch.no_grad():
        expert_S = torch.argmax(noisy_SE if noisy_gate_policy == "RSample" else gates_SE, dim=1)
    key_S = expert_S if used_S is None else torch.where(used_S, expert_S, num_experts)
    count_E = torch.zeros(num_experts + 1, dtype=torch.int64, device=logits_SE.device).scatter_add_(
        0, key_S, torch.ones_like(key_S))[:num_experts]
    if not drop_tokens:
        new_cap = torch.max(count_E)
        new_cap = dropless_capacity(new_cap) if dropless_capacity is not None else new_cap
        cap = min(new_cap, torch.tensor(num_tokens).to(new_cap.device))
    me_E = torch.mean(gates_SE, dim=0)
    ce_E = count_E.float() / num_tokens                       # torch.mean of the 0/1 mask: an exact sum / S
    l_aux = torch.sum(me_E * ce_E) * num_experts
    u_SE = uniform(torch.Size((num_tokens, num_experts)), logits_SE.device) if use_rts else None
    if num_tokens < min_capacity:
        raise ValueError("No. of tokens (batch-size) should be greater than min_capacity. Either set min_capacity "
                         "to 0 or increase your batch size.")
    sel = min(int(cap), num_tokens)
    used_all = used_S if used_S is not None else torch.ones_like(expert_S, dtype=torch.bool)
    u_S = u_SE.gather(1, expert_S.unsqueeze(1)).squeeze(1) if u_SE is not None else None
    over, zero_u = torch.stack([count_E.max() > sel, (used_all & (u_S == 0)).any() if u_S is not None
                                else torch.zeros((), dtype=torch.bool, device=key_S.device)]).tolist()
    kept_S: Optional[torch.Tensor] = used_all
    if sel == 0:
        kept_S = torch.zeros_like(used_all)
    elif zero_u and sel < num_tokens:                         # a drawn 0 ties with the unused rows' zeros
        kept_S = None
    elif over:
        kept_S = _rts_kept(expert_S, used_all, u_S, count_E, sel) if u_S is not None else None
    if kept_S is None:
        kept_S = _topk_kept(expert_S, used_token_S, u_SE, num_experts, sel)
    loc_S, _ = rank_within_key(torch.where(kept_S, expert_S, num_experts), num_experts + 1)
    weight_S = gates_SE.gather(1, expert_S.unsqueeze(1)).squeeze(1) * kept_S.to(gates_SE.dtype)
    return Routing(expert_SK=expert_S.unsqueeze(1), slot_SK=torch.where(kept_S, loc_S, -1).unsqueeze(1),
                   weight_SK=weight_S.unsqueeze(1), capacity=int(cap), aux_loss=l_aux, exp_counts_E=count_E)


def top2_routing(logits_SE: torch.Tensor, capacity_factor: float, min_capacity: int, *, drop_tokens: bool = True,
                 top2_2nd_expert_sampling: bool = True, dropless_capacity: Optional[CapacityHook] = None,
                 gumbel: Sampler = gumbel_sample) -> Routing:
    """``top2gating(logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling)`` as a
    Routing (K = 2). ``logits_SE`` is not modified (DeepSpeed adds the Gumbel noise in place)."""
    num_tokens, num_experts = logits_SE.shape
    gates_SE = F.softmax(logits_SE, dim=1)
    with torch.no_grad():
        first_S = torch.argmax(gates_SE, dim=1)
        noisy_SE = logits_SE.detach()
        if top2_2nd_expert_sampling:
            noisy_SE = (noisy_SE + gumbel(logits_SE.shape, logits_SE.device)).to(logits_SE.dtype)
        second_S = torch.argmax(noisy_SE.scatter(1, first_S.unsqueeze(1), float("-inf")), dim=1)
    expert_R = torch.cat([first_S, second_S])                  # all first choices, then all second choices
    loc_R, count_E = rank_within_key(expert_R, num_experts)
    first_count_E = torch.zeros_like(count_E).scatter_add_(0, first_S, torch.ones_like(first_S))
    me_E = torch.mean(gates_SE, dim=0)
    ce_E = first_count_E.float() / num_tokens
    l_aux = torch.mean(me_E * ce_E) * num_experts * num_experts
    if drop_tokens:
        cap = drop_capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
    else:
        new_cap = torch.max(count_E)
        cap = dropless_capacity(new_cap) if dropless_capacity is not None else new_cap
    kept_R = loc_R < cap
    gate_R = gates_SE.gather(1, expert_R.view(2, num_tokens).t()).t().reshape(-1) * kept_R.to(gates_SE.dtype)
    gate1_S, gate2_S = gate_R[:num_tokens], gate_R[num_tokens:]
    denom_S = torch.clamp(gate1_S + gate2_S, min=torch.finfo(gate_R.dtype).eps)
    weight_SK = torch.stack([gate1_S / denom_S, gate2_S / denom_S], dim=1)
    slot_SK = torch.where(kept_R, loc_R, -1).view(2, num_tokens).t()
    return Routing(expert_SK=expert_R.view(2, num_tokens).t(), slot_SK=slot_SK, weight_SK=weight_SK,
                   capacity=int(cap), aux_loss=l_aux, exp_counts_E=count_E)


def topk_routing(logits_SE: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, **kw) -> Routing:
    """``top1_routing`` (k = 1) or ``top2_routing`` (k = 2); DeepSpeed's general top-k gate is not reproduced."""
    if k == 1:
        return top1_routing(logits_SE, capacity_factor, min_capacity, **kw)
    if k == 2:
        return top2_routing(logits_SE, capacity_factor, min_capacity, **kw)
    raise ValueError(f"k ({k}) must be 1 or 2: DeepSpeed's topkgating (k > 2) is not reproduced")


# ---- DeepSpeed's output formats, for comparisons -----------------------------------------------------------

def sparse_format(routing: Routing, num_experts: int) -> Tuple:
    """``(l_aux, C, E, indices_KS, locations_KS, gates_KS, exp_counts_E)`` as ``sparse_routes=True`` returns it
    (a dropped route: index -1, location 0, gate 0)."""
    kept_SK = routing.slot_SK >= 0
    indices_KS = torch.where(kept_SK, routing.expert_SK, -1).t().to(torch.int32)
    locations_KS = torch.where(kept_SK, routing.slot_SK, 0).t().to(torch.int32)
    return (routing.aux_loss, routing.capacity, num_experts, indices_KS, locations_KS, routing.weight_SK.t(),
            routing.exp_counts_E)


def dense_format(routing: Routing, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(l_aux, combine_weights_SEC, dispatch_mask_SEC, exp_counts_E)`` as the dense gate returns it."""
    kept_SK = routing.slot_SK >= 0
    token_SK = torch.arange(routing.num_tokens, device=kept_SK.device).unsqueeze(1).expand_as(kept_SK)
    combine_SEC = routing.weight_SK.new_zeros(routing.num_tokens, num_experts, routing.capacity)
    combine_SEC.index_put_((token_SK[kept_SK], routing.expert_SK[kept_SK], routing.slot_SK[kept_SK]),
                           routing.weight_SK[kept_SK])
    return routing.aux_loss, combine_SEC, combine_SEC.bool(), routing.exp_counts_E
