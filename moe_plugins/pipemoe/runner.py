"""PipeMoE's pipelined runner: steps 2-4 of a schedule over r capacity chunks, dispatch(i+1), experts(i)
and combine(i-1) overlapped, in forward and backward (docs/pipemoe.md, "The runner").

Chunks are cut along ``Dispatched.cap_dim`` (so dropping and math are exactly those of r = 1). The exchange
stages of every chunk run on the communication engine's pipeline *lane* (:mod:`moe_plugins.core.engine`): one
thread with its own twin process groups, so its collectives never interleave with the expert stage's
collectives on a shared group; they are urgent ops, so background ops wait for them. Autograd: every
exchange stage is an island graph built on the lane; ``_Join`` and ``_Fence`` bracket it in the main graph
(see their docstrings). On GPU the lane's work is issued inline on a side CUDA stream and ordered with
events (:class:`_Streams`); untested, no GPU here.

Shapes: E experts, C capacity (c = a chunk of it), M model dim, S tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Tuple, Union

import torch

from moe_plugins.core.costmodel import CostProfile
from moe_plugins.core.engine import PIPELINE, CommEngine, Handle
from moe_plugins.core.executor import Executor, Sequential
from moe_plugins.core.plugin_config import degree_needs_profile
from moe_plugins.core.schedule import LayerParams, Schedule
from moe_plugins.pipemoe.degree import AutoDegree, Degree
from moe_plugins.pipemoe.flag import degree_from_flag
from moe_plugins.pipemoe.model import R_MAX

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


class Pipelined(Executor):
    """PipeMoE's executor: steps 2-4 over ``degree`` capacity chunks (an int, or an AutoDegree deciding per
    call), the exchange stages on ``engine``'s pipeline lane, whose twin groups keep their collectives apart
    from the expert stage's (build the engine with ``build_engine(groups, pipeline=True)``, collective).

    - CPU/gloo: the lane is one FIFO thread. gloo collectives block the thread that issues them, so the lane
      thread is what lets them proceed while this thread computes.
    - CUDA/NCCL: no thread. Collectives are asynchronous to the host already; the lane's work is issued
      inline on a side stream (:class:`_Streams`), and the autograd engine's device thread is never made
      to wait on another host thread (which could deadlock it).

    One engine (hence one lane) may serve many layers and executors; the engine's builder closes it."""

    def __init__(self, degree: Degree, engine: CommEngine):
        if not engine.has_lane(PIPELINE):
            raise ValueError(f"pipeline degree {degree!r} needs an engine with a pipeline lane: build it with "
                             "build_engine(groups, pipeline=True) (collective)")
        self.degree, self.engine = degree, engine

    def run(self, schedule: Schedule, x_SM: torch.Tensor, params: LayerParams):
        return run_pipelined(schedule, x_SM, params, self.degree, self)

    def twin(self, schedule: Schedule) -> Schedule:
        """The same schedule class on the lane's groups. Built once per schedule object (by the engine)."""
        return self.engine.twin(schedule, PIPELINE)

    def submit(self, streams: _Streams, fn: Callable, *args) -> Handle:
        return self.engine.submit(fn, *args, lane=PIPELINE)

    def __repr__(self) -> str:
        return f"Pipelined(degree={self.degree!r})"


def needs_lane(pipeline_degree: Union[int, str, AutoDegree]) -> bool:
    """Whether ``pipeline_degree`` (as :func:`build_executor` takes it) runs the pipeline, so that its engine
    needs a pipeline lane."""
    return (isinstance(pipeline_degree, AutoDegree) or degree_needs_profile(pipeline_degree)
            or degree_from_flag(pipeline_degree, None) != 1)


def build_executor(pipeline_degree: Union[int, str, AutoDegree], profile: Optional[CostProfile],
                   engine: Optional[CommEngine], *, r_max: int = R_MAX) -> Executor:
    """The executor for a host flag's ``pipeline_degree`` (an int, a digit string, "auto", "tune", or an
    AutoDegree): :class:`Sequential` at 1, else :class:`Pipelined` on ``engine``'s pipeline lane. "auto" and
    "tune" need ``profile`` (``moe-plugins profile``; the caller loads it at its boundary)."""
    degree = (pipeline_degree if isinstance(pipeline_degree, AutoDegree)
              else degree_from_flag(pipeline_degree, profile, r_max=r_max))
    if degree == 1:
        return Sequential()
    if engine is None:
        raise ValueError(f"pipeline_degree ({pipeline_degree!r}) needs engine=build_engine(groups, pipeline=True) "
                         "(collective; the caller builds it once and closes it)")
    return Pipelined(degree, engine)


@dataclass
class _Stage:
    """One exchange stage of one chunk: the island graph built on the lane and its pending results."""

    lane: Pipelined
    streams: _Streams
    fn: Callable[[torch.Tensor], torch.Tensor]
    fenced: Optional[torch.Tensor] = None
    forward: Optional[Handle] = None
    backward: Optional[Handle] = None
    shape: Tuple[int, ...] = field(default_factory=tuple)
    # the layer Recorder's while_in_flight (Lancet's deferred dW): run while this stage's backward flies
    while_in_flight: Optional[Callable[[Handle], None]] = None

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
        leaf, y, done = self.forward.wait()
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
        leaf, y, _ = self.forward.wait()
        with self.streams.lane(ready):
            if y.requires_grad:
                (gx,) = torch.autograd.grad(y, leaf, g, allow_unused=True)
            else:
                gx = None
            return (torch.zeros_like(leaf) if gx is None else gx), self.streams.mark()

    def input_grad(self) -> torch.Tensor:
        gx, done = self.backward.wait()
        self.streams.wait(done, gx)
        return gx


class _Fence(torch.autograd.Function):
    """Identity on a stage's input. Backward: wait for the lane's gradient of the stage (launched earlier
    by ``_Join``) and pass it on; the incoming gradient is ``_Join``'s placeholder. With the layer Recorder's
    ``while_in_flight`` (core/comm.py), it runs first, while the stage's backward exchange flies on the lane."""

    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        return x.view_as(x)

    @staticmethod
    def backward(ctx, _placeholder):
        stage = ctx.stage
        if stage.while_in_flight is not None:      # work that needs none of this (Lancet's dW) runs meanwhile
            try:
                stage.while_in_flight(stage.backward)
            finally:
                gx = stage.input_grad()                # collective on the lane: wait even if the callback failed
            return gx, None
        return stage.input_grad(), None


class _Join(torch.autograd.Function):
    """The stage's output in the main graph. Backward: queue the island's backward on the lane and return
    a one-element placeholder at once, so the engine goes on with other chunks' work."""

    @staticmethod
    def forward(ctx, fenced, stage):
        ctx.stage = stage
        _, y, _ = stage.forward.wait()
        return y.detach()

    @staticmethod
    def backward(ctx, g):
        stage = ctx.stage
        stage.launch_backward(g.contiguous())
        return g.new_zeros(()).expand(stage.shape), None


def _finish(schedule: Schedule, y, sample, dispatched):
    """The combine on the caller's thread, its output marked for the engine (Schedule.mark_combine)."""
    return schedule.mark_combine(schedule.finish(y if sample is None else sample.wrap_output(y), dispatched)), dispatched


def run_pipelined(schedule: Schedule, x_SM: torch.Tensor, params: LayerParams, degree: Degree,
                  lane: Optional[Pipelined] = None):
    """Drop-in for ``run_schedule``: steps 2-4 over ``degree`` capacity chunks, pipelined on ``lane`` (a
    :class:`Pipelined`). ``degree`` may be an :class:`AutoDegree`; a degree of 1 runs sequentially here."""
    dispatched = schedule.prepare(x_SM, params)
    d = dispatched.d
    r, sample = (degree.begin(schedule, dispatched, torch.is_grad_enabled()) if isinstance(degree, AutoDegree)
                 else (degree, None))
    d = d if sample is None else sample.wrap_input(d)
    if r == 1:
        y = schedule.exchange_out(schedule.expert(schedule.exchange_in(d), params))
        return _finish(schedule, y, sample, dispatched)
    if lane is None:
        raise ValueError(f"pipeline degree {r} needs a Pipelined executor (build_executor(..., engine))")
    twin, streams = lane.twin(schedule), _Streams(d.device)
    chunks = schedule.chunks(dispatched if sample is None else replace(dispatched, d=d), r)
    # D_1..D_r queue first on the lane (FIFO link); E_i runs here as soon as D_i lands; C_i queues behind.
    hook = schedule.rec.while_in_flight
    ins = [_Stage(lane, streams, twin.exchange_in, while_in_flight=hook).start(c) for c in chunks]
    outs = [_Stage(lane, streams, twin.exchange_out, while_in_flight=hook).start(schedule.expert(s.join(), params))
            for s in ins]
    y = schedule.join([s.join() for s in outs], dispatched)
    return _finish(schedule, y, sample, dispatched)
