"""Lancet's overlap of queued weight-gradient work with a layer's backward exchanges, and how much overlapped.

:class:`ExchangeOverlap` is what a layer's :class:`~moe_plugins.core.comm.Recorder` carries as
``while_in_flight``: the core's all-to-all backward issues the exchange on the engine's pipeline lane, calls it
with the exchange's handle, then waits. It runs every queued item, in queue order:

- at the combine-gradient exchange (a layer's first backward exchange) the queue holds the dW that the layers
  after this one queued (their pipelined chunks, the dense Linears ``dense_wgrad`` wraps);
- at the dispatch-gradient exchange (the last) it holds this layer's own expert dW, queued by the expert
  backward that ran just before.

Why every item and not ``run_while(handle)``: what runs must not depend on timing. A delivered gradient fires
the host's hooks (ZeRO-2's bucket, Megatron's DDP buckets, Lina's micro-ops), and every rank must fire them in the
same order. The queue's contents are the same on every rank; how long an exchange flies is not.

Calls from another thread than the one that queued the work (the exchanges PipeMoE's runner runs on its lane
thread) do nothing: the queue is run by the backward thread only.

Measures (pure, on (start_ns, end_ns) intervals): :func:`overlap_fraction` = |exchanges ∩ dW| / |exchanges|;
:func:`hidden_fraction` = |exchanges ∩ dW| / |dW|.
"""

from __future__ import annotations

import threading
from typing import Iterable, List, Optional, Sequence, Tuple

from moe_plugins.lancet.wgrad_queue import WgradQueue

Interval = Tuple[int, int]


class ExchangeOverlap:
    """A Recorder's ``while_in_flight`` (see the module docstring): runs ``queue``'s items while an exchange flies."""

    def __init__(self, queue: WgradQueue):
        if not isinstance(queue, WgradQueue):
            raise ValueError(f"queue ({type(queue).__name__}) must be a moe_plugins.lancet.WgradQueue")
        self.queue = queue
        self.calls = 0                      # exchanges it ran items during (for tests and logs)

    def __call__(self, handle) -> None:
        queue = self.queue
        if queue.pending == 0 or queue.thread != threading.get_ident():
            return
        queue.run_all(during=getattr(handle, "what", "exchange"))
        self.calls += 1

    def __repr__(self) -> str:
        return f"ExchangeOverlap(pending={self.queue.pending}, calls={self.calls})"


def _checked(intervals: Iterable[Sequence[int]]) -> List[Interval]:
    out = []
    for interval in intervals:
        start, end = int(interval[0]), int(interval[1])
        if end < start:
            raise ValueError(f"interval {(start, end)} ends before it starts")
        out.append((start, end))
    return out


def merged(intervals: Iterable[Sequence[int]]) -> List[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: List[List[int]] = []
    for start, end in sorted(_checked(intervals)):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[Sequence[int]]) -> int:
    return sum(b - a for a, b in merged(intervals))


def covered(a: Iterable[Sequence[int]], b: Iterable[Sequence[int]]) -> int:
    """|union(a) ∩ union(b)|."""
    total, bs = 0, merged(b)
    for start, end in merged(a):
        total += sum(max(0, min(end, e) - max(start, s)) for s, e in bs)
    return total


def overlap_fraction(exchanges: Iterable[Sequence[int]], compute: Iterable[Sequence[int]]) -> float:
    """|exchanges ∩ compute| / |exchanges|: the share of the exchange time that dW compute ran in (0 when none)."""
    exchanges, compute = _checked(exchanges), _checked(compute)
    whole = length(exchanges)
    return covered(exchanges, compute) / whole if whole else 0.0


def hidden_fraction(exchanges: Iterable[Sequence[int]], compute: Iterable[Sequence[int]]) -> float:
    """|exchanges ∩ compute| / |compute|: the share of the dW compute hidden behind exchanges (0 when none)."""
    exchanges, compute = _checked(exchanges), _checked(compute)
    whole = length(compute)
    return covered(exchanges, compute) / whole if whole else 0.0


def exchange_intervals(timeline: Optional[Iterable], layer: Optional[str] = None, phase: str = "backward",
                       op: str = "all_to_all", since: str = "start") -> List[Interval]:
    """The intervals of an engine timeline's records (``CommRecord``) of ``op`` in ``phase`` (and ``layer``, when
    given), to their ``end_ns``, from ``start_ns`` (the lane thread began the collective) or, with ``since="issue"``,
    from ``issue_ns`` (the caller queued it on the lane, tens of microseconds earlier on CPU)."""
    if since not in ("start", "issue"):
        raise ValueError(f"since ({since!r}) must be 'start' or 'issue'")
    return [(r.start_ns if since == "start" else r.issue_ns, r.end_ns) for r in (timeline or [])
            if r.op == op and r.phase == phase and (layer is None or r.layer == layer)]
