"""PipeMoE's pipelined runner: steps 2-4 of a schedule over r capacity chunks, dispatch(i+1), experts(i)
and combine(i-1) overlapped, in forward and backward (docs/pipemoe.md, "The runner").

Chunks are cut along ``Dispatched.cap_dim`` (so dropping and math are exactly those of r = 1). The exchange
stages of every chunk run on a *lane*: one worker thread with its own twin process groups, so its
collectives never interleave with the expert stage's collectives on a shared group. Autograd: every
exchange stage is an island graph built on the lane; ``_Join`` and ``_Fence`` bracket it in the main graph
(see their docstrings). On GPU the lane's work is issued inline on a side CUDA stream and ordered with
events (:class:`_Streams`); untested, no GPU here.

Shapes: E experts, C capacity (c = a chunk of it), M model dim, S tokens.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import torch

from moe_plugins.core.groups import MoEProcessGroups, build_process_groups, destroy_process_groups
from moe_plugins.core.schedule import LayerParams, Schedule, chunk_bounds
from moe_plugins.pipemoe.degree import AutoDegree, Degree

class _Streams:
    """Device ordering between the main thread's work and the lane's. CPU: nothing to do (a gloo
    collective has finished when it returns on the lane thread). CUDA: the lane runs on a side stream;
    ``mark`` records an event on the current stream, ``lane`` makes the side stream wait for it, and
    ``wait`` makes the current stream wait for the lane's event (no host synchronisation)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device=device) if self.cuda else None

    def mark(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @contextlib.contextmanager
    def lane(self, ready):
        if not self.cuda:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.side):
            if ready is not None:
                self.side.wait_event(ready)
            yield

    def wait(self, done, *tensors: torch.Tensor) -> None:
        if self.cuda and done is not None:
            torch.cuda.current_stream().wait_event(done)
            for t in tensors:                       # memory made on the side stream, now used here
                t.record_stream(torch.cuda.current_stream())


class PipelineLane:
    """Where exchange stages run, with twin process groups of the layout so that their collectives never
    share a group with the expert stage's.

    - CPU/gloo: one worker thread, FIFO. gloo collectives block the thread that issues them, so the lane
      thread is what lets them proceed while this thread computes.
    - CUDA/NCCL: no thread. Collectives are asynchronous to the host already; the lane's work is issued
      inline on a side stream (:class:`_Streams`), and the autograd engine's device thread is never made
      to wait on another host thread (which could deadlock it).

    Collective: build it on every rank in the same order (it creates process groups). One lane may serve
    many layers of a model. ``close()`` stops the thread and destroys the twin groups."""

    def __init__(self, groups: MoEProcessGroups):
        self.groups: Optional[MoEProcessGroups] = build_process_groups(groups.layout)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-pipe-lane")
        # keyed by the schedule object itself (weakly): an id() could be reused by a later layer's schedule
        self._twins: Optional["weakref.WeakKeyDictionary[Schedule, Schedule]"] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def twin(self, schedule: Schedule) -> Schedule:
        """The same schedule class on the lane's groups. Built once per schedule object."""
        with self._lock:
            if self._twins is None:
                raise RuntimeError("this PipelineLane is closed")
            twin = self._twins.get(schedule)
            if twin is None:
                twin = schedule.twin(self.groups)
                self._twins[schedule] = twin
            return twin

    def submit(self, streams: _Streams, fn: Callable, *args) -> Future:
        if not streams.cuda:
            return self._pool.submit(fn, *args)
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:                # handed to the caller, as the thread pool does
            done.set_exception(exc)
        return done

    def close(self) -> None:
        """Stop the thread and free the twin groups (gloo keeps threads per group). Collective: every
        rank closes its lanes in the same order; a closed lane must not be used again."""
        self._pool.shutdown(wait=True)
        with self._lock:
            if self._twins is not None:
                self._twins = None
                destroy_process_groups(self.groups)
                # gloo frees a group's threads only when the last reference to it goes, not on destroy:
                # layers may keep this lane alive, so the lane lets go of its groups
                self.groups = None


@dataclass
class _Stage:
    """One exchange stage of one chunk: the island graph built on the lane and its pending results."""

    lane: PipelineLane
    streams: _Streams
    fn: Callable[[torch.Tensor], torch.Tensor]
    fenced: Optional[torch.Tensor] = None
    forward: Optional[Future] = None
    backward: Optional[Future] = None
    shape: Tuple[int, ...] = field(default_factory=tuple)

    def start(self, x: torch.Tensor) -> "_Stage":
        track = torch.is_grad_enabled() and x.requires_grad
        self.fenced = _Fence.apply(x, self) if track else x
        self.shape = tuple(x.shape)
        self.forward = self.lane.submit(self.streams, self._run_forward, self.fenced.detach(), track,
                                        self.streams.mark())
        return self

    def _run_forward(self, x: torch.Tensor, track: bool, ready):
        with self.streams.lane(ready), torch.set_grad_enabled(track):
            leaf = x.requires_grad_(track)
            y = self.fn(leaf)
            return leaf, y, self.streams.mark()

    def join(self) -> torch.Tensor:
        leaf, y, done = self.forward.result()
        self.streams.wait(done, y)
        # let go of the fenced input: its grad_fn's ctx holds this stage, and a cycle through an autograd
        # node is one Python's collector cannot see, so every step's chunks would stay alive
        fenced, self.fenced = self.fenced, None
        if leaf.requires_grad:
            return _Join.apply(fenced, self)
        return y

    def launch_backward(self, g: torch.Tensor) -> None:
        self.backward = self.lane.submit(self.streams, self._run_backward, g, self.streams.mark())

    def _run_backward(self, g: torch.Tensor, ready):
        leaf, y, _ = self.forward.result()
        with self.streams.lane(ready):
            if y.requires_grad:
                (gx,) = torch.autograd.grad(y, leaf, g, allow_unused=True)
            else:
                gx = None
            return (torch.zeros_like(leaf) if gx is None else gx), self.streams.mark()

    def input_grad(self) -> torch.Tensor:
        gx, done = self.backward.result()
        self.streams.wait(done, gx)
        return gx


class _Fence(torch.autograd.Function):
    """Identity on a stage's input. Backward: wait for the lane's gradient of the stage (launched earlier
    by ``_Join``) and pass it on; the incoming gradient is ``_Join``'s placeholder."""

    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        return x.view_as(x)

    @staticmethod
    def backward(ctx, _placeholder):
        return ctx.stage.input_grad(), None


class _Join(torch.autograd.Function):
    """The stage's output in the main graph. Backward: queue the island's backward on the lane and return
    a one-element placeholder at once, so the engine goes on with other chunks' work."""

    @staticmethod
    def forward(ctx, fenced, stage):
        ctx.stage = stage
        _, y, _ = stage.forward.result()
        return y.detach()

    @staticmethod
    def backward(ctx, g):
        stage = ctx.stage
        stage.launch_backward(g.contiguous())
        return g.new_zeros(()).expand(stage.shape), None


def run_pipelined(schedule: Schedule, x_SM: torch.Tensor, params: LayerParams, degree: Degree,
                  lane: Optional[PipelineLane] = None):
    """Drop-in for ``run_schedule``: steps 2-4 over ``degree`` capacity chunks, pipelined on ``lane``.
    ``degree`` may be an :class:`AutoDegree`; a degree of 1 runs sequentially on this thread."""
    dispatched = schedule.prepare(x_SM, params)
    d, dim = dispatched.d, dispatched.cap_dim
    r, sample = (degree.begin(schedule, dispatched, torch.is_grad_enabled()) if isinstance(degree, AutoDegree)
                 else (degree, None))
    d = d if sample is None else sample.wrap_input(d)
    if r == 1:
        y = schedule.exchange_out(schedule.expert(schedule.exchange_in(d), params))
        return schedule.finish(y if sample is None else sample.wrap_output(y), dispatched), dispatched
    if lane is None:
        raise ValueError(f"pipeline degree {r} needs a PipelineLane (MoELayer builds one when "
                         "pipeline_degree != 1)")
    twin, streams = lane.twin(schedule), _Streams(d.device)
    chunks = [d.narrow(dim, a, b - a) for a, b in chunk_bounds(d.shape[dim], r)]
    # D_1..D_r queue first on the lane (FIFO link); E_i runs here as soon as D_i lands; C_i queues behind.
    ins = [_Stage(lane, streams, twin.exchange_in).start(c) for c in chunks]
    outs = [_Stage(lane, streams, twin.exchange_out).start(schedule.expert(s.join(), params)) for s in ins]
    y = torch.cat([s.join() for s in outs], dim=dim)
    return schedule.finish(y if sample is None else sample.wrap_output(y), dispatched), dispatched
