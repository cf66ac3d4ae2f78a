"""The training-step contention bench (issue #23): its pure parts (plan and row parsing, per-op all-to-all
times, slowdowns and their CDF, bytes per node, the wire check, the targets, the report) and one short run of
the whole path on the emulated cluster (loopback, labelled, where namespaces are unavailable)."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest

from moe_plugins.lina.microops import micro_op_bytes
from moe_plugins.tools.bench import cluster
from moe_plugins.tools.bench.harness import RunOptions
from moe_plugins.tools.bench.lina_plan import (STEP_PRESETS, STEP_ROW_KINDS, StepModel, StepPlan, bucket_bytes_of,
                                               dense_bytes, exchange_bytes, micro_op_bytes_of, parse_model,
                                               parse_step_row, step_plan_problems, step_row_problems)
from moe_plugins.tools.bench.lina_hosts import lina_section
from moe_plugins.tools.bench.lina_plots import timeline_bars
from moe_plugins.tools.bench.lina_report import markdown_step, run_step_bench, sweep_lines
from moe_plugins.tools.bench.lina_stats import (cdf, node_bytes, op_times_ms, per_op_median, slowdowns,
                                                summarize_rate, targets, wire_check)
from moe_plugins.tools.cli.bench_cmd import is_step_bench, plan_from_args, register, step_plan_from_args


# ---- plan and rows ----------------------------------------------------------------------------------------

def test_parse_model_keeps_defaults_and_names_bad_keys():
    m = parse_model("L=2,S=64,F=128")
    assert (m.blocks, m.tokens, m.dense_ffn, m.hidden) == (2, 64, 128, StepModel().hidden)
    with pytest.raises(ValueError, match=r"'Q=1' is not KEY=VALUE.*S \('x'\) must be an int"):
        parse_model("Q=1,S=x")


def test_sizes_by_hand():
    m = StepModel(blocks=2, tokens=8, hidden=4, ffn=6, experts=4, k=2, capacity_factor=1.0, dense_ffn=3)
    # 3 dense pairs of (2*4*3 weights + 3 + 4 biases) and 2 gates of 4 x 4, fp32
    assert dense_bytes(m) == (3 * (24 + 7) + 2 * 16) * 4
    # capacity ceil(2 * 1 * 8 / 4) = 4 slots per expert, 4 experts, 4 wide
    assert exchange_bytes(m) == 4 * 4 * 4 * 4


def test_rows_parse_and_sizes():
    assert parse_step_row("lina@kib=64").label == "lina@kib=64"
    assert micro_op_bytes_of(parse_step_row("lina@kib=64")) == 64 * 1024
    assert micro_op_bytes_of(parse_step_row("lina@mb=0.25")) == 250_000
    host = parse_step_row("megatron@lina")
    assert host.options == (("lina", "on"),) and host.label == "megatron@lina"
    assert step_row_problems(host) == ["row 'megatron@lina': give the micro-op size as exactly one of kib=N or mb=X"]
    assert step_row_problems(parse_step_row("deepspeed@lina,kib=128")) == []
    assert micro_op_bytes(lina_section(parse_step_row("deepspeed@lina,kib=249"))["micro_op_mb"]) == 249 * 1024
    assert lina_section(parse_step_row("megatron@bucket_mb=1")) is None
    assert bucket_bytes_of(parse_step_row("fifo")) == 0
    assert bucket_bytes_of(parse_step_row("fifo@bucket_mb=2")) == 2_000_000
    for text, message in (("lina", "exactly one of kib=N or mb=X"), ("lina@kib=1,mb=1", "exactly one"),
                          ("lina@kib=0", "must be > 0"), ("lina@kib=x", "kib must be an integer")):
        with pytest.raises(ValueError, match=message):
            micro_op_bytes_of(parse_step_row(text))
    with pytest.raises(ValueError, match="option 'kib=' must be key=value"):
        parse_step_row("lina@kib=")


def test_plan_problems_are_listed_together():
    plan = StepPlan(nodes=2, ranks_per_node=2, model=StepModel(experts=6),
                    rows=tuple(map(parse_step_row, ("sync", "sync", "fifo@kib=4", "horovod", "lina", "deepspeed@kib=8",
                                                    "megatron@lina,kib=1", "megatron@lina,kib=2"))),
                    rates=("fast",))
    text = "; ".join(step_plan_problems(plan))
    for part in ("model.experts (6) must be divisible by the world size (4)", "row 'sync' is listed twice",
                 "rows must include 'noreduce'", "row 'fifo@kib=4': option(s) kib not among ['bucket_mb']",
                 "row 'horovod': unknown; known rows: sync, fifo, lina, noreduce, deepspeed, megatron",
                 "exactly one of kib=N", "row 'deepspeed@kib=8': kib / mb size Lina's micro-ops: add lina",
                 "at most one megatron@lina row per run", "rate ('fast')"):
        assert part in text
    good = StepPlan(nodes=2, ranks_per_node=2, model=parse_model(STEP_PRESETS["lina"]["model"]),
                    rows=tuple(map(parse_step_row, STEP_PRESETS["lina"]["rows"])), rates=("200mbit", "1gbit"))
    assert step_plan_problems(good) == []


def test_every_row_kind_has_an_importable_builder():
    for name, kind in STEP_ROW_KINDS.items():
        module, _, function = kind.build.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name


def test_preset_sweeps_micro_ops_from_64_kib_to_4_mib():
    sizes = sorted(micro_op_bytes_of(parse_step_row(r)) for r in STEP_PRESETS["lina"]["rows"] if r.startswith("lina"))
    assert sizes[0] == 64 * 1024 and sizes[-1] == 4 * 1024 * 1024 and len(sizes) == len(set(sizes)) >= 5


def _args(*argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_cli_builds_step_plans_and_keeps_the_layer_bench():
    args = _args("--preset", "lina", "--rates", "1gbit", "--iters", "3")
    assert is_step_bench(args)
    plan = step_plan_from_args(args)
    assert plan.rates == ("1gbit",) and plan.iters == 3 and plan.model == parse_model(STEP_PRESETS["lina"]["model"])
    assert is_step_bench(_args("--step-model", "L=1", "--rows", "noreduce", "--rates", "1gbit"))
    with pytest.raises(ValueError, match="--case does not apply to the training-step bench"):
        step_plan_from_args(_args("--preset", "lina", "--case", "S=1,M=1,H=1,E=1"))
    with pytest.raises(ValueError, match=r"preset \('committed'\) is not a training-step preset \(lina, lina-smoke\)"):
        step_plan_from_args(_args("--preset", "committed", "--step-model", "L=1"))
    layer = _args("--preset", "committed")
    assert not is_step_bench(layer) and plan_from_args(layer).rows[0].name == "baseline"


# ---- statistics ---------------------------------------------------------------------------------------------

def test_op_time_is_last_entry_to_last_exit():
    # two ranks, one step, two ops; rank 1 enters op 0 late (at 5) and op 1 early
    per_rank = [[[(0, 10_000_000), (20_000_000, 30_000_000)]],
                [[(5_000_000, 12_000_000), (18_000_000, 29_000_000)]]]
    assert op_times_ms(per_rank) == [[pytest.approx(7.0), pytest.approx(10.0)]]
    with pytest.raises(ValueError, match="different numbers of backward all-to-alls"):
        op_times_ms([[[(0, 1)]], [[(0, 1), (2, 3)]]])
    with pytest.raises(ValueError, match="different step counts"):
        op_times_ms([[[(0, 1)]], []])


def test_slowdowns_are_per_op_over_the_reference_median():
    ref = per_op_median([[10.0, 20.0], [12.0, 20.0], [14.0, 40.0]])
    assert ref == [12.0, 20.0]
    assert slowdowns([[24.0, 20.0], [12.0, 30.0]], ref) == [2.0, 1.0, 1.0, 1.5]
    with pytest.raises(ValueError, match="the reference 2"):
        slowdowns([[1.0]], ref)
    xs, ys = cdf([3.0, 1.0, 2.0, 2.0])
    assert xs == [1.0, 2.0, 2.0, 3.0] and ys == [0.25, 0.5, 0.75, 1.0]


def test_node_bytes_first_and_sum():
    per_rank = [[100, 110, 120], [100, 110, 120], [50, 60, 70], [1, 2, 3]]     # 2 nodes of 2 ranks, 3 steps
    assert node_bytes(per_rank, 2, "first") == 110       # node 0's counter, median over steps
    assert node_bytes(per_rank, 2, "sum") == 220
    assert node_bytes([[None], [1]], 1, "first") is None
    with pytest.raises(ValueError, match="mode"):
        node_bytes(per_rank, 2, "max")


def test_wire_check_flags_rows_that_move_other_bytes():
    kinds = {"sync": "sync", "fifo": "fifo", "lina@kib=64": "lina", "noreduce": "noreduce"}
    check = wire_check({"sync": 10.0, "fifo": 10.1, "lina@kib=64": 10.5, "noreduce": 4.0}, kinds)
    assert check["reference"] == "sync" and check["flagged"] == ["lina@kib=64"]
    assert "noreduce" not in check["ratios"]
    assert wire_check({k: None for k in kinds}, kinds)["reference"] is None


def _rows(fifo_slow, lina_slow, fifo_ms, lina_ms):
    return {"fifo": {"kind": "fifo", "a2a_slowdown_median": fifo_slow, "median_ms": fifo_ms},
            "lina@kib=64": {"kind": "lina", "a2a_slowdown_median": lina_slow, "median_ms": lina_ms},
            "lina@kib=1024": {"kind": "lina", "a2a_slowdown_median": 9.0, "median_ms": 1.0},   # sweep: not judged
            "noreduce": {"kind": "noreduce", "a2a_slowdown_median": 1.0, "median_ms": 50.0}}


def test_targets_where_contended_and_where_not():
    met = targets(_rows(1.8, 1.1, 120.0, 100.0))
    assert [t["met"] for t in met] == [True, True, True] and "contended" in met[2]["name"]
    assert "lina@kib=64" in met[1]["name"]
    missed = targets(_rows(1.8, 1.2, 110.0, 100.0))          # 1.10x faster is short of 1.15x; 1.2 > 1.15
    assert [t["met"] for t in missed] == [True, False, False]
    calm = targets(_rows(1.2, 1.0, 100.0, 104.0))            # not contended: at most 3 % slower
    assert [t["met"] for t in calm] == [False, True, False] and "not contended" in calm[2]["name"]
    assert targets({"noreduce": {"kind": "noreduce", "a2a_slowdown_median": 1.0, "median_ms": 1.0}}) == []


def _raw(kind, times_s, a2a_ms, nic, model):
    """A row as the ranks report it: 4 ranks (2 per node), identical stamps, ops back to back."""
    steps = []
    for ops in a2a_ms:
        t, step = 0, []
        for ms in ops:
            step.append((t, t + int(ms * 1e6)))
            t += int(ms * 1e6) + 1
        steps.append(step)
    trace = [{"op": "all_to_all", "phase": "backward", "priority": "urgent", "start_ns": 1, "end_ns": 2,
              "issue_ns": 1, "group": "ep", "group_ranks": (0, 1, 2, 3), "bytes": 1, "inter_node_bytes": 1,
              "layer": "moe0", "lane": "main", "rank": 0}]
    return {"kind": kind, "notes": [], "times_s": times_s, "grad_max_abs_diff_vs_sync": 0.0,
            "bwd_a2a_ns_per_rank": [steps] * 4, "nic_tx_bytes_per_rank": [[nic] * len(times_s)] * 4,
            "model_bytes_per_rank": [[model] * len(times_s)] * 4, "trace_round": 0,
            "reduce_ns_per_rank": [[int(t * 1e9) // 2 for t in times_s]] * 4,
            "trace_per_rank": [trace] * 4}


def test_summarize_rate_by_hand():
    record = {"rate": "200mbit", "rows": {
        "fifo": _raw("fifo", [0.30, 0.32], [[20.0, 40.0], [20.0, 40.0]], 2_000_000, 1_000_000),
        "lina@kib=64": _raw("lina", [0.20, 0.22], [[11.0, 20.0], [10.0, 22.0]], 2_000_000, 1_000_000),
        "noreduce": _raw("noreduce", [0.15, 0.15], [[10.0, 20.0], [10.0, 20.0]], 1_000_000, 500_000)}}
    g = summarize_rate(record, ranks_per_node=2)
    fifo, lina = g["rows"]["fifo"], g["rows"]["lina@kib=64"]
    assert fifo["a2a_slowdowns"] == pytest.approx([2.0, 2.0, 2.0, 2.0]) and fifo["a2a_slowdown_median"] == 2.0
    assert lina["a2a_slowdowns"] == pytest.approx([1.1, 1.0, 1.0, 1.1])
    assert lina["step_speedup_vs_fifo"] == pytest.approx(0.31 / 0.21)
    assert fifo["nic_MB_per_node"] == 2.0 and fifo["model_MB_per_node"] == 2.0      # model: 2 ranks x 1 MB
    assert fifo["reduce_ms_median"] == pytest.approx(155.0)
    assert [t["met"] for t in g["targets"]] == [True, True, True]
    assert g["wire"]["flagged"] == [] and g["wire"]["reference"] == "fifo"
    assert g["contention_split"] is None                      # no sync row: nothing alone to compare with
    report = {"meta": {"title": "t", "header_lines": ["x"]}, "groups": [g]}
    md = markdown_step(report)
    assert "## 200mbit" in md and "met: step speed-up of lina@kib=64 over fifo (contended): 1.476" in md
    assert sweep_lines(report) == []          # one micro-op size: no sweep table


def test_timeline_bars_lanes_and_categories():
    rec = lambda op, phase, prio, s, e: {"op": op, "phase": phase, "priority": prio, "issue_ns": s, "start_ns": s,
                                         "end_ns": e}
    bars = timeline_bars([[rec("all_to_all", "forward", "urgent", 1_000_000, 3_000_000),
                           rec("all_reduce", "backward", "background", 4_000_000, 9_000_000)],
                          [rec("all_to_all", "backward", "urgent", 2_000_000, 2_500_000)]])
    assert [(b["rank"], b["lane"], b["category"]) for b in bars] == [(0, 0, "fwd a2a"), (0, 1, "background"),
                                                                    (1, 0, "bwd a2a")]
    assert bars[1]["start_ms"] == 3.0 and bars[1]["width_ms"] == 5.0


# ---- the whole path -----------------------------------------------------------------------------------------

def test_tiny_step_bench_end_to_end(tmp_path):
    """Every row of a tiny model, two timed rounds; on the emulated cluster when possible (about 15 s)."""
    netns = cluster.netns_unavailable_reason() is None
    plan = StepPlan(nodes=2, ranks_per_node=2, model=parse_model("L=2,S=16,M=16,H=32,E=4,k=2,F=32"),
                    rows=tuple(map(parse_step_row, ("sync", "fifo", "fifo@bucket_mb=0.001", "lina@kib=1",
                                                    "noreduce"))),
                    rates=("100mbit",), iters=2, warmup=1, collective_timeout_s=120)
    rep = run_step_bench(plan, RunOptions(out_dir=tmp_path, mode="netns" if netns else "loopback", timeout_s=300,
                                          progress=False, stem="tiny"))
    assert {p.rsplit("/", 1)[-1] for p in rep["files"]} == {"tiny.json", "tiny.md", "tiny.png", "tiny-timeline.png",
                                                            "tiny-timeline.json"}
    g = rep["groups"][0]
    rows = g["rows"]
    assert list(rows) == ["sync", "fifo", "fifo@bucket_mb=0.001", "lina@kib=1", "noreduce"]
    for label, r in rows.items():
        assert r["n"] == 2 and r["median_ms"] > 0
        assert r["a2a_ops"] == 4, label                        # 2 MoE layers x 2 backward all-to-alls
        assert len(r["a2a_slowdowns"]) == 8
    # the reductions all sum the same gradients; noreduce leaves them alone
    for label in ("fifo", "fifo@bucket_mb=0.001", "lina@kib=1"):
        assert rows[label]["grad_max_abs_diff_vs_sync"] < 1e-5
        assert rows[label]["model_MB_per_node"] == rows["sync"]["model_MB_per_node"]
    assert rows["noreduce"]["grad_max_abs_diff_vs_sync"] is None and rows["noreduce"]["reduce_ms_median"] is None
    assert all(rows[label]["reduce_ms_median"] > 0 for label in ("sync", "fifo", "lina@kib=1"))
    assert rows["noreduce"]["model_MB_per_node"] < rows["sync"]["model_MB_per_node"]
    if netns:
        assert rows["noreduce"]["nic_MB_per_node"] < rows["sync"]["nic_MB_per_node"]
    assert "traces" not in g                                  # timelines go to their own file
    trace = json.loads((tmp_path / "tiny-timeline.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert any("lina@kib=1 rank 3" in n for n in names) and any("fifo rank 0" in n for n in names)
    assert any(e.get("cat") == "background" for e in trace)
    assert "Targets (issue #23)" in (tmp_path / "tiny.md").read_text()
    split = g["contention_split"]
    assert split["reduce_slowdown"] == pytest.approx(rows["fifo"]["reduce_ms_median"] / rows["sync"]["reduce_ms_median"])
    assert split["noise_floor"] == rows["sync"]["a2a_slowdown_median"]
    assert "where fifo's contention landed" in (tmp_path / "tiny.md").read_text()


def test_host_rows_run_the_step_through_deepspeed_and_megatron(tmp_path):
    """The host rows on a tiny model next to sync and noreduce (about 15 s): every row timed with its backward
    all-to-alls, DeepSpeed's reduced gradients equal to sync's, megatron@lina's to megatron's, and bytes metered."""
    netns = cluster.netns_unavailable_reason() is None
    rows = ("sync", "deepspeed", "deepspeed@lina,kib=1", "megatron@lina,kib=1", "megatron", "noreduce")
    plan = StepPlan(nodes=2, ranks_per_node=2, model=parse_model("L=2,S=16,M=16,H=32,E=4,k=2,F=32"),
                    rows=tuple(map(parse_step_row, rows)), rates=("100mbit",), iters=2, warmup=1,
                    collective_timeout_s=120)
    rep = run_step_bench(plan, RunOptions(out_dir=tmp_path, mode="netns" if netns else "loopback", timeout_s=300,
                                          progress=False, stem="hosts"))
    got = rep["groups"][0]["rows"]
    assert list(got) == list(rows)
    for label, r in got.items():
        assert r["n"] == 2 and r["median_ms"] > 0, label
        assert r["a2a_ops"] == 4, label                      # the plugin's exchanges, read from each host's ledger
        assert r["model_MB_per_node"] >= got["noreduce"]["model_MB_per_node"] > 0, label
        if netns:
            assert r["nic_MB_per_node"] > 0, label
    assert got["deepspeed"]["grad_max_abs_diff_vs_sync"] < 1e-5             # DeepSpeed's average x DP = the sum
    assert got["deepspeed@lina,kib=1"]["grad_max_abs_diff_vs_sync"] < 1e-5
    assert got["megatron@lina,kib=1"]["grad_max_abs_diff_vs_sync"] < 1e-5   # against the megatron row
    assert got["megatron"]["grad_max_abs_diff_vs_sync"] is None
    # Lina's micro-ops are engine ops (in the ledger, timed); the stock hosts' own all-reduce is not
    for label in ("deepspeed@lina,kib=1", "megatron@lina,kib=1"):
        assert got[label]["reduce_ms_median"] > 0
        assert got[label]["model_MB_per_node"] == pytest.approx(got["sync"]["model_MB_per_node"])
    for label in ("deepspeed", "megatron"):
        assert got[label]["reduce_ms_median"] is None
    if netns:                                                   # the stock hosts' reductions did cross the link
        for label in ("deepspeed", "megatron"):
            assert got[label]["nic_MB_per_node"] > 1.5 * got["noreduce"]["nic_MB_per_node"], label
    md = (tmp_path / "hosts.md").read_text()
    assert "megatron rows: the same shapes" in md and "- `deepspeed@lina,kib=1`: deepspeed.initialize" in md
