"""A Hecate layer's state across calls (:class:`State`) and what one call did (:class:`HecateStats`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from moe_plugins.hecate.early import EarlyGather, OverlapMeter
from moe_plugins.hecate.memory import CopyLedger
from moe_plugins.hecate.plan import LoadWindow, Placement


@dataclass(frozen=True)
class HecateStats:
    """What one call did on this rank: the ``placement``, the global kept routes per expert ``load_E`` and the
    rows this rank computed per expert ``rows_E`` (0 for experts it holds no copy of)."""

    placement: Placement
    load_E: Tuple[int, ...]
    rows_E: Tuple[int, ...]

    def extra_copies(self) -> int:
        """Copies beyond the homes (one per expert)."""
        return sum(len(c) for c in self.placement.copies_E) - len(self.placement.copies_E)


class State:
    """A layer's Hecate state, shared with a twin: the load window, the call in flight, the last call's stats,
    the forward calls so far and the copy-memory ledger (per schedule instance: nothing module-level)."""

    def __init__(self, num_experts: int, layer: str, homes_E: Tuple[int, ...]) -> None:
        self.window = LoadWindow(num_experts=num_experts)
        self.homes = homes_E                        # each expert's owner in the EP group (Algorithm 2 moves them)
        self.call: Optional[Any] = None             # the call in flight (the schedule's _Call)
        self.last: Optional[HecateStats] = None
        self.calls = 0
        self.memory = CopyLedger(layer)
        self.early: Optional[EarlyGather] = None    # prefetch: the gather issued for the next call
        self.meter = OverlapMeter()                 # prefetch: this rank's hiding time and bandwidth
        self.overlap: Optional[int] = None          # prefetch: the agreed overlap degree t (None: not yet)
        self.expert_bytes = 1                       # prefetch: one expert's bytes (set when a gather is issued)
        self.planned = 0                            # prefetch: the t the last early gather was planned with
        self.chain: Optional[Any] = None            # rematerialize: the model's RegatherChain (None: this layer alone)
        self.regathers: Counter = Counter()         # rematerialize: re-gathers by what started them
