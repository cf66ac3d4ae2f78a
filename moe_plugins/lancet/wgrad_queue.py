"""Lancet's queue of deferred weight-gradient work (docs: the package docstring, :mod:`moe_plugins.lancet`).

A deferred GEMM's backward computes dX at once and hands the queue a :class:`WgradItem`: a closure that computes
its weight (and bias) gradients, with an estimated cost (FLOPs). The queue runs items when asked
(:meth:`WgradQueue.run_some`, greedy best fit into a budget; :meth:`WgradQueue.run_while`, while a
communication handle is in flight; :meth:`WgradQueue.flush`), and flushes whatever is left when the backward
pass that queued it ends (an autograd engine callback, ``queue_callback``).

Delivery goes through autograd, never ``.grad``: the computed gradients of one or more *targets* (a leaf
parameter, or a non-leaf weight built from parameters, e.g. a stack of per-expert weights) are handed to
``torch.autograd.backward`` on the targets (a leaf through an alias ``w.view_as(w)``), a re-entrant backward
that reaches the parameters' own AccumulateGrad nodes, so every hook the hosts register there
(``register_post_accumulate_grad_hook``, a hook on the AccumulateGrad node) fires as in stock autograd.

Exactly once. Stock autograd sums every use of a parameter before its AccumulateGrad runs once. The queue keeps
that: each tracked forward use (:meth:`WgradQueue.track`, a :class:`Use`) counts one outstanding use on every
parameter (leaf) behind its targets; the use is released when its item has run, or when its graph is freed
without a backward (a weakref finalizer on the GEMM's record). Computed gradients wait until every leaf they
reach has no outstanding use and shares no leaf with a gradient still waiting for one; then all those are
delivered in one re-entrant backward. So a weight used in several chunks or calls is delivered once, and
forwards of other micro-batches still awaiting their backward (pipeline parallelism) hold nothing wrongly
back: the end-of-backward flush delivers whatever waits, and their uses stay counted for their own backward.

One thread: the queue is run from the thread that runs backward (``run_while`` polls a handle that another
thread, the engine's lane, completes). Deferred parameters are reached by ``backward()`` only, not by
``torch.autograd.grad(loss, w)`` or ``backward(inputs=...)`` (the outer graph has no edge to them).

Hosts. The flush is an autograd callback queued on the first deferral of a backward, so it runs after
callbacks queued earlier in the same backward. DeepSpeed's ``engine.backward(loss)`` runs its epilogue after
``loss.backward()`` returns, after the flush: nothing needed. With ``loss.backward()`` under ZeRO, DeepSpeed
runs the epilogue from a callback queued when backward starts, before the flush: the host adapter must call
:meth:`WgradQueue.flush` first (tests/workers/lancet_wgrad.py, ``flush_before_epilogue``).

No module-level state: a queue is an object the caller owns and passes to the deferred GEMMs.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Set, Tuple

import torch

# (target, its gradient): what an item's compute returns, for each weight and bias it deferred
Grads = List[Tuple[torch.Tensor, torch.Tensor]]


class Use:
    """One forward use of deferred targets: the ids of the leaves it counts on. Released once."""

    __slots__ = ("leaf_ids", "released")

    def __init__(self, leaf_ids: Tuple[int, ...]):
        self.leaf_ids, self.released = leaf_ids, False


@dataclass(frozen=True, eq=False)
class WgradItem:
    """One deferred piece of weight-gradient work: ``compute()`` returns its (target, gradient) pairs."""

    name: str
    cost: float                       # estimated cost (FLOPs) for best-fit scheduling
    compute: Callable[[], Grads]
    tag: str = ""                     # a group the caller can select by (e.g. "experts.3", "dense")
    seq: int = 0                      # queue order (ties in best fit go to the earliest)
    use: Optional[Use] = None         # the forward use it settles (released when it has run)


@dataclass(frozen=True)
class WgradSpan:
    """When one item's dW compute ran (``time.perf_counter_ns``, the engine's clock) and during what: ``during``
    names the exchange it overlapped (its handle's ``what``), or "" (a flush, ``run_some``)."""

    name: str
    tag: str
    start_ns: int
    end_ns: int
    during: str = ""


def leaves_of(target: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The parameters (leaf tensors that require grad) whose AccumulateGrad nodes ``target`` backpropagates to."""
    if target.grad_fn is None:
        return (target,) if target.requires_grad else ()
    found: Dict[int, torch.Tensor] = {}
    seen: Set[int] = set()
    stack = [target.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):          # an AccumulateGrad node
            found[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return tuple(found.values())


def best_fit(items: Sequence[WgradItem], room: float) -> Optional[WgradItem]:
    """Greedy best fit: the costliest item that fits in ``room`` (the earliest queued among equals), or None."""
    fitting = [item for item in items if item.cost <= room]
    if not fitting:
        return None
    return max(fitting, key=lambda item: (item.cost, -item.seq))


def _in_flight(busy: Any) -> Callable[[], bool]:
    """``busy`` as a predicate that is True while the communication is in flight."""
    done = getattr(busy, "done", None)
    if callable(done):
        return lambda: not done()
    if callable(busy):
        return lambda: bool(busy())
    raise ValueError(f"busy ({type(busy).__name__}) must be a handle with done() (core.ops.Handle) or a "
                     "predicate that returns True while the communication is in flight")


def _current_graph_task() -> int:
    """The id of the autograd graph task running on this thread, -1 outside backward."""
    return int(torch._C._current_graph_task_id())


class WgradQueue:
    """Deferred weight-gradient work of one model (see the module docstring). ``flush_at_end`` (default):
    flush when the backward pass that queued an item ends. ``record_timeline``: every item run is appended to
    :attr:`timeline` as a :class:`WgradSpan`."""

    def __init__(self, *, flush_at_end: bool = True, record_timeline: bool = False):
        self.flush_at_end = flush_at_end
        self.timeline: Optional[List[WgradSpan]] = [] if record_timeline else None
        self.thread: Optional[int] = None                     # the thread that queued the last item (backward's)
        self._during = ""
        self._items: List[WgradItem] = []
        self._seq = 0
        self._uses: Dict[int, int] = {}                       # leaf id -> outstanding forward uses
        self._waiting: List[Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, ...]]] = []
        self._flush_tasks: Set[int] = set()                   # graph tasks with our flush callback queued
        self.items_run = 0                                    # counters, for tests and logs
        self.deliveries = 0                                   # re-entrant backward calls made

    # ---- state ------------------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Items queued and not run yet."""
        return len(self._items)

    @property
    def pending_cost(self) -> float:
        return float(sum(item.cost for item in self._items))

    @property
    def waiting(self) -> int:
        """Computed gradients not delivered yet (their parameters have uses outstanding)."""
        return len(self._waiting)

    def empty(self) -> bool:
        return not self._items and not self._waiting

    def names(self) -> List[str]:
        return [item.name for item in self._items]

    # ---- forward side -----------------------------------------------------------------------------------

    def track(self, targets: Sequence[Optional[torch.Tensor]], owner: Any = None) -> Optional[Use]:
        """A deferred GEMM will use ``targets`` (weights, biases): one outstanding use on each of their leaves,
        settled by the item that names it (``defer(use=...)``) or, if ``owner`` (the GEMM's record, kept by its
        graph) is freed first, then. None where autograd records nothing (grad disabled, nothing needs a grad)."""
        if not torch.is_grad_enabled():
            return None
        ids = {id(leaf) for t in targets if t is not None and t.requires_grad for leaf in leaves_of(t)}
        if not ids:
            return None
        use = Use(tuple(ids))
        for leaf_id in use.leaf_ids:
            self._uses[leaf_id] = self._uses.get(leaf_id, 0) + 1
        if owner is not None:
            weakref.finalize(owner, self.release, use)
        return use

    def release(self, use: Optional[Use]) -> None:
        """Take ``use`` off its leaves' counts (once; later calls do nothing)."""
        if use is None or use.released:
            return
        use.released = True
        for leaf_id in use.leaf_ids:
            left = self._uses.get(leaf_id, 0) - 1
            if left > 0:
                self._uses[leaf_id] = left
            else:
                self._uses.pop(leaf_id, None)

    @property
    def outstanding_uses(self) -> int:
        """Forward uses counted on parameters and not settled yet (summed over the parameters)."""
        return sum(self._uses.values())

    # ---- backward side ----------------------------------------------------------------------------------

    def defer(self, name: str, cost: float, compute: Callable[[], Grads], *, tag: str = "",
              use: Optional[Use] = None) -> WgradItem:
        """Queue ``compute`` (it returns (target, gradient) pairs; ``use``: the forward use it settles). Inside a
        backward pass, the queue's flush is registered to run when that pass ends (``flush_at_end``)."""
        if not callable(compute):
            raise ValueError(f"compute for {name!r} ({type(compute).__name__}) must be callable")
        if not cost >= 0:
            raise ValueError(f"cost of {name!r} ({cost}) must be a number >= 0")
        item = WgradItem(name=name, cost=float(cost), compute=compute, tag=tag, seq=self._seq, use=use)
        self._seq += 1
        self._items.append(item)
        self.thread = threading.get_ident()
        self._register_flush()
        return item

    def run_some(self, budget: float, *, tags: Optional[Collection[str]] = None) -> List[str]:
        """Run the items that fit in ``budget`` (same unit as their cost), greedy best fit: each time the
        costliest item that still fits. ``tags``: only items with one of these tags. Returns their names."""
        if not budget >= 0:
            raise ValueError(f"budget ({budget}) must be a number >= 0")
        run: List[str] = []
        room = float(budget)
        while True:
            item = best_fit(self._selected(tags), room)
            if item is None:
                return run
            self._run(item)
            room -= item.cost
            run.append(item.name)

    def run_while(self, busy: Any, *, budget: Optional[float] = None,
                  tags: Optional[Collection[str]] = None) -> List[str]:
        """Run queued items one by one while ``busy`` (a communication handle with ``done()``, or a predicate)
        reports the communication in flight. With ``budget`` (the exchange's estimated duration in cost
        units), items are picked by greedy best fit into what is left of it; without, in queue order. An item
        that started runs to its end. Returns the names run."""
        in_flight = _in_flight(busy)
        if budget is not None and not budget >= 0:
            raise ValueError(f"budget ({budget}) must be None or a number >= 0")
        run: List[str] = []
        room = float("inf") if budget is None else float(budget)
        while in_flight():
            candidates = self._selected(tags)
            item = best_fit(candidates, room) if budget is not None else (candidates[0] if candidates else None)
            if item is None:
                break
            self._run(item)
            room -= item.cost
            run.append(item.name)
        return run

    def run_all(self, *, tags: Optional[Collection[str]] = None, during: str = "") -> List[str]:
        """Run every queued item (``tags``: with one of these tags) in queue order, recording ``during`` (what it
        overlaps) on the timeline. What runs depends on the queue alone, never on timing, so every rank delivers
        its gradients in the same order (the hosts' reduction hooks need that). Returns the names run."""
        self._during = during
        try:
            run = []
            for item in self._selected(tags):
                self._run(item)
                run.append(item.name)
            return run
        finally:
            self._during = ""

    def flush(self) -> List[str]:
        """Run every queued item in queue order, then deliver every gradient still waiting (uses of other
        graphs stay counted). Returns the names run."""
        run: List[str] = []
        while self._items:
            item = self._items[0]
            self._run(item)
            run.append(item.name)
        self._deliver(list(self._waiting))
        return run

    def clear(self) -> None:
        """Drop everything queued, waiting and tracked (after a failed backward, before retrying)."""
        self._items.clear()
        self._waiting.clear()
        self._uses.clear()

    # ---- internals --------------------------------------------------------------------------------------

    def _selected(self, tags: Optional[Collection[str]]) -> List[WgradItem]:
        if tags is None:
            return list(self._items)
        return [item for item in self._items if item.tag in tags]

    def _register_flush(self) -> None:
        if not self.flush_at_end:
            return
        task = _current_graph_task()
        if task == -1 or task in self._flush_tasks:
            return
        self._flush_tasks.add(task)

        def end_of_backward() -> None:
            self._flush_tasks.discard(task)
            self.flush()

        torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)

    def _run(self, item: WgradItem) -> None:
        self._items.remove(item)
        start_ns = time.perf_counter_ns()
        with torch.no_grad():
            grads = item.compute()
        if self.timeline is not None:
            self.timeline.append(WgradSpan(item.name, item.tag, start_ns, time.perf_counter_ns(), self._during))
        self.items_run += 1
        self.release(item.use)
        self._waiting += [(target, grad, leaves_of(target)) for target, grad in grads]
        self._deliver(self._ready())

    def _ready(self) -> List[Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, ...]]]:
        """Waiting gradients whose leaves have no use outstanding and share no leaf with one that is not."""
        blocked = {id(leaf) for _, _, leaves in self._waiting for leaf in leaves if self._uses.get(id(leaf), 0) > 0}
        changed = True
        while changed:
            changed = False
            for _, _, leaves in self._waiting:
                ids = {id(leaf) for leaf in leaves}
                if ids & blocked and not ids <= blocked:
                    blocked |= ids
                    changed = True
        return [entry for entry in self._waiting if not {id(leaf) for leaf in entry[2]} & blocked]

    def _deliver(self, entries: List[Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, ...]]]) -> None:
        """One re-entrant backward for ``entries``: gradients of one target are summed first."""
        if not entries:
            return
        taken = {id(entry) for entry in entries}
        self._waiting = [entry for entry in self._waiting if id(entry) not in taken]
        summed: Dict[int, List[Any]] = {}
        for target, grad, _ in entries:
            if id(target) in summed:
                summed[id(target)][1] = summed[id(target)][1] + grad
            else:
                summed[id(target)] = [target, grad]
        with torch.enable_grad():
            roots = [target.view_as(target) if target.grad_fn is None else target for target, _ in summed.values()]
        torch.autograd.backward(roots, [grad for _, grad in summed.values()])
        self.deliveries += 1
