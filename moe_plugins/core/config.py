"""Typed configuration of an MoE layer, and the checks that tie it to a parallel layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from moe_plugins.core.experts import ACTIVATIONS
from moe_plugins.core.layout import ParallelLayout


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer in the paper's letters: M = hidden, H = ffn, E = num_experts, k, f = capacity_factor."""

    hidden: int
    ffn: int
    num_experts: int
    k: int = 1
    capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    activation: str = "gelu"


def moe_config_problems(cfg: MoEConfig, layout: ParallelLayout) -> List[str]:
    """Every reason ``cfg`` does not fit ``layout``, each naming fields and numbers (empty when fine)."""
    problems = []
    for name in ("hidden", "ffn", "num_experts", "k"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name} ({value!r}) must be a positive integer")
    if problems:
        return problems
    if cfg.k > cfg.num_experts:
        problems.append(f"k ({cfg.k}) must not exceed num_experts ({cfg.num_experts})")
    if cfg.num_experts % layout.ep:
        problems.append(f"num_experts ({cfg.num_experts}) must be divisible by ep ({layout.ep})")
    if cfg.ffn % layout.esp:
        problems.append(f"ffn ({cfg.ffn}) must be divisible by esp ({layout.esp})")
    if not cfg.capacity_factor > 0:
        problems.append(f"capacity_factor ({cfg.capacity_factor}) must be > 0")
    if cfg.min_capacity < 0:
        problems.append(f"min_capacity ({cfg.min_capacity}) must be >= 0")
    if cfg.activation not in ACTIVATIONS:
        problems.append(f"activation ({cfg.activation!r}) must be one of {sorted(ACTIVATIONS)}")
    return problems
