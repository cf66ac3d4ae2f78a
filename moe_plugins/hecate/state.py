"""A Hecate layer's state across calls (:class:`State`) and what one call did (:class:`HecateStats`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from moe_plugins.core.experts import ExpertWeights
from moe_plugins.core.ragged import agreed_load
from moe_plugins.core.schedule import RowLoad
from moe_plugins.hecate.early import EarlyGather, OverlapMeter
from moe_plugins.hecate.flow import PiecePlan, route_plan
from moe_plugins.hecate.memory import CopyLedger
from moe_plugins.hecate.plan import LoadWindow, Placement
from moe_plugins.hecate.remat import Rematerialiser


@dataclass
class Call:
    """One call in flight, shared by the schedule and its twin: the routing, the host-read counts, the placement,
    the pieces' plans and the copies (until the last piece's expert step)."""

    routing: Any
    pos_SK: torch.Tensor                        # each route's row in d (len(d): a dropped route)
    counts_RE: List[List[int]]                  # every member's kept routes per expert (the host read)
    placement: Placement
    at_R: torch.Tensor                          # each (expert, slot) row's position in d (the call's send order)
    pieces: List[PiecePlan]                     # the whole call, or PipeMoE's chunks (Schedule.chunks)
    copies: Optional[ExpertWeights]             # dropped after the last piece's expert step
    remat: Optional[Rematerialiser] = None      # with rematerialize: how the backward gathers them again
    at_X: Optional[torch.Tensor] = None         # chunks: the pieces' rows' positions in d, piece after piece
    taken: Dict[str, int] = field(default_factory=lambda: {"exchange_in": 0, "expert": 0, "exchange_out": 0})
    load: Optional[RowLoad] = None              # a degree word's price (row_load), once per call

    def row_load(self, groups, rec) -> RowLoad:
        """The whole call's rows sent and received by this rank (its copies' split), agreed over the layer's
        groups (core.ragged.agreed_load); the slots are the most kept routes any member has for an expert."""
        if self.load is None:
            whole = route_plan(self.counts_RE, groups.ep.rank, self.placement)
            slots = max((n for row in self.counts_RE for n in row), default=0)
            self.load = agreed_load(sum(whole.send), sum(whole.recv), slots, groups, rec)
        return self.load


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
        self.call: Optional[Call] = None            # the call in flight
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
