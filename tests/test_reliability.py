"""A rank that stops (SIGSTOP: a stuck host) never hangs the others: on 4 gloo ranks, rank 3 stops at a random
point (an MoE all-to-all in forward or in backward, a PipeMoE chunk, Parm's SAA, a Lina micro-op, Hecate's early
re-gather, an exchange of Lancet's batch partitions), and every other rank exits non-zero within twice the process group's timeout, its error naming where
it was.

The ranks are plain processes (tests/workers/stall.py), not the test pool. The points' op counts are drawn
from a seeded generator; the seed is printed (STALL_SEED replays it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORLD, VICTIM = 4, 3
TIMEOUT_S = 6.0                    # the process group's timeout (the recipes' --dist-timeout); 60 s in the issue
SEED = int(os.environ.get("STALL_SEED", random.SystemRandom().randrange(10_000)))
print(f"test_reliability: STALL_SEED={SEED}")
RECIPE_TIMEOUT_S = float(os.environ.get("STALL_RECIPE_TIMEOUT_S", "10"))   # the figure: 60
LAST_OP = {"forward": 12, "backward": 12, "pipemoe": 30, "saa": 8, "lina": 12, "regather": 12,
           "partitions": 24}                                                                  # stop at op 1..


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(point: str, nth: int, out: Path, cmd: Optional[List[str]] = None) -> List[subprocess.Popen]:
    """Four plain processes (two "nodes" of two) of tests/workers/stall.py, or of ``cmd``."""
    port = _free_port()
    procs = []
    cmd = cmd or ["-m", "tests.workers.stall", "--point", point, "--nth", str(nth), "--victim", str(VICTIM),
                  "--timeout", str(TIMEOUT_S), "--out", str(out)]
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % 2),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def _watch(procs: List[subprocess.Popen], out: Path, limit_s: float) -> Dict[int, float]:
    """Exit times of the survivors (time.time()), once all exited or ``limit_s`` after the victim stopped."""
    start, exits = time.time(), {}
    while time.time() - start < 240:
        for rank, proc in enumerate(procs):
            if rank != VICTIM and rank not in exits and proc.poll() is not None:
                exits[rank] = time.time()
        stopped = out / "stopped"
        if len(exits) == WORLD - 1:
            return exits
        if stopped.exists() and stopped.read_text() and time.time() > float(stopped.read_text()) + limit_s:
            return exits
        time.sleep(0.1)
    return exits


def _survivors_failed(procs: List[subprocess.Popen], out: Path, timeout: float, what: str) -> Dict[int, str]:
    """Every rank but the victim exited non-zero within twice ``timeout`` of the victim's stop; their logs."""
    exits = _watch(procs, out, 2 * timeout + 5)
    logs = {r: (out / f"rank{r}.log").read_text() for r in range(WORLD)}
    where = f"{what} (STALL_SEED={SEED}); logs:\n" + "\n".join(
        f"--- rank {r}\n{text[-1500:]}" for r, text in logs.items())
    assert (out / "stopped").exists(), "the victim never reached its stop point: " + where
    stopped = float((out / "stopped").read_text())
    assert sorted(exits) == [r for r in range(WORLD) if r != VICTIM], "a survivor hung: " + where
    for rank, at in exits.items():
        assert procs[rank].returncode != 0, f"rank {rank} exited 0: " + where
        assert at - stopped <= 2 * timeout, f"rank {rank} took {at - stopped:.1f} s: " + where
    return logs


_OTHER_OPS = pytest.mark.full(covered_by="[forward], [backward] and [lina] (the same engine timeout on another "
                                         "schedule's ops), test_engine.py::test_a_failed_op_raises_on_every_rank_"
                                         "without_hanging")


@pytest.mark.parametrize("point", ["forward", "backward", "lina"] + [
    pytest.param(point, marks=_OTHER_OPS) for point in ("pipemoe", "saa", "regather", "partitions")])
def test_a_stopped_rank_makes_every_other_rank_fail_within_twice_the_timeout(tmp_path, point):
    nth = random.Random(f"{SEED}-{point}").randint(1, LAST_OP[point])
    procs = _launch(point, nth, tmp_path)
    try:
        logs = _survivors_failed(procs, tmp_path, TIMEOUT_S, f"point {point}, op {nth}")
        survivors = [r for r in range(WORLD) if r != VICTIM]
        errors = {r: json.loads((tmp_path / f"rank{r}.json").read_text())["error"] for r in survivors}
        assert all(e and e.startswith("CommError") for e in errors.values()), errors
        # the last line each survivor wrote is its error, which says where it was
        for rank in survivors:
            last = logs[rank].strip().splitlines()[-1].removeprefix(f"[rank{rank}]: ")    # torch's elastic prefix
            assert last.startswith("moe_plugins.core.ops.CommError"), logs[rank][-1500:]
        if point == "lina":
            assert any("background lane" in e for e in errors.values()), errors
        else:
            named = [e for e in errors.values() if "layer 'moe'" in e and f"schedule '{_schedule(point)}'" in e]
            assert named and all(("all_to_all@" in e or "SAA" in e or "all_gather@" in e or "spag@" in e)
                                 for e in named), errors
            if point == "saa":
                assert any("SAA" in e for e in errors.values()), errors
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()


def _schedule(point: str) -> str:
    return {"saa": "parm-s2-saa", "regather": "hecate"}.get(point, "baseline")


def test_the_deepspeed_recipe_with_dist_timeout_fails_fast_when_a_rank_stops(tmp_path):
    """The recipe's --dist-timeout (the process group's timeout, which the plugin's groups take): rank 3 stops in
    a forward all-to-all of the plugin's layer; its EP peer fails there naming the layer and the schedule, the
    other node's ranks in DeepSpeed's gradient all-reduce; all exit non-zero within twice the timeout."""
    timeout = RECIPE_TIMEOUT_S
    nth = random.Random(f"{SEED}-recipe").randint(3, 12)
    config = ROOT / "recipes" / "configs" / "gpt2_moe_tiny.json"
    cmd = ["-m", "tests.workers.stall_recipe", "forward", str(nth), str(tmp_path), "--", "--ds-config",
           str(config), "--max-chars", "60000", "--steps", "40", "--dist-timeout", str(timeout),
           "--out", str(tmp_path / "run")]
    procs = _launch("forward", nth, tmp_path, cmd)
    try:
        logs = _survivors_failed(procs, tmp_path, timeout, f"recipe, op {nth}")
        where = logs[2][-1500:]
        peer = logs[2].strip().splitlines()[-1].removeprefix("[rank2]: ")      # rank 3's EP peer (EP 2)
        assert peer.startswith("moe_plugins.core.ops.CommError") and "schedule 'baseline'" in peer, where
        assert "all_to_all@ep" in peer and "layer 'transformer.h." in peer, where
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()


def test_a_killed_rank_under_two_torchrun_nodes_takes_the_job_down(tmp_path):
    """Regression: SIGKILL of one worker of two torchrun "nodes" (2 x 2, the DeepSpeed recipe, plugin on):
    every worker and both agents exit, non-zero, within a few seconds (connections reset; no timeout needed)."""
    config = ROOT / "recipes" / "configs" / "gpt2_moe_tiny.json"
    port, out = _free_port(), tmp_path / "run"
    agents = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "moe_plugins.recipes.train_deepspeed", "--ds-config", str(config), "--max-chars", "60000",
               "--steps", "200", "--out", str(out)]
        log = open(tmp_path / f"node{node}.log", "w")
        agents.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True))
    import psutil
    try:
        deadline = time.time() + 240
        steps = out / "steps.jsonl"
        while time.time() < deadline and not (steps.exists() and len(steps.read_text().splitlines()) >= 3):
            assert all(a.poll() is None for a in agents), (tmp_path / "node0.log").read_text()[-2000:]
            time.sleep(0.5)
        workers = [w for a in agents for w in psutil.Process(a.pid).children(recursive=True)]
        assert len(workers) >= 4, workers
        victim = psutil.Process(agents[1].pid).children()[-1]
        killed = time.time()
        victim.send_signal(signal.SIGKILL)
        agent_procs = [psutil.Process(a.pid) for a in agents]
        _, alive = psutil.wait_procs(workers + agent_procs, timeout=60)       # reaps them: codes from psutil
        took = time.time() - killed
        assert not alive, f"still running {took:.0f} s after the kill: {alive}"
        codes = [p.returncode for p in agent_procs]
        assert all(code != 0 for code in codes), codes
        print(f"every process exited {took:.1f} s after the kill")
        assert took <= 15, took
    finally:
        for a in agents:
            if a.poll() is None:
                for p in psutil.Process(a.pid).children(recursive=True) + [psutil.Process(a.pid)]:
                    p.send_signal(signal.SIGKILL)
                a.wait()


def test_a_pool_job_whose_result_cannot_be_sent_fails_at_once(world):
    """The test pool pickles each rank's result before queueing it: in the queue's feeder thread a pickling error
    was printed and the result lost, so the parent waited out its whole timeout (a hang seen in session 32). Now
    the job fails with pickle's message at once, and the pool runs the next job."""
    from moe_plugins.tools.pool import WorkerError
    from tests.workers import pool_jobs
    start = time.monotonic()
    with pytest.raises(WorkerError, match="cannot pickle '_thread.lock' object"):
        world(2).run(pool_jobs.unsendable, timeout_s=300)
    assert time.monotonic() - start < 60
    assert world(2).run(pool_jobs.rank) == [0, 1]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open file descriptors in /proc")
def test_pool_results_leave_no_file_descriptor_behind(world):
    """Results cross the pool as plain pickle bytes, tensors by value: multiprocessing's pickler moved each
    returned tensor into shared memory and kept a duplicated descriptor of it open in the worker for the pool's
    life (200 tensors: 211 descriptors more, and their memory, before session 38). The values arrive intact."""
    from tests.workers import pool_jobs
    before = world(2).run(pool_jobs.open_fds)
    for _ in range(5):
        got = world(2).run(pool_jobs.tensors, 40)
    assert all(torch.equal(got[r][i], torch.full((64,), float(r * 1000 + i))) for r in range(2) for i in range(40))
    after = world(2).run(pool_jobs.open_fds)
    assert all(a <= b + 2 for a, b in zip(after, before)), (before, after)


def test_pool_sends_a_view_with_its_own_elements_only():
    """torch pickles a tensor with its whole storage: 50 views of 100 elements of a 4 MB buffer would be 200 MB;
    the pool sends each view's own elements (and a Parameter as a Parameter, requires_grad kept)."""
    import pickle
    from moe_plugins.tools.pool import to_bytes
    buffer = torch.randn(1_000_000)
    views = {i: buffer[i * 100:(i + 1) * 100] for i in range(50)}
    sent = to_bytes(views)
    assert len(sent) < 200_000, len(sent)
    back = pickle.loads(sent)
    assert all(torch.equal(back[i], views[i]) for i in views)
    param = torch.nn.Parameter(torch.randn(10))
    got = pickle.loads(to_bytes({"param": param, "view": param[2:5], "whole": buffer}))
    assert type(got["param"]) is torch.nn.Parameter and got["view"].requires_grad and got["view"].numel() == 3
    assert torch.equal(got["whole"], buffer) and torch.equal(got["view"], param[2:5].detach())


def test_a_pool_worker_that_dies_is_named_with_its_exit_code(world):
    """A worker process that dies without reporting (a crash, a kill) is named with its exit code within seconds,
    not after the job's timeout (before, a rank lost in session 34's clean run was reported as "timed out after
    1800 s", which it was not); the pool runs the next job."""
    from moe_plugins.tools.pool import WorkerError
    from tests.workers import pool_jobs
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"--- rank 1 ---\nworker process exited with code 7"):
        world(2).run(pool_jobs.dies_on_rank_1, timeout_s=300)
    assert time.monotonic() - start < 60
    assert world(2).run(pool_jobs.rank) == [0, 1]
