"""The communication engine: one per rank and plugin, passed explicitly, through which every collective of
the MoE core is issued, timed and recorded.

Ops (:data:`OPS`): ``all_to_all`` (even on dim 0; uneven with ``splits``), ``all_gather``, ``reduce_scatter``
(flat buffers), ``all_reduce`` (``reduce="sum"`` or ``"max"``). :meth:`CommEngine.submit` runs a closure of collectives on a
lane (PipeMoE's runner). Two priority classes:

- ``URGENT``: MoE exchanges, on the critical path. Issued from the caller's thread they run inline, at once,
  on the groups the caller passes (the layer's own); submitted to the ``pipeline`` lane they run on that
  lane's thread, on its twin groups.
- ``BACKGROUND``: work that may wait (gradient reductions; Lina's DDP buckets). The ``background`` lane's
  thread issues them in FIFO order on its twin groups and never *starts* one while an urgent op is pending or
  in flight on this rank: a condition variable on the count of pending + in-flight urgent ops. A layer that
  knows an urgent op is imminent adds to that count with :meth:`CommEngine.hold`, or with
  :meth:`CommEngine.expect_urgent` until its thread's next urgent op: a layer's output is marked so
  (:meth:`CommEngine.mark_backward_exchange`), and backward holds background ops from its combine on.
  ``yields=False`` background ops start in their FIFO turn regardless (a no-priority reference).

Lanes and twins. :func:`build_engine` is collective: each lane asked for gets a full set of the layout's
process groups of its own (its *twins*: separate communicators, with ``timeout_s``). An engine without a
lane refuses that lane's ops with an error naming the builder flag; ``CommEngine()`` (a ``Recorder``'s
default) runs urgent ops inline only: no process groups, no threads.

Why this cannot deadlock on gloo (one op order per communicator):

1. every rank issues every group's ops in the same order: the caller issues in program order, each lane is
   one FIFO thread, and the hold-back rule only delays a background op, never reorders the FIFO;
2. urgent and background ops never share a communicator: the caller's groups, the pipeline twins and the
   background twins are three disjoint sets;
3. holding back only delays: a background op waits for urgent ops (and holds) this rank issued earlier in
   program order; those run on other communicators, and every peer reaches them at the same point of the
   same program, before any later ``wait()`` on that background op, so they complete and the count drains.
   The caller's part: the same ops in the same order on every rank, and no urgent work (a lane closure, a
   hold) that waits on a background handle (``wait()`` inside its own thread's ``hold()`` is refused).

Failure. An op or closure that raises fails its handle, whose ``wait()`` raises it; the engine is then
poisoned: queued ops fail, and ``issue``/``submit`` raise at once naming the first error. A peer blocked in
the same collective fails by its group's timeout (twins: the default group's, unless ``timeout_s``) with a
CommError naming the op, group, layer, phase and lane. :meth:`CommEngine.close` stops threads, frees twins.

CUDA/NCCL: the same API with streams and no threads (run on one GPU only: benchmarks/results/gpu-h200.md).
Inline urgent ops run on the current stream; pipeline closures run inline (the runner moves them to its side
stream); background ops are issued on a low-priority side stream that first waits for the current stream,
and the hold-back rule applies on the host: while the urgent count is above zero they are deferred, issued
when it drops to zero, or when a handle is waited on (that op and those queued before it).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist

from moe_plugins.core.groups import Group, MoEProcessGroups, build_process_groups, destroy_process_groups
from moe_plugins.core.ledger import CommLedger, CommRecord
from moe_plugins.core.ops import (BACKGROUND, MAIN, PIPELINE, URGENT, CommError, Handle, Hold, Job, Lane, Splits,
                                  check_op, now_ns, run_op, volume)

_LANE_FLAGS = {PIPELINE: "pipeline=True", BACKGROUND: "background=True"}


class CommEngine:
    """Issues, orders, times and records one rank's collectives (see the module docstring). ``CommEngine()``
    is the inline, urgent-only engine; :func:`build_engine` makes one with lanes."""

    def __init__(self, lanes: Optional[Mapping[str, MoEProcessGroups]] = None, *,
                 ledger: Optional[CommLedger] = None, record_timeline: bool = False, cuda: bool = False):
        self.ledger, self.cuda = ledger, cuda
        self.timeline: Optional[List[CommRecord]] = [] if record_timeline else None
        self._cv = threading.Condition()
        self._urgent = 0                             # pending + in-flight urgent ops (and holds)
        self._error: Optional[BaseException] = None  # the first failure: the engine is poisoned
        self._stopping = self._closed = False
        self._local = threading.local()              # .lane: the lane whose thread this is
        self._holds: Dict[int, int] = {}             # thread id -> holds it made and has not released
        self._expected: Dict[int, List[Hold]] = {}   # thread id -> its until_urgent holds (expect_urgent)
        self._rank: Optional[int] = None
        self._deferred: Deque[Job] = deque()        # CUDA: background ops held back on the host
        self._issuing = threading.Lock()            # CUDA: one thread issues deferred ops at a time, in FIFO order
        self._twins: Dict[str, "weakref.WeakKeyDictionary[Any, Any]"] = {}
        self._lanes: Dict[str, Lane] = {}
        for name, groups in (lanes or {}).items():
            if name not in _LANE_FLAGS:
                raise ValueError(f"lanes ({name!r}) must be among {sorted(_LANE_FLAGS)}")
            lane = Lane(name, URGENT if name == PIPELINE else BACKGROUND, groups)
            self._lanes[name], self._twins[name] = lane, weakref.WeakKeyDictionary()
            if not cuda:
                lane.thread = threading.Thread(target=self._loop, args=(lane,), name=f"moe-comm-{name}",
                                               daemon=True)
                lane.thread.start()

    def __deepcopy__(self, memo) -> "CommEngine":    # shared like a process group
        return self

    # ---- public API ---------------------------------------------------------------------------------------

    def has_lane(self, name: str) -> bool:
        return name in self._lanes

    def lane_groups(self, name: str) -> MoEProcessGroups:
        """The twin groups of lane ``name`` (for closures submitted to it)."""
        groups = self._lane(name).groups
        if groups is None:
            raise CommError(f"the engine's {name} lane is closed")
        return groups

    def twin(self, schedule: Any, lane: str = PIPELINE) -> Any:
        """``schedule.twin(groups)`` on the lane's groups, built once per object (kept weakly)."""
        with self._cv:
            cache = self._twins[self._lane(lane).name]
            twin = cache.get(schedule)
            if twin is None:
                twin = cache[schedule] = schedule.twin(self.lane_groups(lane))
            return twin

    def hold(self) -> Hold:
        """An urgent op is imminent or in flight: background ops wait until ``with engine.hold(): ...`` ends."""
        with self._cv:
            self._raise_if_unusable()
        return Hold(self)

    def expect_urgent(self) -> Hold:
        """An urgent op of this thread is imminent (Lina: backward reached a layer's combine): no background op
        starts until this thread issues its next urgent op, waits on a background handle, or releases it."""
        with self._cv:
            self._raise_if_unusable()
        return Hold(self, until_urgent=True)

    def mark_backward_exchange(self, y: torch.Tensor) -> None:
        """When backward reaches ``y`` (a layer's output), its exchange is next: hold background ops back from
        then (:meth:`expect_urgent`). Does nothing without a background lane or when ``y`` needs no gradient."""
        if BACKGROUND in self._lanes and y.requires_grad:
            y.register_hook(lambda grad: self.expect_urgent() and None)

    def issue(self, op: str, group: Group, x: torch.Tensor, *, priority: str = URGENT, lane: Optional[str] = None,
              reduce: str = "sum", layer: str = "", phase: str = "forward",
              ledger: Optional[CommLedger] = None, yields: bool = True, splits: Splits = None,
              record_as: Optional[str] = None) -> Handle:
        """Issue ``op`` of ``x`` on ``group`` (a group of the layout; a lane maps it to its twin). Urgent ops
        without ``lane`` run inline before this returns; others are queued on their lane. ``yields=False``: a
        background op that starts in its FIFO turn even while urgent ops run (a no-priority reference).
        ``splits``: an uneven all_to_all's (send, receive) rows per member (:data:`~moe_plugins.core.ops.Splits`).
        ``record_as``: the op's name in the ledger and timeline (Hecate's ``spag``/``sprs``), if not ``op``'s."""
        check_op(op, group, x, priority, reduce, splits)
        name = record_as or ("all_reduce_max" if op == "all_reduce" and reduce == "max" else op)
        what = f"{name}@{group.kind} ({priority}, layer {layer!r}, {phase})"
        here = getattr(self._local, "lane", None)
        target = self._target(priority, lane, here)
        if target is None:                           # inline on this thread, on the group given
            run_lane = here.name if here is not None else MAIN
            if here is not None and group.pg is not None and group.pg is not self._twin_group(here, group).pg:
                raise ValueError(f"{what} on the {here.name} lane's thread must use the lane's twin groups "
                                 f"(engine.lane_groups({here.name!r})), not the {group.kind} group given")
            return self._inline(lambda job: self._op(job, name, op, group, group, x, reduce, layer, phase, ledger,
                                                     priority, run_lane, splits), what, priority)
        twin = self._twin_group(target, group)
        return self._enqueue(target, lambda job: self._op(job, name, op, group, twin, x, reduce, layer, phase,
                                                          ledger, priority, target.name, splits), what, yields)

    def submit(self, fn: Callable[..., Any], *args: Any, lane: str = PIPELINE) -> Handle:
        """Run ``fn(*args)`` on ``lane``'s thread (its collectives go on ``lane_groups(lane)``), after the lane's
        earlier work; the handle returns its result. CUDA: run inline (pipeline) or on the side stream."""
        target = self._lane(lane)
        if getattr(self._local, "lane", None) is target:
            raise CommError(f"submit() from the {lane} lane's own thread would wait for itself")
        what = f"closure {getattr(fn, '__qualname__', fn)!s} on the {lane} lane"
        return self._enqueue(target, lambda job: fn(*args), what)

    def close(self, join_timeout_s: float = 60.0) -> None:
        """Finish queued work, stop the lane threads and destroy the twin groups. Collective: every rank closes
        its engines in the same order; a closed engine refuses every op."""
        with self._cv:
            if self._closed:
                return
            self._stopping = True
            self._cv.notify_all()
        for lane in self._lanes.values():
            if lane.thread is not None:
                lane.thread.join(join_timeout_s)
        stuck = [lane.name for lane in self._lanes.values() if lane.thread is not None and lane.thread.is_alive()]
        if stuck:
            raise CommError(f"lanes {stuck} did not stop within join_timeout_s ({join_timeout_s} s): an op is still "
                            "blocked in a collective; their groups were left in place")
        with self._cv:
            self._closed = True
            for cache in self._twins.values():
                cache.clear()
        for lane in self._lanes.values():
            if lane.groups is not None:
                destroy_process_groups(lane.groups)
                lane.groups = None   # gloo frees a group's threads when the last reference goes

    # ---- recording ----------------------------------------------------------------------------------------

    def record(self, *, layer: str, op: str, group: Group, numel: int, elsize: int, remote_elems: float,
               phase: str, priority: Optional[str] = None, lane: Optional[str] = None,
               ledger: Optional[CommLedger] = None, issue_ns: int = 0, start_ns: int = 0, end_ns: int = 0) -> None:
        """One ledger record (and timeline entry) for an op; composites issued outside :meth:`issue` (SAA)
        call it themselves. ``priority`` and ``lane`` default to those of the calling thread."""
        target = ledger if ledger is not None else self.ledger
        if target is None and self.timeline is None:
            return
        here = getattr(self._local, "lane", None)
        lane = lane or (here.name if here is not None else MAIN)
        priority = priority or (here.priority if here is not None else URGENT)
        if self._rank is None:
            self._rank = dist.get_rank() if dist.is_initialized() else 0
        end_ns = end_ns or now_ns()
        rec = CommRecord(layer=layer, op=op, group=group.kind, group_ranks=tuple(group.ranks), numel=int(numel),
                         bytes=int(numel) * elsize, inter_node_bytes=int(round(remote_elems * elsize)), phase=phase,
                         priority=priority, lane=lane, rank=self._rank, issue_ns=issue_ns or start_ns or end_ns,
                         start_ns=start_ns or end_ns, end_ns=end_ns)
        if target is not None:
            target.add(rec)
        if self.timeline is not None:
            self.timeline.append(rec)

    # ---- internals ----------------------------------------------------------------------------------------

    def _lane(self, name: str) -> Lane:
        if name not in self._lanes:
            flag = _LANE_FLAGS.get(name)
            if flag is None:
                raise ValueError(f"lane ({name!r}) must be one of {sorted(_LANE_FLAGS)}")
            raise CommError(f"this engine has no {name} lane: build it with build_engine(groups, {flag}) "
                            "(collective)")
        return self._lanes[name]

    def _target(self, priority: str, lane: Optional[str], here: Optional[Lane]) -> Optional[Lane]:
        """None: run inline on this thread. On a lane's own thread ops run inline at the lane's priority."""
        if here is not None:
            if priority != here.priority or lane not in (None, here.name):
                raise ValueError(f"priority ({priority!r}) / lane ({lane!r}) on the {here.name} lane's thread: ops "
                                 f"there run inline at priority {here.priority!r}")
            return None
        if priority == BACKGROUND:
            if lane not in (None, BACKGROUND):
                raise ValueError(f"lane ({lane!r}) for a background op must be None or {BACKGROUND!r}")
            return self._lane(BACKGROUND)
        if lane not in (None, MAIN, PIPELINE):
            raise ValueError(f"lane ({lane!r}) for an urgent op must be None or {PIPELINE!r}")
        return self._lane(PIPELINE) if lane == PIPELINE else None

    def _twin_group(self, lane: Lane, group: Group) -> Group:
        twin = getattr(self.lane_groups(lane.name), group.kind, None)
        if twin is None or twin.ranks != group.ranks:
            raise ValueError(f"group {group.kind} {list(group.ranks)} is not a group of the {lane.name} lane's "
                             f"layout ({self.lane_groups(lane.name).layout.describe()})")
        return twin

    def _op(self, job: Job, name: str, op: str, group: Group, on: Group, x: torch.Tensor, reduce: str, layer: str,
            phase: str, ledger: Optional[CommLedger], priority: str, lane: str, splits: Splits) -> torch.Tensor:
        x, what = x.contiguous(), f"{name}@{group.kind} ({priority}, layer {layer!r}, {phase}, {lane} lane)"
        out = run_op(op, on.pg, on.size, x, reduce, what, splits)
        if on.pg is not None:
            numel, remote = volume(op, group, x, splits)
            self.record(layer=layer, op=name, group=group, numel=numel, elsize=x.element_size(),
                        remote_elems=remote, phase=phase, priority=priority, lane=lane, ledger=ledger,
                        issue_ns=job.issue_ns, start_ns=job.start_ns, end_ns=now_ns())
        return out

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            raise CommError(f"communication engine poisoned by an earlier failure: {self._error!r}") from self._error
        if self._stopping and getattr(self._local, "lane", None) is None:   # lanes drain their queues
            raise CommError("communication engine is closed")

    def _poison(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

    def _urgent_end(self) -> None:
        with self._cv:
            self._urgent -= 1
            flush = self._urgent == 0 and bool(self._deferred)
            if self._urgent == 0:
                self._cv.notify_all()
        if flush:
            self._flush_cuda()

    def _inline(self, run: Callable[[Job], Any], what: str, priority: str) -> Handle:
        urgent = priority == URGENT
        with self._cv:
            self._raise_if_unusable()
            self._urgent += urgent
            job = Job(run, Handle(what), now_ns())
        if urgent:
            self._end_expectations()
        try:
            job.start_ns = now_ns()
            job.handle._finish(run(job))
        except Exception as exc:     # the handle raises it; the engine is poisoned
            self._poison(exc)
            job.handle._finish(error=exc)
        finally:
            if urgent:
                self._urgent_end()
        return job.handle

    def _enqueue(self, lane: Lane, run: Callable[[Job], Any], what: str, yields: bool = True) -> Handle:
        if self.cuda and lane.priority == URGENT:    # CUDA: no lane thread; the runner's side stream orders it
            return self._inline(run, what, URGENT)
        guard = self._before_background_wait if lane.priority == BACKGROUND else None
        with self._cv:
            self._raise_if_unusable()
            job = Job(run, Handle(what, guard), now_ns(), yields=yields)
            if self.cuda:                            # background on CUDA: now, or when the urgent count drains
                self._deferred.append(job)
                flush = self._urgent == 0 or not yields
            else:
                self._urgent += lane.priority == URGENT
                lane.jobs.append(job)
                self._cv.notify_all()
                flush = False
        if lane.priority == URGENT:
            self._end_expectations()
        if flush:
            self._flush_cuda()
        return job.handle

    def _end_expectations(self) -> None:
        """This thread's expect_urgent() holds end: its urgent op now counts itself (or it waits for background
        work, which must not wait on them)."""
        with self._cv:
            expected = self._expected.pop(threading.get_ident(), [])
        for hold in expected:
            hold.release()

    def _before_background_wait(self, handle: Handle) -> None:
        """A background handle is about to be waited on: end this thread's expectations, refuse a wait inside
        its own hold, and on CUDA issue the op now."""
        self._end_expectations()
        if self._holds.get(threading.get_ident(), 0):
            raise CommError(f"wait() on {handle.what} inside this thread's hold() would wait forever: release "
                            "the hold first")
        if self.cuda:        # no lane thread would issue it later: the waiter needs it (and its FIFO elders) now
            self._flush_cuda(until=handle)

    def _loop(self, lane: Lane) -> None:
        self._local.lane = lane
        urgent = lane.priority == URGENT
        while True:
            with self._cv:
                while not (lane.jobs and (urgent or self._urgent == 0 or not lane.jobs[0].yields
                                          or self._error is not None)):
                    if self._stopping and not lane.jobs:
                        return
                    self._cv.wait()
                job = lane.jobs.popleft()
                job.start_ns, error = now_ns(), self._error
            try:
                if error is not None:
                    raise CommError(f"not run: the engine was poisoned by an earlier failure: {error!r}")
                job.handle._finish(job.run(job))
            except BaseException as exc:     # to the waiter, as a thread pool does; the engine is poisoned
                self._poison(exc)
                job.handle._finish(error=exc)
            finally:
                job = None               # let go of the closure and its result while idle (the runner's stages)
                if urgent:
                    self._urgent_end()

    def _flush_cuda(self, until: Optional[Handle] = None) -> None:
        """CUDA: issue deferred background ops in FIFO order while no urgent op is pending; ``until`` (a handle
        being waited on): its op and every one queued before it now, whatever the urgent count. Holds are per
        thread, and on a GPU autograd runs backward on its own thread: an expectation it set (a layer's combine)
        that no urgent op ends (an exchange group of one rank) would otherwise keep the op back forever. Flushes
        from two threads (autograd's and the main one) take turns, so ops are issued in queue order."""
        with self._issuing:
            while True:
                with self._cv:
                    forced = until is not None and any(job.handle is until for job in self._deferred)
                    if not self._deferred or (self._urgent and self._deferred[0].yields and not forced):
                        return
                    job = self._deferred.popleft()
                self._lanes[BACKGROUND].run_on_stream(job, self._poison)


def build_engine(groups: MoEProcessGroups, *, ledger: Optional[CommLedger] = None, pipeline: bool = False,
                 background: bool = False, timeout_s: Optional[float] = None,
                 record_timeline: bool = False) -> CommEngine:
    """Collective over the default group: an engine for ``groups``' layout with the lanes asked for, each on
    its own full set of twin groups whose collectives give up after ``timeout_s`` (None: the default group's
    timeout). ``pipeline``: PipeMoE's runner lane (urgent); ``background``: background ops (gradient
    reductions). Neither: no groups, inline."""
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s ({timeout_s!r}) must be > 0 seconds")
    lanes = {name: build_process_groups(groups.layout, timeout=timeout_s and timedelta(seconds=timeout_s))
             for name, wanted in ((PIPELINE, pipeline), (BACKGROUND, background)) if wanted}
    cuda = dist.is_initialized() and "nccl" in str(dist.get_backend())
    return CommEngine(lanes, ledger=ledger, record_timeline=record_timeline, cuda=cuda)
