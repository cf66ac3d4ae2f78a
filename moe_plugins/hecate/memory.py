"""Hecate's copy-memory ledger: how many bytes of materialised expert copies are alive on this rank, and when.

Each Hecate layer (one :class:`~moe_plugins.hecate.schedule.HecateSchedule`, shared with its twin) owns one
:class:`CopyLedger`, reachable as ``schedule.memory``. It records every copy tensor spAG materialises on this
rank, ``w_copies_CF`` (C experts x F elements: the rank's own experts included, as the layer computes them from
the copy), as a :class:`CopyRecord`: the layer, the forward call it serves, the phase that gathered it
(``"forward"``: spAG before the experts; ``"backward"``: the re-gather of re-materialisation), its bytes and two
``time.perf_counter_ns()`` stamps, materialised and freed. The free stamp is set when the tensor is really
released (a ``weakref.finalize`` on it: autograd's saved tensors keep it alive as long as they hold it), so the
ledger measures what the process keeps, not what the schedule intends.

A rank's copy memory over several layers is the merge of their ledgers (pure functions over the records, no
shared object): :func:`live_peak` (the most bytes alive at once in a window), :func:`step_peaks` (per step,
between stamps the caller takes, e.g. before each training step) and :func:`call_rows` (per layer call: the
bytes it materialised and the rank's copy bytes alive right after). At equal stamps a materialisation counts
before a release (the peak is never under-stated).

Each ledger keeps its last ``keep`` records (older ones drop out; the running totals and this layer's own peak
cover the whole run), so a long run holds a bounded ledger.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

KEEP = 512                       # records each ledger keeps
PHASES = ("forward", "backward")


@dataclass
class CopyRecord:
    """One materialised copy tensor: ``free_ns`` is None while it is alive."""

    layer: str
    phase: str
    call: int
    bytes: int
    alloc_ns: int
    free_ns: Optional[int] = None


class CopyLedger:
    """One layer's copy tensors on this rank (module docstring). ``live_bytes`` and ``peak_bytes``: this
    layer's copies alive now and at most; ``totals[phase]``: (tensors, bytes) materialised over the run."""

    def __init__(self, layer: str, keep: int = KEEP) -> None:
        if not (isinstance(keep, int) and keep >= 1):
            raise ValueError(f"keep ({keep!r}) must be an integer >= 1 (records kept)")
        self.layer = layer
        self.records: Deque[CopyRecord] = deque(maxlen=keep)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.totals: Dict[str, Tuple[int, int]] = {phase: (0, 0) for phase in PHASES}
        self._lock = threading.Lock()

    def track(self, w_CF: torch.Tensor, phase: str, call: int) -> CopyRecord:
        """Record ``w_CF`` (a copy tensor just materialised for forward call ``call``) until it is freed: its
        storage's bytes, until the tensor it views (its base, where autograd returned a view) is released."""
        if phase not in PHASES:
            raise ValueError(f"phase ({phase!r}) must be one of {PHASES}")
        root = w_CF if w_CF._base is None else w_CF._base     # views of the copies keep the base, not the view
        record = CopyRecord(self.layer, phase, call, w_CF.untyped_storage().nbytes(), time.perf_counter_ns())
        with self._lock:
            self.records.append(record)
            self.live_bytes += record.bytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            count, total = self.totals[phase]
            self.totals[phase] = (count + 1, total + record.bytes)
        weakref.finalize(root, self._freed, record)
        return record

    def _freed(self, record: CopyRecord) -> None:
        record.free_ns = time.perf_counter_ns()
        with self._lock:
            self.live_bytes -= record.bytes

    def summary(self) -> Dict[str, int]:
        """Plain numbers for reports: live and peak bytes of this layer, tensors and bytes per phase."""
        out = {"live_bytes": self.live_bytes, "peak_bytes": self.peak_bytes}
        for phase, (count, total) in self.totals.items():
            out[f"{phase}_copies"], out[f"{phase}_bytes"] = count, total
        return out


def _records(ledgers: Iterable[CopyLedger]) -> List[CopyRecord]:
    unique = {id(ledger): ledger for ledger in ledgers}
    return [r for ledger in unique.values() for r in list(ledger.records)]


def live_peak(ledgers: Iterable[CopyLedger], start_ns: Optional[int] = None, end_ns: Optional[int] = None) -> int:
    """The most copy bytes alive at once over ``ledgers`` (this rank's layers) between ``start_ns`` and
    ``end_ns`` (None: unbounded); copies alive at ``start_ns`` count from there."""
    lo = -1 if start_ns is None else start_ns
    hi = None if end_ns is None else end_ns
    events = []
    for r in _records(ledgers):
        if (hi is not None and r.alloc_ns > hi) or (r.free_ns is not None and r.free_ns <= lo):
            continue
        events.append((max(r.alloc_ns, lo), 0, r.bytes))             # 0: a materialisation sorts first at a tie
        if r.free_ns is not None and (hi is None or r.free_ns <= hi):
            events.append((r.free_ns, 1, -r.bytes))
    live = peak = 0
    for _, _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def step_peaks(ledgers: Sequence[CopyLedger], bounds_ns: Sequence[int]) -> List[int]:
    """:func:`live_peak` in each window [bounds_ns[i], bounds_ns[i + 1]] (the caller's stamps around steps)."""
    if list(bounds_ns) != sorted(bounds_ns) or len(bounds_ns) < 2:
        raise ValueError(f"bounds_ns ({list(bounds_ns)}) must be at least two increasing stamps")
    return [live_peak(ledgers, a, b) for a, b in zip(bounds_ns, bounds_ns[1:])]


def call_rows(ledgers: Sequence[CopyLedger]) -> List[Dict[str, int]]:
    """Per materialised copy (per layer call and phase), in time order: its layer, call, phase, bytes, and the
    rank's copy bytes alive right after it (over ``ledgers``)."""
    records = sorted(_records(ledgers), key=lambda r: r.alloc_ns)
    rows = []
    for r in records:
        alive = sum(o.bytes for o in records if o.alloc_ns <= r.alloc_ns and (o.free_ns is None or
                                                                            o.free_ns >= r.alloc_ns))
        rows.append({"layer": r.layer, "call": r.call, "phase": r.phase, "bytes": r.bytes, "live_after": alive})
    return rows
