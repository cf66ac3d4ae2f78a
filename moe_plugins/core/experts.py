"""Stacked expert FFNs and their sharding along H (ESP) and E (EP): small pure functions.

Shapes: E experts (E_l local), M model dim, H FFN hidden (H_s = H / ESP per shard), N rows per expert.
An expert is y = act(x @ w1_MH + b1_H) @ w2_HM + b2_M. A shard computes the partial sum over its H slice;
b2 is added once, after the partials are summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict

import torch
import torch.nn.functional as F

GELU_TANH = "gelu_tanh"      # GELU's tanh form: GPT-2's gelu_new, nn.GELU(approximate="tanh")
ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu, "silu": F.silu, GELU_TANH: partial(F.gelu, approximate="tanh")}


@dataclass(frozen=True)
class ExpertWeights:
    """Full or sharded expert weights: w1_EMH, b1_EH, w2_EHM, b2_EM."""

    w1_EMH: torch.Tensor
    b1_EH: torch.Tensor
    w2_EHM: torch.Tensor
    b2_EM: torch.Tensor


def partial_ffn(x_ENM: torch.Tensor, w: ExpertWeights, activation: str) -> torch.Tensor:
    """Expert FFN over a shard of H, without b2: the ESP partial sum."""
    h_ENH = ACTIVATIONS[activation](torch.baddbmm(w.b1_EH.unsqueeze(1), x_ENM, w.w1_EMH))
    return torch.bmm(h_ENH, w.w2_EHM)


def local_experts(ep_rank: int, num_experts: int, ep: int) -> slice:
    if num_experts % ep:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by ep ({ep})")
    n = num_experts // ep
    return slice(ep_rank * n, (ep_rank + 1) * n)


def ffn_shard(esp_rank: int, ffn: int, esp: int) -> slice:
    if ffn % esp:
        raise ValueError(f"ffn ({ffn}) must be divisible by esp ({esp})")
    n = ffn // esp
    return slice(esp_rank * n, (esp_rank + 1) * n)


def shard_weights(full: ExpertWeights, ep_rank: int, ep: int, esp_rank: int, esp: int) -> ExpertWeights:
    """The slice of the full weights that rank (ep_rank, esp_rank) holds."""
    e = local_experts(ep_rank, full.w1_EMH.shape[0], ep)
    h = ffn_shard(esp_rank, full.w1_EMH.shape[2], esp)
    return ExpertWeights(w1_EMH=full.w1_EMH[e, :, h], b1_EH=full.b1_EH[e, h], w2_EHM=full.w2_EHM[e, h, :],
                         b2_EM=full.b2_EM[e])


def init_full_weights(num_experts: int, hidden: int, ffn: int, generator: torch.Generator,
                      dtype: torch.dtype = torch.float32) -> ExpertWeights:
    """Deterministic init (uniform, nn.Linear's bounds) drawn from ``generator``: same on every rank."""
    def uniform(shape, fan_in):
        bound = 1.0 / fan_in ** 0.5
        return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1).mul(bound).to(dtype)
    return ExpertWeights(w1_EMH=uniform((num_experts, hidden, ffn), hidden), b1_EH=uniform((num_experts, ffn), hidden),
                         w2_EHM=uniform((num_experts, ffn, hidden), ffn), b2_EM=uniform((num_experts, hidden), ffn))


def sharded_experts(x_ElNM: torch.Tensor, *, weights: ExpertWeights, activation: str, esp, rec,
                    ffn: Callable[[torch.Tensor, ExpertWeights, str], torch.Tensor] = partial_ffn) -> torch.Tensor:
    """This rank's expert shard on rows x_ElNM: ESP partial sums all-reduced (forward), input gradient
    all-reduced (backward, via copy_to), b2 added once. ``esp`` is a groups.Group, ``rec`` a comm.Recorder;
    ``ffn``: the partial FFN (Lancet passes its deferred-dW form)."""
    from moe_plugins.core import comm
    x_ElNM = comm.copy_to(x_ElNM, esp, rec)
    y_ElNM = comm.all_reduce(ffn(x_ElNM, weights, activation), esp, rec)
    return y_ElNM + weights.b2_EM.unsqueeze(1)
