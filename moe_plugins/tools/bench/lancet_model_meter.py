"""The exchange meter of Lancet's model-level bench: what one rank's training step spent on all-to-alls.

In a CPU process, "compute" is everything the rank's main thread (the one that runs forward, backward and the
optimizer step) does that is not waiting. So the exposed all-to-all time measured here is the main thread's
time *blocked* in exchanges:

- inside ``torch.distributed.all_to_all_single`` called on the main thread (an inline exchange: stock
  DeepSpeed's, the plugin's at pipeline degree 1 without a lane, the partitions' split-size exchange), and
- inside ``Handle.wait()`` (:class:`moe_plugins.core.ops.Handle`) on the main thread, for an op or closure of
  the plugin's engine: a Lancet exchange landing on the pipeline lane, a PipeMoE exchange stage (its closure runs
  only the exchange and its island's backward on the lane thread).

Everything the main thread does meanwhile (Lancet's queued dW while a backward exchange flies, a partition's
attention while the next partition's combine flies) is not counted; the time it waits for a slower peer is (a
collective ends when every member is in it). ``other_wait_ns``: waits on handles that are not all-to-alls or
closures (none expected in these rows; reported so that it would show).

Also per step: every ``all_to_all_single`` call on any thread (the lane's too), as (start, end) intervals, whose
union is the time an exchange was in a collective call; and the bytes this rank put on the wire to ranks on
other nodes, counted per call from its input and split sizes (each peer's share once: the ledger's convention,
for the stock layers and the plugin's alike). Asynchronous calls (``async_op=True``) count bytes, not time.

The two patches (the function in ``torch.distributed``, the method of ``Handle``) are applied through the core's
Patcher by :meth:`ExchangeMeter.installed` and restored on exit; the meter only records between
:meth:`start` and :meth:`stop`.
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.ops import Handle, now_ns
from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.lancet.overlap import length

EXCHANGE_WAITS = ("all_to_all", "closure")       # Handle.what prefixes counted as waits on exchanges


@dataclass
class StepExchanges:
    """One rank's exchange figures for one step (nanoseconds, bytes)."""

    blocked_ns: int = 0                 # main thread blocked in exchanges (the exposed all-to-all time)
    blocked_calls_ns: int = 0           # ... of which inside inline all_to_all_single calls
    blocked_waits_ns: int = 0           # ... of which inside Handle.wait() on exchange ops and closures
    other_wait_ns: int = 0              # main thread in Handle.wait() on anything else
    calls: int = 0                      # all_to_all_single calls, every thread
    union_ns: int = 0                   # |union of those calls' intervals|
    inter_node_bytes: int = 0           # bytes sent to ranks on other nodes, every call
    intervals: List[Tuple[int, int]] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "intervals"}


class ExchangeMeter:
    """See the module docstring. ``node_of(rank)``: the node of a global rank."""

    def __init__(self, node_of: Callable[[int], int]):
        self.node_of = node_of
        self.rank = dist.get_rank()
        self.main = threading.get_ident()
        self._lock = threading.Lock()
        self._on = False
        self._step = StepExchanges()
        self._ranks: Dict[int, Tuple[int, ...]] = {}

    def start(self) -> None:
        with self._lock:
            self._step, self._on = StepExchanges(), True

    def stop(self) -> StepExchanges:
        with self._lock:
            self._on = False
            step = self._step
        step.union_ns = length(step.intervals)
        step.blocked_ns = step.blocked_calls_ns + step.blocked_waits_ns
        return step

    # -- bytes ------------------------------------------------------------------------------------------------

    def _members(self, group: Any) -> Tuple[int, ...]:
        key = id(group)
        if key not in self._ranks:
            world = group is None or group is dist.GroupMember.WORLD
            self._ranks[key] = tuple(range(dist.get_world_size()) if world else dist.get_process_group_ranks(group))
        return self._ranks[key]

    def remote_bytes(self, x: torch.Tensor, send: Optional[List[int]], group: Any) -> int:
        """Bytes of ``x`` (split by rows ``send``, evenly when None) that go to members on other nodes."""
        members = self._members(group)
        if not x.numel():
            return 0
        row = x.numel() // x.shape[0] * x.element_size() if x.dim() else x.element_size()
        rows = list(send) if send else [x.shape[0] // len(members)] * len(members)
        mine = self.node_of(self.rank)
        return sum(n * row for n, r in zip(rows, members) if self.node_of(r) != mine)

    # -- the patches --------------------------------------------------------------------------------------------

    def _all_to_all_single(self, original: Callable) -> Callable:
        signature = inspect.signature(original)
        meter = self

        def all_to_all_single(*args, **kwargs):
            if not meter._on:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            sent = meter.remote_bytes(bound["input"], bound.get("input_split_sizes"), bound.get("group"))
            start = now_ns()
            try:
                return original(*args, **kwargs)
            finally:
                end = now_ns()
                with meter._lock:
                    step = meter._step
                    step.calls += 1
                    step.inter_node_bytes += sent
                    if not bound.get("async_op"):
                        step.intervals.append((start, end))
                        if threading.get_ident() == meter.main:
                            step.blocked_calls_ns += end - start

        all_to_all_single.__wrapped__ = original
        return all_to_all_single

    def _wait(self, original: Callable) -> Callable:
        meter = self

        def wait(handle, *args, **kwargs):
            if not meter._on or threading.get_ident() != meter.main:
                return original(handle, *args, **kwargs)
            start = now_ns()
            try:
                return original(handle, *args, **kwargs)
            finally:
                spent = now_ns() - start
                with meter._lock:
                    if str(handle.what).startswith(EXCHANGE_WAITS):
                        meter._step.blocked_waits_ns += spent
                    else:
                        meter._step.other_wait_ns += spent

        wait.__wrapped__ = original
        return wait

    @contextmanager
    def installed(self) -> Iterator["ExchangeMeter"]:
        """Patch ``torch.distributed.all_to_all_single`` and ``Handle.wait`` for as long as the block runs."""
        patches = [Patch(dist, "all_to_all_single", self._all_to_all_single(dist.all_to_all_single)),
                   Patch(Handle, "wait", self._wait(Handle.wait))]
        with Patcher(patches):
            yield self
