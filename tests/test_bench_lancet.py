"""The bench's Lancet side (#26): the ``lancet`` rows, the exposed all-to-all time, the judgement against the best
fixed PipeMoE degree, and the one-step timeline: pure parts in one process, then the real runner and the timeline's
rank side on 2 gloo ranks (loopback)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moe_plugins.core.ledger import CommRecord
from moe_plugins.tools.bench import lancet_exposure as exposure
from moe_plugins.tools.bench import matrix, report, rows
from moe_plugins.tools.bench.lancet_report import fixed_degrees, judge_group, lancet_lines
from moe_plugins.tools.bench.matrix import BenchPlan, CaseConfig, RowSpec

# S=64 tokens per rank, E=4, k=2, f=2: capacity = S, nothing dropped, so every row computes the same function
CASE = CaseConfig(tokens=64, hidden=16, ffn=32, experts=4, k=2, capacity_factor=2.0, ep=2)
ROWS = ("deepspeed", "baseline", "baseline@r=2", "lancet", "lancet@r=2")


def test_lancet_rows_parse_and_are_checked():
    for text in ("lancet", "lancet@r=2", "lancet@r=auto"):
        assert rows.row_problems(matrix.parse_row(text)) == [], text
    (problem,) = rows.row_problems(matrix.parse_row("lancet@exchange=ragged"))
    assert "row ('lancet@exchange=ragged'): option 'exchange' is unknown; allowed: r" in problem
    assert rows.row_kind("lancet").kind == "plugin" and "lancet" not in rows.STOCK_ROWS
    assert rows.needs_profile(matrix.parse_row("lancet@r=auto"))
    assert not rows.needs_profile(matrix.parse_row("lancet@r=2")) and not rows.needs_profile(RowSpec(name="lancet"))
    from moe_plugins.tools.bench.runner import _pipelines
    assert _pipelines(RowSpec(name="lancet")) and not _pipelines(RowSpec(name="baseline"))
    assert report.auto_peers("lancet@r=auto", ["baseline", "lancet", "lancet@r=2", "lancet@r=auto"]) == [
        "lancet", "lancet@r=2"]


def test_exposure_is_the_all_to_all_time_no_compute_hid():
    assert exposure.exposure_of([(0, 10), (5, 20), (30, 40)], [(8, 12, "x"), (15, 35, "dW")]) == {
        "a2a_ns": 30, "overlapped_ns": 4 + 5 + 5, "exposed_ns": 16}
    assert exposure.exposure_of([], [(0, 5, "x")]) == {"a2a_ns": 0, "overlapped_ns": 0, "exposed_ns": 0}
    rounds = [[{"a2a_ns": 10e6, "overlapped_ns": 2e6, "exposed_ns": 8e6}, {"a2a_ns": 20e6, "overlapped_ns": 0,
                                                                          "exposed_ns": 20e6}],
              [{"a2a_ns": 30e6, "overlapped_ns": 6e6, "exposed_ns": 24e6}, {"a2a_ns": 20e6, "overlapped_ns": 10e6,
                                                                            "exposed_ns": 10e6}]]
    stats = exposure.exposure_stats(rounds)       # round means: a2a 20 / 20, exposed 16 / 15, overlap 0.2 / 0.25
    assert stats["a2a_ms"] == pytest.approx(20.0) and stats["exposed_ms"] == pytest.approx(15.5)
    assert stats["a2a_overlap"] == pytest.approx(0.225)
    assert exposure.exposure_stats([[None, None]]) == {"a2a_ms": None, "exposed_ms": None, "a2a_overlap": None}
    assert exposure.exposure_stats(None)["exposed_ms"] is None
    with pytest.raises(ValueError, match=r"exposure rounds per rank \(\[2, 1\]\) must be equal"):
        exposure.exposure_stats([rounds[0], rounds[1][:1]])


def _record(op, phase, issue, start, end):
    return CommRecord(layer="x", op=op, group="ep", group_ranks=(0, 1), numel=1, bytes=4, inter_node_bytes=4,
                      phase=phase, issue_ns=issue, start_ns=start, end_ns=end)


def test_a_row_is_measured_by_its_mode():
    ledger = SimpleNamespace(records=[_record("all_to_all", "forward", 0, 0, 10),
                                      _record("all_to_all", "backward", 20, 25, 40),
                                      _record("all_reduce", "backward", 40, 40, 90)])
    spans = [(22, 30, "dW experts.x")]

    def row(mode, meter):
        return SimpleNamespace(exposure=mode, meter=meter, compute_spans=lambda: list(spans))
    # from the issue (20), not the lane's start (25): the dW ran in that time; all_reduce is not an all-to-all
    assert exposure.step_exposure(row(exposure.SPANS, SimpleNamespace(ledger=ledger))) == {
        "a2a_ns": 30, "overlapped_ns": 8, "exposed_ns": 22}
    assert exposure.step_exposure(row(exposure.INLINE, SimpleNamespace(ledger=ledger)))["exposed_ns"] == 30
    assert exposure.step_exposure(row(exposure.INLINE, SimpleNamespace(a2a_intervals=[(0, 5)])))["a2a_ns"] == 5
    assert exposure.step_exposure(row(exposure.UNMEASURED, SimpleNamespace(ledger=ledger))) is None
    assert exposure.step_exposure(row(exposure.SPANS, SimpleNamespace())) is None
    assert exposure.a2a_of_records(ledger.records, since="start") == [(0, 10), (25, 40)]


def _summarised(times, exposed, bytes_per_rank=None):
    out = {}
    for label, t in times.items():
        out[label] = {"kind": "stock" if label == "deepspeed" else "plugin", "median_ms": t, "times_s": [t / 1e3] * 3,
                      "exposed_ms": exposed.get(label), "a2a_ms": 50.0, "a2a_overlap": 0.1, "model_MB_per_node": 1.0,
                      "model_bytes_per_rank": (bytes_per_rank or {}).get(label, [100, 100])}
    return out


def test_lancet_is_judged_against_the_best_fixed_degree():
    assert fixed_degrees(["deepspeed", "baseline", "baseline@r=2", "baseline@r=auto", "baseline@exchange=ragged",
                          "lancet@r=2"]) == ["baseline", "baseline@r=2"]
    times = {"deepspeed": 110.0, "baseline": 100.0, "baseline@r=2": 80.0, "baseline@r=4": 90.0, "lancet": 68.0,
             "lancet@r=2": 85.0}
    exposed = {"baseline": 60.0, "baseline@r=2": 40.0, "baseline@r=4": 45.0, "lancet": 19.0, "lancet@r=2": 30.0}
    judged = judge_group(_summarised(times, exposed))
    assert judged["best"] == "baseline@r=2" and judged["bound"] == "link-bound" and judged["share"] == 0.6
    assert judged["rows"]["lancet"]["targets"] == {"exposed": True, "step": True, "bytes": True}
    assert judged["rows"]["lancet@r=2"]["targets"] == {"exposed": False, "step": False, "bytes": True}
    assert judged["bytes_identical"] and "targets" not in judged["rows"]["baseline"]
    # compute-bound: the step may be 1.05x the best; a row that moved other bytes is named
    exposed["baseline"] = 40.0
    odd = judge_group(_summarised(times, exposed, {"lancet": [100, 104]}))
    assert odd["bound"] == "compute-bound" and odd["rows"]["lancet@r=2"]["targets"]["step"] is False
    assert odd["rows"]["lancet"]["targets"]["bytes"] is False and odd["bytes_differ"] == ["lancet"]
    assert judge_group(_summarised({"baseline": 1.0, "deepspeed": 1.0}, {})) is None
    assert judge_group(_summarised({"lancet": 1.0, "deepspeed": 1.0}, {})) is None
    text = "\n".join(lancet_lines({"groups": [{"case_label": "c", "rate": "1gbit", "rows": _summarised(
        times, exposed, {"lancet": [100, 104]}), "lancet": odd}]}))
    assert "| c | 1gbit | compute-bound (0.40) | lancet | 68.0 | 0.850 |" in text
    assert "met, met, MISSED |" in text and "DIFFERENT for lancet" in text and "**baseline@r=2** (best fixed)" in text


def test_lancet_rows_through_the_runner(world):
    """The real runner on 2 gloo ranks: every row runs; the same outputs and the same bytes per rank as the
    baseline; the exposed time is measured for every row; nothing hides baseline's exchanges, Lancet's dW does."""
    from moe_plugins.tools.bench.runner import RankJob
    from tests.workers.bench import run_bench_plan
    plan = BenchPlan(nodes=2, ranks_per_node=1, cases=(CASE,), rates=("unshaped",), iters=3, warmup=1,
                     rows=tuple(matrix.parse_row(r) for r in ROWS))
    (group,) = world(2).run(run_bench_plan, RankJob(plan=plan, cluster=None), timeout_s=300)[0]
    assert group["skipped"] == {} and list(group["rows"]) == list(ROWS)
    raw = group["rows"]
    ref_bytes = raw["baseline"]["model_bytes_per_rank"]
    assert ref_bytes[0] > 0
    for label, row in raw.items():
        assert row["max_abs_diff_vs_first"] <= 1e-5 * max(1.0, row["first_row_max_abs"]), label
        assert row["model_bytes_per_rank"] == ref_bytes, label
        assert row["exposure"] == ("inline" if label == "deepspeed" else "spans"), label
        steps = [step for per_rank in row["exposure_per_rank"] for step in per_rank]
        assert len(steps) == 2 * 3 and all(s is not None and s["a2a_ns"] > 0 for s in steps), label
    for label in ("deepspeed", "baseline"):         # exchanges inline: no compute ran in any of them
        assert all(s["overlapped_ns"] == 0 for r in raw[label]["exposure_per_rank"] for s in r), label
    # Lancet's dW runs behind the dispatch-gradient exchange on the lane: some of it inside the exchange
    assert any(s["overlapped_ns"] > 0 for r in raw["lancet"]["exposure_per_rank"] for s in r)
    summary = report.summarize_group(group, plan)
    assert summary["lancet"]["bytes_identical"] and summary["lancet"]["best"] in ("baseline", "baseline@r=2")
    assert summary["rows"]["lancet"]["exposed_ms"] > 0
    assert "## Lancet against the best fixed PipeMoE degree" in report.markdown(
        {"meta": {"title": "t", "header_lines": []}, "groups": [summary]})


def test_lancet_timeline_rank_side_and_picture(world, tmp_path):
    """The timeline's rank side on 2 gloo ranks: Lancet's gradients equal baseline's, its queue empty after
    backward, its dW recorded and partly inside an exchange; baseline overlaps nothing; the picture is written."""
    from moe_plugins.tools.bench import lancet_timeline
    from moe_plugins.tools.bench.lancet_step import TimelineJob, TimelinePlan, timeline_plan_problems
    from moe_plugins.tools.bench.lina_plan import parse_model
    plan = TimelinePlan(model=parse_model("L=2,S=32,M=16,H=32,E=4,k=2,f=2,F=16"), nodes=2, ranks_per_node=1,
                        rates=("unshaped",), iters=2, warmup=1)
    assert timeline_plan_problems(plan) == []
    records = world(2).run(TimelineJob(plan=plan, cluster=None).run_rank, timeout_s=300)
    assert records[1] is None
    (record,) = records[0]
    variants = record["variants"]
    assert list(variants) == ["baseline", "lancet", "lancet+dense"]
    for name, v in variants.items():
        assert v["grad_max_abs_diff_vs_baseline"] <= 1e-5 and v["queue_empty"], name
        kinds = {s["kind"] for trace in v["trace_per_rank"] for s in trace["spans"]}
        assert {"experts fwd", "experts bwd"} <= kinds, name
        assert any(k.startswith("dW") for k in kinds) == (name != "baseline"), name
        assert sum(r["op"] == "all_to_all" for r in v["trace_per_rank"][0]["records"]) == 8, name
    assert "dW dense" in {s["kind"] for t in variants["lancet+dense"]["trace_per_rank"] for s in t["spans"]}
    assert all(r["overlap"] == 0 for rank in variants["baseline"]["rounds_per_rank"] for r in rank)
    assert any(r["dw_hidden"] > 0 for rank in variants["lancet"]["rounds_per_rank"] for r in rank)
    summary = lancet_timeline.summarize(records[0], plan, {"title": "t", "header_lines": []})
    assert len(summary["groups"][0]["variants"]["lancet"]["median_per_rank"]) == 2
    paths = lancet_timeline.write_outputs(summary, tmp_path, "tl")
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(line.startswith("unshaped lancet: step") for line in lancet_timeline.text_lines(summary))


def test_timeline_plan_problems_name_field_value_and_allowed():
    from moe_plugins.tools.bench.lancet_step import TimelinePlan, timeline_plan_problems
    from moe_plugins.tools.bench.lina_plan import parse_model
    bad = TimelinePlan(model=parse_model("E=6"), variants=("lancet", "fast"), rates=("quick",), iters=0)
    problems = "; ".join(timeline_plan_problems(bad))
    for needle in ("iters (0) must be a positive integer", "model.experts (6) must be divisible by the world size (4)",
                   "variants (lancet, fast) must be one or more of baseline, lancet, lancet+dense", "rate ('quick')"):
        assert needle in problems, needle
