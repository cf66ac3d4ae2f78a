"""The communication engine: priorities and the hold-back rule (checked on the recorded timeline), issue
order, no hang under random delays, failure on every rank in bounded time, refusals, and the Chrome trace
of ``moe-plugins verify --timeline``."""

import json
import subprocess
import sys
import threading
import time
from collections import defaultdict

import pytest
import torch

from moe_plugins.core.comm import Recorder, all_to_all
from moe_plugins.core.config import MoEConfig
from moe_plugins.core.engine import BACKGROUND, PIPELINE, CommEngine, CommError
from moe_plugins.core.groups import Group, MoEProcessGroups
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.layout import GROUP_KINDS, ParallelLayout
from moe_plugins.core.ledger import CommRecord
from moe_plugins.core.timeline import chrome_trace
from tests.workers.engine import failing_background, mixed_rounds


def one_rank_groups() -> MoEProcessGroups:
    """The groups of a 1-rank layout, without process groups (ops on them exchange nothing)."""
    layout = ParallelLayout(world=1, ranks_per_node=1)
    made = {k: Group(kind=k, ranks=(0,), pg=None, rank=0, remote_peers=0) for k in GROUP_KINDS}
    return MoEProcessGroups(layout=layout, global_rank=0, **made)


# ---- one process ---------------------------------------------------------------------------------------------

def test_inline_engine_refuses_lanes_it_was_not_built_with():
    engine, groups = CommEngine(), one_rank_groups()
    with pytest.raises(CommError, match=r"no background lane: build it with build_engine\(groups, background=True\)"):
        engine.issue("all_reduce", groups.dp, torch.ones(2), priority=BACKGROUND)
    with pytest.raises(CommError, match=r"no pipeline lane: build it with build_engine\(groups, pipeline=True\)"):
        engine.submit(print, lane=PIPELINE)
    with pytest.raises(ValueError, match=r"op \('all_to_none'\) must be one of .*; priority \('soon'\) must be"):
        engine.issue("all_to_none", groups.ep, torch.ones(2), priority="soon")


def test_hold_keeps_background_back_and_refuses_waiting_inside_it():
    groups = one_rank_groups()
    engine = CommEngine({BACKGROUND: groups})
    try:
        with engine.hold():
            handle = engine.issue("all_reduce", groups.dp, torch.ones(3), priority=BACKGROUND)
            time.sleep(0.05)
            assert not handle.done()
            with pytest.raises(CommError, match="inside this thread's hold"):
                handle.wait()
        assert torch.equal(handle.wait(timeout_s=10), torch.ones(3))
    finally:
        engine.close()


def test_expect_urgent_holds_background_until_the_next_urgent_op_and_yields_false_does_not_wait():
    groups = one_rank_groups()
    engine = CommEngine({BACKGROUND: groups}, record_timeline=True)
    try:
        engine.expect_urgent()
        held = engine.issue("all_reduce", groups.dp, torch.ones(3), priority=BACKGROUND, layer="held")
        time.sleep(0.05)
        assert not held.done()                      # the expectation holds it back...
        with engine.hold():                         # ...and so does a hold, but a non-yielding op goes anyway
            fifo = engine.issue("all_reduce", groups.dp, torch.ones(2), priority=BACKGROUND, yields=False)
            time.sleep(0.05)
            assert not held.done()                  # FIFO: the non-yielding op queues behind the held one
        urgent = engine.issue("all_to_all", groups.ep, torch.ones(4), layer="exchange")    # ends the expectation
        assert torch.equal(held.wait(timeout_s=10), torch.ones(3)) and torch.equal(fifo.wait(timeout_s=10), torch.ones(2))
        assert urgent.done()
        # an expectation that no urgent op follows ends when its thread waits for background work: no hang
        engine.expect_urgent()
        late = engine.issue("all_reduce", groups.dp, torch.ones(1), priority=BACKGROUND)
        assert torch.equal(late.wait(timeout_s=10), torch.ones(1))
        with engine.hold():
            go = engine.issue("all_reduce", groups.dp, torch.ones(1), priority=BACKGROUND, yields=False)
            for _ in range(200):                    # it runs beside the hold, in its FIFO turn
                if go.done():
                    break
                time.sleep(0.01)
            assert go.done()
        assert torch.equal(go.wait(timeout_s=10), torch.ones(1))
    finally:
        engine.close()


def test_a_layer_output_marks_its_backward_exchange():
    groups = one_rank_groups()
    engine = CommEngine({BACKGROUND: groups})
    try:
        x = torch.ones(3, requires_grad=True)
        y = x * 2                                   # the layer's output; x stands for its backward's inside
        engine.mark_backward_exchange(y)
        bg = []

        def backward_hook(grad):                    # x's gradient comes after y's: the expectation is in place
            bg.append(engine.issue("all_reduce", groups.dp, torch.ones(1), priority=BACKGROUND))
            time.sleep(0.05)
            bg.append(bg[0].done())
            engine.issue("all_to_all", groups.ep, torch.ones(2))      # the exchange: the expectation ends
            return grad
        x.register_hook(backward_hook)
        y.sum().backward()
        assert bg[1] is False and torch.equal(bg[0].wait(timeout_s=10), torch.ones(1))
        CommEngine().mark_backward_exchange(torch.ones(2, requires_grad=True))     # no background lane: nothing
    finally:
        engine.close()


def test_cuda_path_issues_a_waited_op_held_back_by_another_threads_expectation(monkeypatch):
    """Found on a GPU (benchmarks/results/gpu-h200.md): CUDA's autograd runs backward on its own thread, so the
    expectation a layer's combine sets is that thread's; with EP = 1 no urgent op ends it, and the main thread's
    wait on Lina's reduction hung (no lane thread issues deferred ops on CUDA). Now a wait issues the op and
    every one queued before it, in FIFO order. The CUDA stream is the one thing replaced (this machine has none):
    the lane runs each job at once, in issue order."""
    from moe_plugins.core.ops import Lane
    order = []

    def run_without_stream(lane, job, on_error):
        order.append(job.handle.what)
        job.handle._finish(job.run(job))
    monkeypatch.setattr(Lane, "run_on_stream", run_without_stream)
    groups = one_rank_groups()
    engine = CommEngine({BACKGROUND: groups}, cuda=True)
    try:
        backward = threading.Thread(target=engine.expect_urgent)   # the autograd thread reaches a combine
        backward.start()
        backward.join()
        first = engine.issue("all_reduce", groups.dp, torch.ones(2), priority=BACKGROUND, layer="a")
        second = engine.issue("all_reduce", groups.dp, torch.ones(3), priority=BACKGROUND, layer="b")
        assert not first.done() and not second.done() and order == []      # held back: an urgent op is expected
        assert torch.equal(second.wait(timeout_s=5), torch.ones(3))         # the waiter needs it: issued now
        assert first.done() and [w.split("'")[1] for w in order] == ["a", "b"]
        third = engine.issue("all_reduce", groups.dp, torch.ones(1), priority=BACKGROUND, layer="c")
        assert not third.done()                     # the other thread's expectation still holds the rest back
        engine.issue("all_to_all", groups.ep, torch.ones(2))   # this thread's urgent op: not the expecting thread's
        assert not third.done()
        assert torch.equal(third.wait(timeout_s=5), torch.ones(1))
    finally:
        engine.close()


def test_a_failure_poisons_the_engine():
    groups = one_rank_groups()
    engine = CommEngine({BACKGROUND: groups})
    try:
        failed = engine.submit(_raise, lane=BACKGROUND)
        with pytest.raises(RuntimeError, match="bucket 3 broke"):
            failed.wait(timeout_s=10)
        with pytest.raises(CommError, match="poisoned by an earlier failure: RuntimeError\\('bucket 3 broke'\\)"):
            engine.issue("all_reduce", groups.dp, torch.ones(2))
    finally:
        engine.close()


def _raise():
    raise RuntimeError("bucket 3 broke")


def test_recorder_without_engine_is_inline_and_layers_build_no_groups():
    rec = Recorder(None, "l0")
    assert isinstance(rec.engine, CommEngine) and Recorder(None, "l0") == rec
    x = torch.ones(4, 2)
    assert all_to_all(x, one_rank_groups().ep, rec) is x          # a group of one: nothing issued
    config = MoEConfig(hidden=4, ffn=8, num_experts=2, k=1)
    with pytest.raises(ValueError, match=r"pipeline_degree \(2\) needs executor="):
        MoELayer(config, one_rank_groups(), pipeline_degree=2)


def test_chrome_trace_of_records():
    rec = CommRecord(layer="moe", op="all_to_all", group="ep", group_ranks=(0, 1), numel=4, bytes=32,
                     inter_node_bytes=16, phase="forward", lane="pipeline", rank=1, issue_ns=1_000, start_ns=3_000,
                     end_ns=7_000)
    trace = chrome_trace([[], [rec, CommRecord(layer="l", op="x", group="g", group_ranks=(), numel=0, bytes=0,
                                               inter_node_bytes=0, phase="forward")]])
    (event,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert event == {"name": "all_to_all@ep", "cat": "urgent", "ph": "X", "ts": 0.0, "dur": 4.0, "pid": 1, "tid": 1,
                     "args": {"group": "ep", "group_ranks": [0, 1], "phase": "forward", "bytes": 32,
                              "inter_node_bytes": 16, "layer": "moe", "priority": "urgent", "queued_us": 2.0}}


# ---- gloo ranks ----------------------------------------------------------------------------------------------

def _by_rank(timeline):
    ranks = defaultdict(list)
    for r in timeline:
        ranks[r["rank"]].append(r)
    return ranks


def _check_hold_back(records) -> int:
    """No background op starts inside an urgent op's [issue, end]; returns how many waited for one."""
    urgent = [r for r in records if r["priority"] == "urgent"]
    held = 0
    for b in (r for r in records if r["priority"] == "background"):
        inside = [u["layer"] for u in urgent if u["issue_ns"] <= b["start_ns"] <= u["end_ns"]]
        assert not inside, f"background {b['layer']} started while urgent {inside} were pending or in flight"
        held += any(b["issue_ns"] < u["end_ns"] <= b["start_ns"] for u in urgent)
    return held


@pytest.mark.parametrize("size", [2, 4])
def test_background_never_starts_beside_urgent_and_order_is_kept(world, size):
    results = world(size).run(mixed_rounds, size, 12, 1, 0.004, timeout_s=120)
    held = 0
    for rank, res in enumerate(results):
        assert res["errors"] == []
        records = res["timeline"]
        assert {r["rank"] for r in records} == {rank}
        held += _check_hold_back(records)
        for lane in ("main", "pipeline", "background"):      # each lane runs its ops in issue order, one by one
            ops = sorted((r for r in records if r["lane"] == lane), key=lambda r: r["issue_ns"])
            assert [int(r["layer"][1:]) for r in ops] == sorted(int(r["layer"][1:]) for r in ops)
            assert all(a["end_ns"] <= b["start_ns"] for a, b in zip(ops, ops[1:])), lane
        assert {r["lane"] for r in records} == {"main", "pipeline", "background"}
    assert held > 0, "no background op ever waited for an urgent one: the test exercised nothing"


def test_fifty_mixed_rounds_with_random_delays_finish(world):
    start = time.monotonic()
    results = world(4).run(mixed_rounds, 4, 50, 7, 0.003, timeout_s=120)
    for res in results:
        assert res["errors"] == []
        _check_hold_back(res["timeline"])
        assert sum(r["priority"] == "background" for r in res["timeline"]) == 50
    assert time.monotonic() - start < 60


def test_a_failed_op_raises_on_every_rank_without_hanging(world):
    start = time.monotonic()
    results = world(4).run(failing_background, 4, 3.0, timeout_s=90)
    assert time.monotonic() - start < 60
    assert results[0]["waited"] == "raised RuntimeError: injected failure on rank 0"
    for res in results:
        assert res["waited"].startswith("raised"), res          # not "returned", not "hung"
        assert res["again"].startswith("communication engine poisoned by an earlier failure"), res
    assert "injected failure on rank 0" in results[0]["again"]


# ---- moe-plugins verify --timeline --------------------------------------------------------------------------

def test_verify_writes_a_chrome_trace(tmp_path):
    out = tmp_path / "trace" / "out.json"
    proc = subprocess.run([sys.executable, "-m", "moe_plugins.tools.cli", "verify", "--world", "4", "--mp", "2",
                           "--ep", "2", "--esp", "2", "--k", "2", "--timeline", str(out), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "timeline" not in json.loads(proc.stdout)
    events = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    for e in events:
        assert e["ts"] >= 0 and e["dur"] >= 0 and e["tid"] == 0 and e["args"]["priority"] == "urgent"
        assert e["args"]["layer"] == "moe" and e["args"]["bytes"] > 0
    for rank in range(4):
        mine = {(e["name"], e["args"]["phase"]) for e in events if e["pid"] == rank}
        assert mine == {(f"{op}@{group}", phase) for phase in ("forward", "backward")
                        for op, group in (("all_gather", "esp"), ("all_to_all", "ep"), ("all_reduce", "esp"))}
        a2a = sorted((e for e in events if e["pid"] == rank and e["name"] == "all_to_all@ep"), key=lambda e: e["ts"])
        assert [e["args"]["phase"] for e in a2a] == ["forward", "forward", "backward", "backward"]


def test_verify_timeline_needs_the_core_host():
    proc = subprocess.run([sys.executable, "-m", "moe_plugins.tools.cli", "verify", "--host", "deepspeed",
                           "--timeline", "x.json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--timeline needs --host core (got 'deepspeed')" in proc.stderr
