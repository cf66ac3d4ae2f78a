"""The pieces the communication engine (:mod:`moe_plugins.core.engine`) is built from: the raw collectives it
issues, their ledger volumes, argument checks, and the handle of an issued op.

Priority classes and lanes are named here too, so that modules can name them without the engine.
"""

from __future__ import annotations

import logging

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.groups import Group, MoEProcessGroups

logger = logging.getLogger("moe_plugins.engine")

URGENT, BACKGROUND = "urgent", "background"              # priority classes
MAIN, PIPELINE = "main", "pipeline"                      # lanes (the background lane is named BACKGROUND)
OPS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# an uneven all_to_all's split sizes along dim 0: (rows sent to each member, rows received from each member)
Splits = Optional[Tuple[Sequence[int], Sequence[int]]]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same semantics on flat buffers).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommError(RuntimeError):
    """The engine cannot run an op: it is poisoned by an earlier failure, closed, or misused."""


def now_ns() -> int:
    """The engine's clock: ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux: one clock for the machine)."""
    return time.perf_counter_ns()


class Handle:
    """The pending result of one issued op or submitted closure."""

    def __init__(self, what: str, before_wait: Optional[Callable[["Handle"], None]] = None):
        self.what, self._before_wait = what, before_wait
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self.cuda_event: Any = None                  # CUDA: the event that marks the op's end on its stream

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: Optional[float] = None) -> Any:
        """The op's result; raises the op's error (the same on every call)."""
        if not self._event.is_set() and self._before_wait is not None:
            self._before_wait(self)
        if not self._event.wait(timeout_s):
            raise TimeoutError(f"{self.what} has not finished after {timeout_s} s")
        if self._error is not None:
            raise self._error
        if self.cuda_event is not None:
            torch.cuda.current_stream().wait_event(self.cuda_event)
        return self._result


@dataclass
class Job:
    """One unit of work of the engine: ``run(job)`` and the handle it fills, with its time stamps."""

    run: Callable[["Job"], Any]
    handle: Handle
    issue_ns: int
    start_ns: int = 0
    yields: bool = True                              # background: waits while urgent ops are pending


@dataclass
class Lane:
    """One lane of an engine: its FIFO of jobs, the thread that runs them (CPU) and its twin groups."""

    name: str
    priority: str
    groups: Optional[MoEProcessGroups]
    jobs: Deque[Job] = field(default_factory=deque)
    thread: Optional[threading.Thread] = None
    stream: Any = None                               # CUDA: the background lane's side stream

    def run_on_stream(self, job: Job, on_error: Callable[[BaseException], None]) -> None:
        """CUDA: run ``job`` on this lane's low-priority stream, after the current stream's work, and finish its
        handle (an error goes to ``on_error`` first, then to the handle)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(priority=0)          # lowest priority; exchanges keep the current
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            job.start_ns = now_ns()
            try:
                result = job.run(job)
            except Exception as exc:     # the handle raises it; the engine is poisoned
                on_error(exc)
                job.handle._finish(error=exc)
                return
            job.handle.cuda_event = torch.cuda.Event()
            job.handle.cuda_event.record(self.stream)
        job.handle._finish(result)


def check_op(op: str, group: Group, x: torch.Tensor, priority: str, reduce: str, splits: Splits = None) -> None:
    """Raise one ValueError naming every bad argument of an op (``splits``: an uneven all_to_all's)."""
    problems = [] if splits is None else _splits_problems(op, group, x, splits)
    if op not in OPS:
        problems.append(f"op ({op!r}) must be one of {', '.join(OPS)}")
    if priority not in (URGENT, BACKGROUND):
        problems.append(f"priority ({priority!r}) must be {URGENT!r} or {BACKGROUND!r}")
    if reduce not in REDUCE_OPS:
        problems.append(f"reduce ({reduce!r}) must be one of {sorted(REDUCE_OPS)}")
    if op == "all_to_all" and splits is None and x.dim() and x.shape[0] % group.size:
        problems.append(f"all_to_all: dim 0 ({x.shape[0]}) must be divisible by the {group.kind} group size "
                        f"({group.size})")
    if op == "reduce_scatter" and x.numel() % group.size:
        problems.append(f"reduce_scatter: numel ({x.numel()}) must be divisible by the {group.kind} group size "
                        f"({group.size})")
    if problems:
        raise ValueError("invalid collective: " + "; ".join(problems))


def _splits_problems(op: str, group: Group, x: torch.Tensor, splits: Any) -> list:
    if op != "all_to_all":
        return [f"split sizes are for all_to_all only, not {op!r}"]
    if not (isinstance(splits, tuple) and len(splits) == 2):
        return [f"splits ({splits!r}) must be (send sizes, receive sizes)"]
    problems = []
    for name, sizes in zip(("send", "receive"), splits):
        if len(sizes) != group.size or any(int(n) < 0 for n in sizes):
            problems.append(f"all_to_all: {name} split sizes ({list(sizes)}) must be {group.size} integers >= 0, "
                            f"one per member of the {group.kind} group")
    if x.dim() == 0 or sum(int(n) for n in splits[0]) != x.shape[0]:
        problems.append(f"all_to_all: send split sizes ({list(splits[0])}) must sum to dim 0 of the input "
                        f"({tuple(x.shape)})")
    return problems


def volume(op: str, group: Group, x: torch.Tensor, splits: Splits = None) -> Tuple[int, float]:
    """(numel, inter-node elements) of ``op`` on input ``x``, in the ledger's convention (core/ledger.py). An
    uneven all_to_all (``splits``) sends ``send[j]`` rows to member j: its inter-node elements are the rows
    that go to members on other nodes (:meth:`Group.remote_share`)."""
    n, size, remote = x.numel(), group.size, group.remote_peers
    if splits is not None:
        row = x[0].numel() if x.shape[0] else int(torch.tensor(x.shape[1:]).prod())
        return n, group.remote_share([int(s) * row for s in splits[0]])
    if op == "all_gather":
        return n * size, remote * n
    if op == "all_reduce":
        return n, 2 * remote * n / size
    return n, remote * n / size                     # all_to_all, reduce_scatter


def run_op(op: str, pg: Optional[dist.ProcessGroup], size: int, x: torch.Tensor, reduce: str,
           what: str = "", splits: Splits = None) -> torch.Tensor:
    """The collective itself, out of place: all_to_all keeps x's shape (uneven with ``splits``: dim 0 becomes
    the rows received); all_gather, reduce_scatter are flat.
    A failure (a peer gone: the group's timeout, or a closed connection) is a CommError naming ``what``, logged
    as an error: a rank that stops or dies makes its peers fail here, saying where they were."""
    if pg is None:                                    # a group of one: nothing to exchange
        return x.reshape(-1).clone() if op in ("all_gather", "reduce_scatter") else x.clone()
    try:
        return _run_collective(op, pg, size, x, reduce, splits)
    except CommError:
        raise
    except RuntimeError as exc:                       # gloo/NCCL errors are RuntimeErrors (DistError among them)
        message = f"{what or op} failed: {exc}"
        logger.error("moe_plugins: %s", message)
        raise CommError(message) from exc


def _run_collective(op: str, pg: dist.ProcessGroup, size: int, x: torch.Tensor, reduce: str,
                    splits: Splits) -> torch.Tensor:
    if op == "all_to_all" and splits is not None:   # uneven: one all_to_all_single with split sizes (gloo too)
        send, recv = [int(n) for n in splits[0]], [int(n) for n in splits[1]]
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=pg)
    elif op == "all_to_all":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=pg)
    elif op == "all_gather":
        out = x.new_empty(size * x.numel())
        _all_gather_flat(out, x.reshape(-1), group=pg)
    elif op == "reduce_scatter":
        out = x.new_empty(x.numel() // size)
        _reduce_scatter_flat(out, x.reshape(-1), group=pg)
    else:
        out = x.clone()
        dist.all_reduce(out, op=REDUCE_OPS[reduce], group=pg)
    return out


class Hold:
    """An urgent op is imminent: no background op starts until :meth:`release` (or the ``with`` block's end;
    or, ``until_urgent``, until this thread issues its next urgent op). ``engine``: a CommEngine."""

    def __init__(self, engine: Any, *, until_urgent: bool = False):
        self._engine, self._held, self._thread = engine, True, threading.get_ident()
        self.until_urgent = until_urgent      # released by this thread's next urgent op (or background wait)
        with engine._cv:
            engine._urgent += 1
            if until_urgent:
                engine._expected.setdefault(self._thread, []).append(self)
            else:
                engine._holds[self._thread] = engine._holds.get(self._thread, 0) + 1

    def release(self) -> None:
        """Let background ops start again (once no other urgent op is pending); idempotent."""
        if self._held:
            self._held = False
            with self._engine._cv:
                if not self.until_urgent:
                    self._engine._holds[self._thread] -= 1
                elif self in self._engine._expected.get(self._thread, []):    # the engine may have taken it off
                    self._engine._expected[self._thread].remove(self)
            self._engine._urgent_end()

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
