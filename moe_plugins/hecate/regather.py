"""When re-materialisation's re-gather runs (``"hecate": {"rematerialize": true}``; hecate.txt §5.4: the copies
are gathered again ahead of the layer's backward, overlapped with the backward of the work after the layer).

A layer call's :class:`~moe_plugins.hecate.remat.Rematerialiser` gathers its copies again in backward one of two
ways:

- **Early, on the engine's pipeline lane** (its twin EP group, beside the main thread), issued as soon as it can
  start without holding two layers' copies at once:

  - when the *next* Hecate layer of the model (in forward order: :class:`RegatherChain`, shared by the model's
    layers) has its copies' gradient, i.e. its expert GEMMs' backward is done and its copies are released.
    What that layer's backward still runs (its dispatch-gradient exchange, spRS, the gate and the attention
    before it) and this layer's combine-gradient exchange then hide the gather;
  - else (the model's last Hecate layer, or a layer in no chain) when the gradient reaches the layer's own
    output: its combine-gradient exchange hides it.

  The owned experts are read (and their in-place versions checked) on the main thread when it is issued; the lane
  runs spAG and records the copy tensor in the layer's copy ledger when it materialises.
- **At need**, inline, when the first saved view of the copies is unpacked: without a pipeline lane, or at EP 1.

Every member issues it at the same point of the same backward (the hooks fire in the graph's order), so the lane's
collectives stay in step. Nothing here is module-level: the chain is an object the host adapter (or the user,
:func:`link`) hands to each layer.
"""

from __future__ import annotations

import weakref
from collections import Counter
from functools import partial
from typing import Any, Callable, Iterable, Optional

import torch

from moe_plugins.core.ops import PIPELINE, Handle
from moe_plugins.hecate.flow import flat_experts
from moe_plugins.hecate.plan import Placement
from moe_plugins.hecate.remat import OwnedRead, Rematerialiser
from moe_plugins.hecate.sparse import ShardSpec, spag_again


class RegatherChain:
    """The Hecate layer calls of one model in forward order, as far as re-gathers need them: each call learns the
    one before it (held weakly: a graph freed without backward frees its calls)."""

    def __init__(self) -> None:
        self._last: Optional["weakref.ReferenceType[Rematerialiser]"] = None

    def push(self, remat: Rematerialiser) -> Optional["weakref.ReferenceType[Rematerialiser]"]:
        """Append ``remat`` (a training forward's call); returns the call before it (weakly), or None."""
        previous, self._last = self._last, weakref.ref(remat)
        return previous


def link(schedules: Iterable[Any], chain: Optional[RegatherChain] = None) -> RegatherChain:
    """Give every rematerialising Hecate schedule of ``schedules`` (one model's layers) one shared chain, so
    that each layer's re-gather starts when the next layer's copies are released; returns the chain."""
    chain = RegatherChain() if chain is None else chain
    for schedule in schedules:
        if getattr(getattr(schedule, "options", None), "rematerialize", False) and hasattr(schedule, "join_chain"):
            schedule.join_chain(chain)
    return chain


def rematerialiser(w_CF: torch.Tensor, owned: OwnedRead, placement: Placement, shards: ShardSpec, group: Any,
                   rec: Any, on_gather: Callable[[torch.Tensor], Any], chain: Optional[RegatherChain],
                   counts: Counter, early: bool = True) -> Rematerialiser:
    """The call's Rematerialiser for copies ``w_CF`` (just materialised by spAG over EP ``group``): inline
    re-gather at need, an early one on the pipeline lane where the engine has one, and, in a training forward,
    hooked into ``chain``: the previous call's re-gather starts when ``w_CF``'s gradient is complete. ``counts``
    (the layer's) counts the re-gathers by what started them: ``next_layer``, ``own_output`` or ``at_need``.
    ``early`` False (``"regather": "at_need"``): only at need."""
    inline = partial(_regather, owned, placement, shards, group, rec, counts)
    issue = None
    if early and group.size > 1 and rec.engine.has_lane(PIPELINE):
        twin = rec.engine.lane_groups(PIPELINE).by_kind()[group.kind]
        issue = partial(_issue, owned, placement, shards, twin, rec, on_gather)
    remat = Rematerialiser(w_CF, inline, on_gather, early=issue, counts=counts)
    if chain is not None and issue is not None and w_CF.requires_grad:
        previous = chain.push(remat)
        if previous is not None:
            w_CF.register_hook(partial(_start, previous, "next_layer"))
    return remat


def start_at_output(remat: Rematerialiser, y: torch.Tensor) -> None:
    """Start ``remat``'s early re-gather (if nothing started it before) when the gradient reaches ``y``, the
    layer's output."""
    if y.requires_grad:
        y.register_hook(partial(_start, weakref.ref(remat), "own_output"))


def _start(ref: "weakref.ReferenceType[Rematerialiser]", why: str, grad: torch.Tensor) -> None:
    remat = ref()
    if remat is not None and remat.start_early():
        remat.counts[why] += 1


def _regather(owned: OwnedRead, placement: Placement, shards: ShardSpec, group: Any, rec: Any,
              counts: Counter) -> torch.Tensor:
    counts["at_need"] += 1
    with torch.no_grad():
        return spag_again(flat_experts(owned.read()), placement, shards, group, rec)


def _issue(owned: OwnedRead, placement: Placement, shards: ShardSpec, twin: Any, rec: Any,
           on_gather: Callable[[torch.Tensor], Any]) -> Handle:
    with torch.no_grad():
        w_owned_O = flat_experts(owned.read())           # read and checked here, on the main thread
    return rec.engine.submit(_on_lane, w_owned_O, placement, shards, twin, rec, on_gather, lane=PIPELINE)


def _on_lane(w_owned_O: torch.Tensor, placement: Placement, shards: ShardSpec, twin: Any, rec: Any,
             on_gather: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    w_CF = spag_again(w_owned_O, placement, shards, twin, rec)
    on_gather(w_CF)
    return w_CF
