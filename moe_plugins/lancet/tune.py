"""``"partitions": "tune"``: Lancet's partition count chosen by timing the block executor's own ranges.

The planner's model (``"auto"``, :mod:`moe_plugins.lancet.auto`) prices the exchanges and GEMMs from the profile,
but not what each extra partition costs on the host: another exchange's fixed cost, the lane thread's hand-off
and, on CPU, the exchange sharing the cores with the compute (docs/lancet.md: on 2 cores it chose 8 partitions
where 8 ran 1.24x the best). "tune" measures instead, the way PipeMoE's ``pipeline_degree="tune"`` does:

1. per batch shape (B, L) and training/eval, the candidates are the counts k dividing B (at most
   ``max_partitions``), tried from 1 upwards while each is faster than the one before (:func:`next_candidate`,
   pure); the fastest measured wins, ties within 1% going to fewer partitions (:func:`best_candidate`);
2. each try runs ``warmup`` untimed ranges, then ``timed`` timed ones; a sample is one range (an MoE block's gate
   to the next one): from the choice to the range's end in forward, plus, when autograd records, from the
   gradient of its outputs to the gradient of its gate input in backward (:class:`moe_plugins.core.tuning.Sample`);
3. the median of a try is agreed by the ranks that must cut alike (the slowest rank's, over the layer's EP&ESP
   and MP groups: every EP member must run the same number of partition exchanges), a collective in forward at
   the same range on every rank. One decision per key, kept.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.tuning import TIE_TOLERANCE, Sample, Search
from moe_plugins.lancet.partition import MAX_PARTITIONS, partition_counts

logger = logging.getLogger("moe_plugins.lancet")
TUNE = "tune"


def next_candidate(allowed: Sequence[int], times_s: Mapping[int, float]) -> Optional[int]:
    """The next count to time: the smallest allowed one first, then the next larger one while the last measured
    beat the one before it; None when the climb ends (pure)."""
    measured = [k for k in allowed if k in times_s]
    if not measured:
        return allowed[0] if allowed else None
    if len(measured) >= 2 and times_s[measured[-1]] >= times_s[measured[-2]]:
        return None
    later = [k for k in allowed if k > measured[-1]]
    return later[0] if later else None


def best_candidate(times_s: Mapping[int, float]) -> int:
    """The fewest partitions within ``TIE_TOLERANCE`` of the fastest measured time (pure)."""
    if not times_s:
        raise ValueError("best_candidate needs at least one measured count")
    fastest = min(times_s.values())
    return min(k for k, t in times_s.items() if t <= fastest * (1 + TIE_TOLERANCE))


class TunedPartitions:
    """The executor's partition policy, by measurement (module docstring): ``timed(h_BLM) -> (k, Sample or None)``
    for the executor to clock the range; ``policy(h_BLM) -> k`` as the other policies."""

    def __init__(self, groups: MoEProcessGroups, warmup: int = 1, timed: int = 3,
                 max_partitions: int = MAX_PARTITIONS):
        if not (warmup >= 0 and timed >= 1 and max_partitions >= 1):
            raise ValueError(f"warmup ({warmup}) must be >= 0, timed ({timed}) and max_partitions "
                             f"({max_partitions}) >= 1")
        self.groups, self.warmup, self.timed_calls, self.max_partitions = groups, warmup, timed, max_partitions
        self.searches: Dict[Tuple[int, int, bool], Search[int]] = {}

    def allowed(self, samples: int) -> List[int]:
        return partition_counts(samples, self.max_partitions)

    def timed(self, h_BLM: torch.Tensor) -> Tuple[int, Optional[Sample]]:
        training = torch.is_grad_enabled() and h_BLM.requires_grad
        key = (h_BLM.shape[0], h_BLM.shape[1] if h_BLM.dim() > 2 else 1, training)
        search = self.searches.get(key)
        if search is None:
            allowed = self.allowed(key[0])
            search = self.searches[key] = Search(start=1, propose=partial(next_candidate, allowed),
                                                 pick=best_candidate, warmup=self.warmup, timed=self.timed_calls)
        was = search.decided
        k, sample = search.call(self.groups, h_BLM.device, training)
        if was is None and search.decided is not None:
            logger.info("moe_plugins: Lancet partitions tune: B=%d L=%d %s -> %d (measured %s)", key[0], key[1],
                        "training" if training else "eval", k,
                        {n: f"{t * 1e3:.2f} ms" for n, t in sorted(search.times_s.items())})
        return k, sample

    def __call__(self, h_BLM: torch.Tensor) -> int:
        return self.timed(h_BLM)[0]

    def decisions(self) -> Dict[Tuple[int, int, bool], Tuple[Optional[int], Dict[int, float]]]:
        """Per key: the decided count (None while tuning) and the agreed times measured."""
        return {key: (s.decided, dict(s.times_s)) for key, s in self.searches.items()}
