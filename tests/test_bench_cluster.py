"""The emulated cluster for real: namespaces, a tbf-shaped bridge, ranks launched inside the nodes, and a
teardown that leaves nothing behind (also on error). Skipped, with the reason, where network namespaces
are unavailable (not root, no iproute2, no netns support)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from moe_plugins.tools.bench import cluster
from moe_plugins.tools.bench.cluster import ClusterSpec, emulated_cluster
from moe_plugins.tools.bench.harness import RunOptions, run_bench
from moe_plugins.tools.bench.matrix import BenchPlan, CaseConfig, RowSpec

REASON = cluster.netns_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")


def _mine():
    """Namespaces this test process created (their names carry its pid)."""
    return [ns for ns in cluster.list_namespaces() if cluster.owner_pid(ns) == os.getpid()]


def test_link_is_shaped_and_teardown_is_complete():
    """2.5 MB through a 20 Mbit/s link cannot take less than ~1 s (minus tbf's 128 KiB bucket)."""
    server = ("import socket\ns = socket.socket(); s.bind(('10.99.0.2', 5001)); s.listen(); c, _ = s.accept()\n"
              "while c.recv(1 << 20): pass\n")
    client = "import socket\ns = socket.create_connection(('10.99.0.2', 5001)); s.sendall(b'x' * 2_500_000); s.close()"
    with emulated_cluster(ClusterSpec(nodes=2)) as c:
        assert set(_mine()) == set(c.namespaces)
        assert [cluster.congestion_control_of(ns) for ns in c.nodes] == ["reno", "reno"]
        cluster.set_rate(c, "20mbit")
        srv = subprocess.Popen(["ip", "netns", "exec", c.nodes[1], sys.executable, "-c", server])
        try:
            time.sleep(1.0)
            t0 = time.monotonic()
            subprocess.run(["ip", "netns", "exec", c.nodes[0], sys.executable, "-c", client], check=True, timeout=60)
            srv.wait(timeout=60)
            elapsed = time.monotonic() - t0
        finally:
            if srv.poll() is None:
                srv.kill()
        assert elapsed >= 0.8, f"2.5 MB crossed a 20 Mbit/s link in {elapsed:.2f} s: not shaped"
    assert _mine() == []


def test_teardown_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with emulated_cluster(ClusterSpec(nodes=3)) as c:
            assert len(c.nodes) == 3 and set(_mine()) == set(c.namespaces)
            raise RuntimeError("boom")
    assert _mine() == []


def test_tiny_bench_on_two_emulated_nodes(tmp_path):
    plan = BenchPlan(nodes=2, ranks_per_node=2, rates=("100mbit",), iters=2, warmup=1,
                     cases=(CaseConfig(tokens=64, hidden=16, ffn=32, experts=4, k=2, ep=4),),
                     rows=(RowSpec(name="baseline"),), collective_timeout_s=120)
    rep = run_bench(plan, RunOptions(out_dir=tmp_path, mode="netns", timeout_s=300, progress=False,
                                     timeline=tmp_path / "trace.json"))
    assert _mine() == []
    # the timeline: every rank's engine ops of the plugin row, each with a start and a duration; the baseline
    # exchanges are all-to-alls on the EP group, forward and backward, once per round (check, warm-up, timed)
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    a2a = [e for e in events if e["name"] == "all_to_all@ep"]
    assert {e["args"]["phase"] for e in a2a} == {"forward", "backward"}
    assert all(e["args"]["group_ranks"] == [0, 1, 2, 3] and e["cat"] == "urgent" for e in a2a)
    per_rank = {pid: sum(e["pid"] == pid for e in a2a) for pid in range(4)}
    assert len(set(per_rank.values())) == 1 and per_rank[0] >= 4 * 3
    assert rep["meta"]["netns"] is True and "emulated cluster" in rep["meta"]["header_lines"][0]
    row = rep["groups"][0]["rows"]["baseline"]
    assert row["n"] == 2 and row["median_ms"] > 0
    # the ledger's bytes (4 all-to-alls, half of each buffer remote) bound what the NIC really sent from below
    model_mb = 2 * (4 * (4 * 32 * 16 * 4) // 2) / 1e6
    assert row["model_MB_per_node"] == pytest.approx(model_mb)
    assert row["nic_MB_per_node"] >= model_mb
    assert row["link_lb_ms"] == pytest.approx(model_mb * 8 / 100 * 1e3)      # Mbit / (Mbit/s), in ms
    assert {p.rsplit(".", 1)[-1] for p in rep["files"]} == {"json", "md", "png"}
    assert str(tmp_path / "trace.json") in rep["files"]
