"""Start R ranks per node as separate processes, on an emulated cluster or on loopback, bounded in time.

On an emulated cluster, rank r runs in node ``r // R``'s namespace (``ip netns exec``), gloo is pointed at
the node's NIC (``GLOO_SOCKET_IFNAME``) and the rendezvous at node 0's address. On loopback, every rank
binds 127.0.0.1 and nothing is shaped.

Each rank is its own session (``start_new_session``), so a Ctrl-C in the terminal reaches only the parent,
which then stops the ranks it started, by their process group ids, and tears the cluster down. A rank that
fails stops the run at once; so does the deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from moe_plugins.tools.pool import free_port
from moe_plugins.tools.bench.cluster import Cluster

MASTER_PORT_IN_NAMESPACE = 29500      # node 0's namespace is new and private: any fixed port is free


class RankFailure(RuntimeError):
    """A rank exited with an error, or the run passed its deadline; the message holds the log tails."""


def rank_env(rank: int, world: int, ranks_per_node: int, master_addr: str, master_port: int,
             ifname: str) -> Dict[str, str]:
    """The torchrun-style variables a rank needs (pure)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % ranks_per_node),
            "LOCAL_WORLD_SIZE": str(ranks_per_node), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": ifname, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


def rank_command(rank: int, ranks_per_node: int, cluster: Optional[Cluster], job_path: Path) -> List[str]:
    cmd = [sys.executable, "-m", "moe_plugins.tools.bench.rank_main", str(job_path)]
    if cluster is None:
        return cmd
    return ["ip", "netns", "exec", cluster.nodes[rank // ranks_per_node]] + cmd


@contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into SystemExit (SIGINT already raises KeyboardInterrupt), so ``finally``
    blocks run; restore the previous handlers on exit. A no-op outside the main thread."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise SystemExit(128 + signum)
    saved = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _stop(procs: List[subprocess.Popen]) -> None:
    """SIGTERM each rank's process group, then SIGKILL what is left after a grace period."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in alive):
            time.sleep(0.1)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_ranks(*, world: int, ranks_per_node: int, cluster: Optional[Cluster], job_path: Path, workdir: Path,
              timeout_s: float, on_poll: Callable[[], None] = lambda: None) -> None:
    """Run every rank to completion; raise :class:`RankFailure` on the first failure or at the deadline.
    Always stops every rank it started before returning or raising."""
    if cluster is None:
        addr, port, ifname = "127.0.0.1", free_port(), "lo"
    else:
        addr, port, ifname = cluster.addresses[0], MASTER_PORT_IN_NAMESPACE, cluster.ifname
    procs: List[subprocess.Popen] = []
    logs = [workdir / f"rank{r}.log" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    try:
        for r in range(world):
            env = {**os.environ, **rank_env(r, world, ranks_per_node, addr, port, ifname)}
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen(rank_command(r, ranks_per_node, cluster, job_path), env=env,
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        while True:
            on_poll()
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r = failed[0]
                raise RankFailure(f"rank {r} exited with code {codes[r]}; last lines of {logs[r]}:\n{_tail(logs[r])}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise RankFailure(f"the run passed its time limit ({timeout_s:.0f} s; `moe-plugins bench --timeout-s` "
                                  f"sets it); last lines of rank 0's "
                                  f"log {logs[0]}:\n{_tail(logs[0])}")
            time.sleep(0.25)
    finally:
        _stop(procs)


def run_script_ranks(script: str, cfg: Dict[str, Any], cluster: Any, workdir: Path) -> Dict[str, Any]:
    """For the scripts in benchmarks/: run ``python script --rank-config CFG`` once per rank (inside the nodes'
    namespaces when ``cluster`` is given, else on loopback), wait within ``cfg["timeout_s"]``, and return the
    JSON that rank 0 wrote to ``cfg["result"]``. A failed rank raises with the end of its log."""
    world, per_node = cfg["world"], cfg["ranks_per_node"]
    addr, port, ifname = ("127.0.0.1", free_port(), "lo") if cluster is None else \
        (cluster.addresses[0], MASTER_PORT_IN_NAMESPACE, cluster.ifname)
    cfg_path = workdir / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    procs = []
    try:
        for r in range(world):
            cmd = [sys.executable, script, "--rank-config", str(cfg_path)]
            if cluster is not None:
                cmd = ["ip", "netns", "exec", cluster.nodes[r // per_node]] + cmd
            env = {**os.environ, **rank_env(r, world, per_node, addr, port, ifname)}
            with open(workdir / f"rank{r}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + cfg["timeout_s"]
        for r, p in enumerate(procs):
            if p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"rank {r} failed:\n{(workdir / f'rank{r}.log').read_text()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return json.loads(Path(cfg["result"]).read_text())
