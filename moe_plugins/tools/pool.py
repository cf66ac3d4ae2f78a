"""A reusable pool of gloo worker processes: start N ranks once, run many collective jobs on them.

Spawning 4 ranks per test costs seconds on 2 cores; the pool pays it once. A job is a module-level
function run on every rank with the same arguments; its per-rank return values come back in rank order.
A failed or timed-out job tears the pool down (its collectives may be wedged); the next job restarts it.

Jobs and results cross the queues as bytes of plain ``pickle`` (:func:`to_bytes`: tensors by value, a view of a
larger buffer with its own elements only). multiprocessing's own pickler would move every tensor into shared
memory, in place, from the queue's feeder thread (a race with the thread still using it), and a worker's pickling
of its result keeps a duplicated file descriptor, and so the shared memory, open for good: every tensor a job
returned leaked one of each in the worker for the pool's life.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence


class _ByValue(pickle.Pickler):
    """Plain pickle, but a CPU tensor viewing a larger storage is sent as a copy of its own elements: torch pickles
    a tensor with its whole storage, so 50 small views of one 4 MB buffer would be 200 MB."""

    def reducer_override(self, obj: Any) -> Any:
        import torch
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided \
                or obj.device.type != "cpu" or obj.untyped_storage().nbytes() <= obj.numel() * obj.element_size():
            return NotImplemented
        own = obj.detach().clone().requires_grad_(obj.requires_grad)
        return (torch.nn.Parameter, (own, obj.requires_grad)) if type(obj) is torch.nn.Parameter else \
            own.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def to_bytes(value: Any) -> bytes:
    """``value`` as the pool sends it (see the module docstring); ``pickle.loads`` reads it."""
    out = io.BytesIO()
    _ByValue(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return out.getvalue()


class WorkerError(RuntimeError):
    """A job failed on at least one rank; the message holds every failing rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, init_method: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _worker_main(rank: int, world: int, init_method: str, env: Dict[str, str], timeout_s: float,
                 tasks: "mp.Queue", results: "mp.Queue") -> None:
    # a crash in native code (a segmentation fault, glibc's abort on a corrupted heap) prints every thread's
    # Python stack to stderr, where the test's report shows it beside the parent's "exited with code -6"
    faulthandler.enable(all_threads=True)
    host, port = init_method[len("tcp://"):].rsplit(":", 1)
    # the variables torchrun would set: hosts (DeepSpeed) read them even when the group already exists
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": host, "MASTER_PORT": port})
    os.environ.update(env)
    init_gloo(rank, world, init_method, timeout_s)
    while True:
        job = tasks.get()
        if job is None:
            break
        job_id, payload = job
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
            # pickled here, not by the queue's feeder thread: there an error is printed and the result lost, and
            # the parent would wait for it until its timeout
            results.put((job_id, rank, True, to_bytes(value)))
        except Exception:  # reported to the parent, which raises WorkerError
            results.put((job_id, rank, False, traceback.format_exc()))
    import torch.distributed as dist
    dist.destroy_process_group()


POLL_S = 1.0             # how often a waiting run checks that every worker process is still alive
AFTER_FAILURE_S = 10.0   # how long a run still waits for the other ranks once one failed


def _dead(procs: Sequence[Any], got: Dict[int, Any], errors: Dict[int, str]) -> Dict[int, str]:
    """The ranks whose worker process has exited without reporting this job, each with its exit code (a negative
    code is the signal that killed it: -11 a segmentation fault, -9 a kill, e.g. by the kernel's OOM killer)."""
    return {rank: f"worker process exited with code {p.exitcode} before reporting the job"
            for rank, p in enumerate(procs)
            if rank not in got and rank not in errors and p.exitcode is not None}


class WorkerPool:
    """``world`` gloo ranks in worker processes, started on first use. ``start_method``: multiprocessing's
    (``"spawn"``: a fresh interpreter per worker; ``"forkserver"`` with ``preload``: workers forked from a server
    process that imported those modules once, which saves each worker their import time)."""

    def __init__(self, world: int, *, env: Optional[Dict[str, str]] = None, collective_timeout_s: float = 120.0,
                 start_method: str = "spawn", preload: Sequence[str] = ()):
        self.world, self.env, self.collective_timeout_s = world, dict(env or {}), collective_timeout_s
        self.start_method, self.preload = start_method, tuple(preload)
        self._procs: List[mp.Process] = []
        self._job = 0

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.preload:
            ctx.set_forkserver_preload(list(self.preload))
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._procs = [ctx.Process(target=_worker_main, daemon=True,
                                   args=(r, self.world, init_method, self.env, self.collective_timeout_s,
                                         self._tasks[r], self._results))
                       for r in range(self.world)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0, **kwargs: Any) -> List[Any]:
        if not self._procs:
            self._start()
        self._job += 1
        payload = to_bytes((fn, args, kwargs))
        for q in self._tasks:
            q.put((self._job, payload))
        got: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        start = time.monotonic()
        deadline, hurried = start + timeout_s, False
        while len(got) + len(errors) < self.world:
            try:
                job_id, rank, ok, value = self._results.get(timeout=max(min(POLL_S, deadline - time.monotonic()),
                                                                        0.01))
                if job_id == self._job:
                    (got if ok else errors)[rank] = pickle.loads(value) if ok else value
            except queue.Empty:
                errors.update(_dead(self._procs, got, errors))
            if errors and not hurried:      # the others are likely blocked in a collective: wait briefly only
                deadline, hurried = min(deadline, time.monotonic() + AFTER_FAILURE_S), True
            if len(got) + len(errors) < self.world and time.monotonic() >= deadline:
                missing = sorted(set(range(self.world)) - set(got) - set(errors))
                errors[-1] = (f"no result from ranks {missing} after {time.monotonic() - start:.0f} s "
                              f"(job timeout {timeout_s:.0f} s; {AFTER_FAILURE_S:.0f} s once a rank failed)")
                break
        if errors:
            self.close()
            raise WorkerError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [got[r] for r in range(self.world)]

    def close(self) -> None:
        for q, p in zip(getattr(self, "_tasks", []), self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
