"""Hecate's early gather (``"prefetch": true``): the spAG planned before the layer's gate and run while the work
before the layer does (hecate.txt §4.2: the plan is made before the gate, from the averaged load of earlier
iterations, and the gather hides under the non-MoE computation before the layer).

- **Plan.** From the load window of the *previous* calls (this call's load is not known before its gate; the
  first call, with an empty window, copies nothing beyond the homes) and the agreed overlap degree t.
- **Issue.** :func:`issue_early` cuts this rank's send pieces from its owned experts (detached: the values the
  layer reads in the same forward; nothing updates parameters between) and submits one timed uneven all-to-all
  to the engine's pipeline lane, on the lane's twin EP group (the layer's own groups stay free for the gate's
  collectives). The caller is the block's forward pre-hook (the DeepSpeed adapter), a user's ``layer.prefetch()``,
  or the layer itself at the start of its call (then only the gate hides it).
- **Measure.** :meth:`EarlyGather.received` waits for it and measures the time it had to hide in (issue to the
  layer's wait) and, from the exchange's own duration, the bandwidth it saw. :class:`OverlapMeter` keeps the last
  figures (a bandwidth once seen is kept, so that a plan with no copies does not lose it).
- **Overlap degree.** Each rank's t_r = floor(T_hide * bw / expert_bytes) (:func:`~.plan.overlap_degree`) rides
  on the counts all-gather as one more integer (-1: not measured yet); :func:`agreed_overlap` takes the minimum
  of the known ones, so every rank plans the same t; none known: t = E (every hot expert worth copying).

Letters: E experts, X elements this rank sends, Q elements it receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import Group
from moe_plugins.core.ops import PIPELINE, CommError, Handle, now_ns
from moe_plugins.hecate.plan import Placement, overlap_degree
from moe_plugins.hecate.sparse import SPAG, SparseExchange, issue_exchange, send_buffer

UNKNOWN = -1      # a rank's overlap degree before it has measured one


@dataclass
class EarlyGather:
    """One issued early spAG: its ``placement`` and ``exchange``, the lane's ``handle`` (-> (received Q, the
    exchange's ns)), when it was issued, this rank's bytes on the wire, and whether it ran ``hidden`` (on the
    pipeline lane, beside the caller; else it ran inline when issued, and measures nothing)."""

    placement: Placement
    exchange: SparseExchange
    handle: Optional[Handle]          # None: it ran when issued (``ready``)
    issued_ns: int
    wire_bytes: int
    hidden: bool = True
    ready: Optional[Tuple[torch.Tensor, int]] = None     # run when issued (inline, or nothing to exchange)

    def received(self, rec: Recorder) -> Tuple[torch.Tensor, int, int]:
        """(received buffer Q, ns it had to hide in, the exchange's ns); raises the exchange's error, naming the
        layer."""
        waited_ns = now_ns()
        if self.ready is not None:
            return self.ready[0], waited_ns - self.issued_ns, self.ready[1]
        try:
            recv_Q, took_ns = self.handle.wait()
        except CommError as exc:
            raise rec.failed(exc) from exc
        return recv_Q, waited_ns - self.issued_ns, took_ns

    def drain(self) -> None:
        """Wait for it without using it (a call that failed after issuing it): the lane stays in step."""
        if self.handle is not None:
            try:
                self.handle.wait()
            except CommError:        # the engine is poisoned: the next op raises it with its first error
                pass


def _timed_exchange(send_X: torch.Tensor, ex: SparseExchange, group: Group, rec: Recorder) -> Tuple[torch.Tensor, int]:
    start = now_ns()
    recv_Q = issue_exchange(send_X, ex.send, ex.recv, group, rec, SPAG, "forward").wait()
    return recv_Q, now_ns() - start


def issue_early(w_owned_O: torch.Tensor, placement: Placement, ex: SparseExchange, group: Group,
                rec: Recorder) -> EarlyGather:
    """Submit this rank's part of the spAG of ``placement`` (``ex``) to the pipeline lane of ``rec``'s engine
    (``group``: the layer's EP group; the lane runs it on its twin). Collective in program order: every member
    issues it at the same point."""
    with torch.no_grad():
        send_X = send_buffer(w_owned_O, ex)
    wire = max(sum(ex.send), sum(ex.recv)) * w_owned_O.element_size()
    if group.size == 1:
        return EarlyGather(placement, ex, None, now_ns(), 0, hidden=False, ready=(w_owned_O.new_empty(0), 0))
    if not rec.engine.has_lane(PIPELINE):    # no lane to run it beside the caller: run it now, inline
        ready = _timed_exchange(send_X, ex, group, rec)
        return EarlyGather(placement, ex, None, now_ns(), wire, hidden=False, ready=ready)
    twin = rec.engine.lane_groups(PIPELINE).by_kind()[group.kind]
    handle = rec.engine.submit(_timed_exchange, send_X, ex, twin, rec, lane=PIPELINE)
    return EarlyGather(placement, ex, handle, now_ns(), wire)


@dataclass
class OverlapMeter:
    """This rank's last measured hiding time and bandwidth (bytes/s; kept once seen) -> its overlap degree."""

    hide_s: Optional[float] = None
    bandwidth: Optional[float] = None
    history: list = field(default_factory=list)      # (hide_s, bandwidth) after each measured call, the last 64

    def measure(self, hide_ns: int, took_ns: int, wire_bytes: int) -> None:
        self.hide_s = max(hide_ns, 0) / 1e9
        if wire_bytes > 0 and took_ns > 0:
            self.bandwidth = wire_bytes / (took_ns / 1e9)
        self.history = (self.history + [(self.hide_s, self.bandwidth)])[-64:]

    def degree(self, expert_bytes: int) -> int:
        """t_r from the last figures, or :data:`UNKNOWN` before a bandwidth was seen (a query: changes nothing)."""
        if self.hide_s is None or self.bandwidth is None:
            return UNKNOWN
        return overlap_degree(self.hide_s, self.bandwidth, expert_bytes)


def agreed_overlap(degrees_R: Sequence[int], num_experts: int) -> int:
    """The t every rank plans with: the smallest measured t_r (the rank with the least time to hide the gather
    in), capped at E; E when no rank has measured one."""
    known = [t for t in degrees_R if t != UNKNOWN]
    if any(t < UNKNOWN for t in degrees_R):
        raise ValueError(f"degrees_R ({list(degrees_R)}) must be integers >= 0, or {UNKNOWN} (not measured)")
    return min(min(known), num_experts) if known else num_experts


def enclosing_blocks(model: torch.nn.Module, layers: Sequence[torch.nn.Module]) -> List[Optional[torch.nn.Module]]:
    """Per layer of ``model``, the block whose forward pre-hook issues its early gather: its nearest ancestor held
    in a ``torch.nn.ModuleList`` (the model's list of transformer blocks), or None (no such ancestor: the layer
    issues the gather at its own call)."""
    held = {child for parent in model.modules() if isinstance(parent, torch.nn.ModuleList)
            for child in parent.children()}
    parent_of = {child: parent for parent in model.modules() for child in parent.children()}
    out = []
    for layer in layers:
        block = layer
        while block is not None and block not in held:
            block = parent_of.get(block)
        out.append(block)
    return out
