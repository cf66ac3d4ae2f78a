"""``"partitions": "auto"``: the block executor's partition count of each range chosen per batch shape from the
planner's model (:mod:`moe_plugins.lancet.plan`, :mod:`moe_plugins.lancet.choice`) and the cost profile measured on
the user's cluster (docs/lancet.md).

For a batch of B samples of L tokens, the GPT-2-MoE op list (:func:`~moe_plugins.lancet.plan.gpt2_moe_ops`) is
priced with the profile's fitted all-to-all and GEMM lines, and for each of the executor's ranges (from one MoE
block's gate to the next) every k that divides B (up to ``max_partitions``) is timed as the executor runs it
(:func:`~moe_plugins.lancet.choice.range_time`: pipelined forward, backward not); the least time wins, ties to
fewer partitions. One choice per (B, L), kept; the executor asks for its range's count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from moe_plugins.lancet.partition import MAX_PARTITIONS, partition_counts
from moe_plugins.lancet.choice import choose_partitions
from moe_plugins.lancet.plan import GPT2MoESizes, LancetCosts, gpt2_moe_ops

logger = logging.getLogger("moe_plugins.lancet")


@dataclass(frozen=True, kw_only=True)
class StackFacts:
    """What the planner needs of a GPT-2-MoE stack besides the batch shape (the letters of ``GPT2MoESizes``)."""

    M: int
    H: int
    heads: int
    E: int
    k: int
    f: float
    P: int
    layers: int
    moe_every: int
    element_bytes: int


def moe_every_of(moe: Sequence[int], layers: int) -> int:
    """n when the MoE blocks are exactly every n-th block (blocks n-1, 2n-1, ...), as the planner's op list
    assumes; a ValueError naming them otherwise."""
    n = moe[0] + 1 if moe else 0
    if not moe or list(moe) != [i for i in range(layers) if (i + 1) % n == 0]:
        raise ValueError(f"moe_plugins.lancet.partitions ('auto') plans stacks whose MoE blocks are every n-th "
                         f"block (n-1, 2n-1, ...); this model's are {list(moe)} of {layers}: give an integer")
    return n


class AutoPartitions:
    """The executor's partition policy: ``policy(h_BLM, range_index) -> k`` (see the module docstring)."""

    def __init__(self, facts: StackFacts, costs: LancetCosts, source: str, max_partitions: int = MAX_PARTITIONS,
                 objective: str = "training"):
        self.facts, self.costs, self.source = facts, costs, source
        self.max_partitions, self.objective = max_partitions, objective
        self.choices: Dict[Tuple[int, int], Tuple[Tuple[int, ...], Tuple[Dict[int, float], ...]]] = {}

    def allowed(self, samples: int) -> List[int]:
        return partition_counts(samples, self.max_partitions)

    def choose(self, samples: int, tokens: int) -> Tuple[int, ...]:
        """The count of every range, in order, for a batch of ``samples`` x ``tokens``."""
        key = (samples, tokens)
        if key not in self.choices:
            f = self.facts
            sizes = GPT2MoESizes(B=samples, L=tokens, M=f.M, H=f.H, heads=f.heads, E=f.E, k=f.k, f=f.f, P=f.P,
                                 layers=f.layers, moe_every=f.moe_every, element_bytes=f.element_bytes)
            self.choices[key] = choose_partitions(gpt2_moe_ops(sizes, self.costs), self.allowed(samples),
                                                  self.objective)
            ks, times = self.choices[key]
            logger.info("moe_plugins: Lancet partitions auto: B=%d L=%d -> %s per range (model times %s; costs "
                        "from %s)", samples, tokens, list(ks),
                        [{n: f"{t * 1e3:.3f} ms" for n, t in per.items()} for per in times], self.source)
        return self.choices[key][0]

    def __call__(self, h_BLM: torch.Tensor, range_index: int) -> int:
        ks = self.choose(h_BLM.shape[0], h_BLM.shape[1] if h_BLM.dim() > 2 else 1)
        if not 0 <= range_index < len(ks):
            raise ValueError(f"moe_plugins.lancet.partitions ('auto'): the executor asked for range {range_index}, "
                             f"and the planner's op list has {len(ks)} ranges (one per MoE block)")
        return ks[range_index]
