"""Exposed all-to-all time of a timed bench step: the all-to-all time in which the rank computed nothing (#26).

Per rank and timed step:

- **all-to-all**: the union of the step's ``all_to_all`` intervals, each from its issue to its end. The project's
  layers read them off their ledger (``CommRecord.issue_ns`` / ``end_ns``, the engine's clock); the stock layers
  off the counter's timed ``torch.distributed.all_to_all_single`` calls (:class:`.traffic.CollectiveCounter`).
  From the issue, not the lane thread's start: from its issue the caller's thread is free, which is the time
  Lancet fills with weight gradients; on a loaded CPU the lane thread may begin the collective later.
- **compute**: the union of the spans the row recorded on its compute thread: the experts' forward and backward
  (:class:`TimedExperts`: timed around the call, and autograd markers around its backward) and Lancet's deferred
  dW (the queue's timeline, ``WgradSpan``).
- **exposed** = |all-to-all| - |all-to-all ∩ compute|; overlap = |all-to-all ∩ compute| / |all-to-all| (the pure
  functions of :mod:`moe_plugins.lancet.overlap`).

How a row is measured (``Row.exposure``): ``spans`` (the rows the bench builds on the core layer: expert spans,
plus dW for Lancet), ``inline`` (collectives that block the thread that computes: the stock layers and the
DeepSpeed adapter at pipeline degree 1; nothing can overlap, exposed = all-to-all), ``unmeasured`` (the adapter
at another degree: its experts are not timed, so the figure would be an upper bound; none is reported).

What is not counted as compute: the gate, the dispatch and combine layout work, the loss. They do not run while an
all-to-all of the same layer flies in any row here.

Shapes: E_l local experts, N rows per expert, M model dim, S tokens.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from moe_plugins.core.executor import Executor
from moe_plugins.core.ops import now_ns
from moe_plugins.core.schedule import Dispatched, LayerParams, Schedule
from moe_plugins.lancet.overlap import covered, exchange_intervals, length

Interval = Tuple[int, int]
SPANS, INLINE, UNMEASURED = "spans", "inline", "unmeasured"
EXPOSURE_MODES = (SPANS, INLINE, UNMEASURED)


class SpanLog:
    """Compute spans of one row on this rank: ``(start_ns, end_ns, kind)``, taken (and cleared) per step."""

    def __init__(self) -> None:
        self.spans: List[Tuple[int, int, str]] = []

    def add(self, start_ns: int, end_ns: int, kind: str) -> None:
        self.spans.append((int(start_ns), int(end_ns), kind))

    def take(self) -> List[Tuple[int, int, str]]:
        out, self.spans = self.spans, []
        return out


class _BackwardEnds(torch.autograd.Function):
    """Identity on the experts' input; its backward runs once the experts' input gradient is computed: the end of
    their backward, logged with the start that :class:`_BackwardStarts` put in ``box``."""

    @staticmethod
    def forward(ctx, x, box, log):
        ctx.box, ctx.log = box, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.box:
            ctx.log.add(ctx.box.pop(), now_ns(), "experts bwd")
        return g, None, None


class _BackwardStarts(torch.autograd.Function):
    """Identity on the experts' output; its backward runs when their output gradient arrives."""

    @staticmethod
    def forward(ctx, y, box):
        ctx.box = box
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        ctx.box.append(now_ns())
        return g, None


def timed_experts(experts: Callable[[torch.Tensor], torch.Tensor], log: SpanLog, x_ElNM: torch.Tensor) -> torch.Tensor:
    """``experts(x_ElNM)``, its forward span logged, and its backward's span too (autograd markers; identity)."""
    track = torch.is_grad_enabled() and x_ElNM.requires_grad
    box: List[int] = []
    if track:
        x_ElNM = _BackwardEnds.apply(x_ElNM, box, log)
    start = now_ns()
    y = experts(x_ElNM)
    log.add(start, now_ns(), "experts fwd")
    return _BackwardStarts.apply(y, box) if track and y.requires_grad else y


class TimedExperts(Executor):
    """Runs ``inner`` with ``LayerParams.experts`` timed into ``log`` (:func:`timed_experts`); the same
    degree and engine as ``inner``. Wrapped inside Lancet's ``DeferredExperts`` it times the deferred experts.

    With ESP > 1 (``esp``, the layer's group) Parm's schedules call the experts' partial sums instead, which they
    derive from the core's untouched ``experts`` callable (``parm.schedules.expert_partials``): that derivation is
    made here and handed over, timed, as ``LayerParams.partial_experts``; where there is none (Lancet's deferred
    experts), nothing is handed over and a Parm schedule would refuse, as without the timing."""

    def __init__(self, inner: Executor, log: SpanLog, esp: Any = None):
        if not isinstance(inner, Executor):
            raise ValueError(f"inner ({type(inner).__name__}) must be an Executor")
        if not isinstance(log, SpanLog):
            raise ValueError(f"log ({type(log).__name__}) must be a SpanLog")
        self.inner, self.log, self.esp, self.degree = inner, log, esp, inner.degree

    @property
    def engine(self) -> Any:
        return getattr(self.inner, "engine", None)

    def _partials(self, params: LayerParams) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        if params.partial_experts is not None or self.esp is None or self.esp.size == 1:
            return params.partial_experts
        from moe_plugins.parm.schedules import expert_partials       # tools may import the papers
        try:
            return expert_partials(params, self.esp)
        except ValueError:          # experts that are not the core's (Lancet's deferred ones): none to hand over
            return None

    def run(self, schedule: Schedule, x_SM: torch.Tensor, params: LayerParams) -> Tuple[torch.Tensor, Dispatched]:
        partials = self._partials(params)
        return self.inner.run(schedule, x_SM, replace(
            params, experts=partial(timed_experts, params.experts, self.log),
            partial_experts=None if partials is None else partial(timed_experts, partials, self.log)))

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"TimedExperts({self.inner!r})"


def queue_spans(queue: Any) -> List[Tuple[int, int, str]]:
    """A Lancet ``WgradQueue(record_timeline=True)``'s dW spans, as compute spans (kind ``dW <tag>``), taken."""
    spans = [(s.start_ns, s.end_ns, f"dW {s.tag}") for s in queue.timeline]
    queue.timeline.clear()
    return spans


# ---- pure measures --------------------------------------------------------------------------------------------

def a2a_of_records(records: Sequence[Any], since: str = "issue") -> List[Interval]:
    """The all-to-all intervals of engine records (``CommRecord``), both phases, from ``since`` to their end."""
    return [iv for phase in ("forward", "backward") for iv in exchange_intervals(records, phase=phase, since=since)]


def exposure_of(a2a: Sequence[Interval], compute: Sequence[Sequence[int]]) -> Dict[str, int]:
    """Pure: ``{"a2a_ns", "overlapped_ns", "exposed_ns"}`` of one step on one rank."""
    whole = length(a2a)
    hidden = covered(a2a, [(s[0], s[1]) for s in compute])
    return {"a2a_ns": whole, "overlapped_ns": hidden, "exposed_ns": whole - hidden}


def meter_a2a(meter: Any) -> Optional[List[Interval]]:
    """The all-to-all intervals a row's traffic meter saw in its last step (ledger records, or the counter's
    timed calls); None when the meter keeps none."""
    ledger = getattr(meter, "ledger", None)
    if ledger is not None:
        return a2a_of_records(ledger.records)
    intervals = getattr(meter, "a2a_intervals", None)
    return None if intervals is None else [tuple(iv) for iv in intervals]


def begin_exposure(row: Any) -> None:
    """Drop the compute spans a row recorded before the step about to be timed (warm-up, the traffic round)."""
    if row.compute_spans is not None:
        row.compute_spans()


def step_exposure(row: Any) -> Optional[Dict[str, int]]:
    """This rank's exposure in the step the row just ran with its meter on (None: not measurable); takes the
    row's compute spans either way, so the next step starts empty."""
    spans = row.compute_spans() if row.compute_spans is not None else []
    if row.exposure == UNMEASURED:
        return None
    a2a = meter_a2a(row.meter)
    if a2a is None:
        return None
    return exposure_of(a2a, spans if row.exposure == SPANS else [])


def exposure_stats(per_rank: Optional[Sequence[Sequence[Optional[Dict[str, int]]]]]) -> Dict[str, Optional[float]]:
    """Pure: ``per_rank[rank][round]`` -> per round the mean over ranks, then the median over rounds, in ms:
    ``a2a_ms``, ``exposed_ms``; ``a2a_overlap`` = median over rounds of overlapped / a2a (summed over ranks).
    All None when a round of a rank was not measured."""
    none = {"a2a_ms": None, "exposed_ms": None, "a2a_overlap": None}
    if not per_rank or any(not rounds or any(r is None for r in rounds) for rounds in per_rank):
        return none
    rounds = len(per_rank[0])
    if any(len(r) != rounds for r in per_rank):
        raise ValueError(f"exposure rounds per rank ({[len(r) for r in per_rank]}) must be equal")
    mean = lambda key, i: sum(r[i][key] for r in per_rank) / len(per_rank) / 1e6
    a2a = [mean("a2a_ns", i) for i in range(rounds)]
    exposed = [mean("exposed_ns", i) for i in range(rounds)]
    overlap = [mean("overlapped_ns", i) / a for i, a in enumerate(a2a) if a > 0]
    return {"a2a_ms": statistics.median(a2a), "exposed_ms": statistics.median(exposed),
            "a2a_overlap": statistics.median(overlap) if overlap else 0.0}
