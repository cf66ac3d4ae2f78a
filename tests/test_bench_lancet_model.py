"""Lancet's model-level bench (benchmarks/lancet_model.py, moe_plugins/tools/bench/lancet_model*.py): the rows and
cases (pure), the exchange meter on 2 gloo ranks, the summary's targets on made-up numbers, then every row of the
tiny case end to end on 2 ranks through the real DeepSpeed host (one warm-up and one timed step): losses equal to
stock DeepSpeed's, the report's figures recomputed from the raw measurements, the padded bytes equal to the
exchange's size, and the outputs written."""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
from pathlib import Path

import pytest

from moe_plugins.tools.bench import lancet_model as lm
from moe_plugins.tools.bench import lancet_model_report as rep
from moe_plugins.tools.bench.lancet_model_rank import rank_main
from tests.workers.bench_lancet_model import SLEEP_S, meter_job

ROOT = Path(__file__).resolve().parents[1]


def test_rows_parse_into_sections_and_bad_rows_are_named():
    assert lm.parse_row("deepspeed").section() is None
    assert lm.parse_row("baseline@r=2").section() == {"schedule": "baseline", "pipeline_degree": 2}
    assert lm.parse_row("baseline@r=2").pipemoe_candidate and not lm.parse_row("baseline").pipemoe_candidate
    auto = lm.parse_row("lancet@partitions=auto")
    assert auto.section() == {"schedule": "baseline", "pipeline_degree": 1,
                              "lancet": {"defer_wgrad": True, "partitions": "auto"}} and not auto.padded
    assert lm.parse_row("lancet@r=2,dw=0").section()["lancet"] == {"defer_wgrad": False, "partitions": 1}
    assert lm.parse_row("lancet@partitions=2,dense=1").section()["lancet"] == {"defer_wgrad": True, "partitions": 2,
                                                                               "dense_wgrad": True}
    with pytest.raises(ValueError, match=r"option dense \('2'\) must be 0 or 1"):
        lm.parse_row("lancet@dense=2")
    with pytest.raises(ValueError, match=r"row \('lancet@r=2,partitions=2'\): partitions \(2\) need pipeline "
                                         r"degree r 1"):
        lm.parse_row("lancet@r=2,partitions=2")
    with pytest.raises(ValueError, match=r"option 'partitions=2' is unknown for baseline; allowed: r"):
        lm.parse_row("baseline@partitions=2")
    with pytest.raises(ValueError, match=r"option r \('0'\) must be an integer >= 1"):
        lm.parse_row("baseline@r=0")
    # Hecate's rows and their reference: the ragged baseline; neither sends the padded exchange
    ragged = lm.parse_row("baseline@exchange=ragged")
    assert ragged.section() == {"schedule": "baseline", "pipeline_degree": 1, "exchange": "ragged"} and not ragged.padded
    early = lm.parse_row("hecate@prefetch=1")
    assert early.section() == {"schedule": "baseline", "pipeline_degree": 1,
                               "hecate": {"enabled": True, "prefetch": True, "reshard_every": 0,
                                          "rematerialize": False, "regather": "early"}} and not early.padded
    assert lm.parse_row("hecate").section()["hecate"] == {"enabled": True, "prefetch": False, "reshard_every": 0,
                                                          "rematerialize": False, "regather": "early"}
    assert lm.parse_row("hecate@remat=1").section()["hecate"]["rematerialize"] is True     # re-materialisation
    assert lm.parse_row("hecate@remat=1,regather=at_need").section()["hecate"]["regather"] == "at_need"
    with pytest.raises(ValueError, match=r"option remat \('2'\) must be 0 or 1"):
        lm.parse_row("hecate@remat=2")
    assert lm.parse_row("hecate@reshard=4").section()["hecate"]["reshard_every"] == 4     # Algorithm 2's re-homing
    with pytest.raises(ValueError, match=r"option exchange \('even'\) must be padded or ragged"):
        lm.parse_row("baseline@exchange=even")
    assert lm.parse_row("hecate@r=2").section()["pipeline_degree"] == 2       # PipeMoE's chunks
    with pytest.raises(ValueError, match=r"'dw=1' is unknown for hecate; allowed: prefetch, r, reshard, remat, "
                                         r"regather"):
        lm.parse_row("hecate@dw=1")
    assert lm.rows_problems(list(lm.DEFAULT_ROWS)) == []
    problems = lm.rows_problems(["baseline", "lancet", "lancet", "pipe"])
    assert "row ('pipe'): 'pipe' is unknown; allowed: deepspeed, baseline, lancet, hecate" in problems
    assert "row 'lancet' is listed twice" in problems
    assert any("must include 'deepspeed'" in p for p in problems)
    assert any("at least one PipeMoE candidate" in p for p in problems)


def test_cases_parse_and_their_problems_are_listed_at_once():
    case = lm.parse_case("link:rate=200mbit,hidden=64,capacity_factor=1.5,seq_len=64")
    assert (case.rate, case.hidden, case.capacity_factor, case.bound, case.batch) == ("200mbit", 64, 1.5, "link", 8)
    assert case.capacity() == 384                      # DeepSpeed's top-2: ceil(2 f S / E), S = 8 x 64
    assert case.exchange_bytes() == case.experts * case.capacity() * 64 * 4
    with pytest.raises(ValueError, match=r"preset 'big' is unknown; allowed: link, compute, tiny"):
        lm.parse_case("big")
    bad = dataclasses.replace(lm.PRESETS["tiny"], experts=6, rate="fast")
    problems = lm.case_problems(bad, 4, [lm.parse_row("lancet@partitions=3")])
    assert any("experts (6) must be a multiple of the world (4)" in p for p in problems)
    assert any("rate ('fast') must be a positive number" in p for p in problems)
    assert any("partitions (3) must divide batch (4)" in p for p in problems)
    skewed = lm.parse_case("link:skew=0.4,drop=0")
    assert (skewed.skew, skewed.drop) == (0.4, 0) and "dropless, gate skew 0.4" in skewed.describe()
    problems = lm.case_problems(dataclasses.replace(skewed, skew=0.7, drop=2), 4, [])
    assert any("skew (0.7) must lie in (1/E, 1/k]" in p for p in problems)
    assert any("drop (2) must be 0 (dropless) or 1" in p for p in problems)
    with pytest.raises(ValueError, match=r"skew \('lots'\) must be a number"):
        lm.parse_case("link:skew=lots")
    graded = lm.parse_case("link:grade=1.5,experts=8,drop=0")
    assert graded.grade == 1.5 and "gate grade 1.5" in graded.describe() and lm.case_problems(graded, 4, []) == []
    assert any("grade (1) must be >= 0, and not given with skew (0.4)" in p
               for p in lm.case_problems(dataclasses.replace(skewed, grade=1.0), 4, []))
    assert lm.parse_layout("2x2") == (2, 2)
    with pytest.raises(ValueError, match=r"layout \('1x4'\) must be NxR"):
        lm.parse_layout("1x4")


def test_meter_counts_blocked_time_and_bytes_per_call(world):
    for rank, out in enumerate(world(2).run(meter_job, timeout_s=120)):
        assert out["patched"] and out["restored"]
        even, uneven, side, waits = out["even"], out["uneven"], out["side_thread"], out["waits"]
        # even: 4 rows of 2 fp32, half to the other rank (its own node) = 16 bytes; all of it blocked the caller
        assert (even["calls"], even["inter_node_bytes"]) == (1, 16)
        assert even["blocked_calls_ns"] == even["blocked_ns"] == even["union_ns"] > 0
        # uneven [1, 3] rows: rank 0 sends 3 rows (24 bytes) to rank 1, rank 1 sends 1 row (8 bytes) to rank 0
        assert uneven["inter_node_bytes"] == (24 if rank == 0 else 8)
        # a call on another thread flies but does not block the main thread
        assert side["calls"] == 1 and side["union_ns"] > 0 and side["blocked_ns"] == 0
        assert waits["blocked_waits_ns"] >= 0.8 * SLEEP_S * 1e9 and waits["other_wait_ns"] >= 0.8 * SLEEP_S * 1e9
        assert waits["blocked_ns"] == waits["blocked_waits_ns"] and waits["calls"] == 0
        assert out["after_stop"]["calls"] == 0


def _raw(rows, steps):
    """A made-up 2-rank result: steps[label] = [(step_s, blocked_ns, bytes) for each round], rank 1 slower."""
    per_rank = []
    for rank in range(2):
        per_rank.append({label: [{"round": i, "timed": i > 0, "step_s": s + 0.01 * rank, "loss": 1.0,
                                  "blocked_ns": b, "blocked_calls_ns": b, "blocked_waits_ns": 0, "other_wait_ns": 0,
                                  "calls": 8, "union_ns": b, "inter_node_bytes": n, "ledger_inter_node_bytes": n,
                                  "nic_tx_bytes": None}
                                 for i, (s, b, n) in enumerate(steps[label])] for label in rows})
    facts = {label: {"chosen_partitions": [], "ranges_run": 0, "dw_behind_exchange_calls": 0} for label in rows}
    return {"case": dataclasses.asdict(lm.PRESETS["link"]), "rows": rows, "world": 2, "ranks_per_node": 1,
            "warmup": 1, "iters": 3, "steps_per_rank": per_rank, "facts_per_rank": [facts, facts]}


def test_summary_picks_the_best_pipemoe_degree_and_judges_the_targets():
    rows = ["deepspeed", "baseline", "baseline@r=2", "baseline@r=4", "lancet", "lancet@partitions=2"]
    steps = {"deepspeed": [(9, 9e8, 100)] + [(1.0, 6e8, 100)] * 3,
             "baseline": [(9, 9e8, 100)] + [(0.5, 5e8, 100)] * 3,       # r = 1 is the fastest baseline
             "baseline@r=2": [(9, 9e8, 100)] + [(0.9, 4e8, 100), (0.8, 4e8, 100), (0.7, 4e8, 100)],
             "baseline@r=4": [(9, 9e8, 100)] + [(0.95, 3e8, 100)] * 3,
             "lancet": [(0.1, 1, 100)] + [(0.6, 1.9e8, 100)] * 3,
             "lancet@partitions=2": [(9, 9e8, 100)] + [(0.75, 2.1e8, 80)] * 3}
    group = rep.summarize_case(_raw(rows, steps))
    assert group["best_pipemoe"] == "baseline@r=2" and group["best_baseline_any_degree"] == "baseline"
    r2 = group["rows"]["baseline@r=2"]
    assert r2["step_ms"] == pytest.approx(810.0) and r2["timed_rounds"] == 3      # median of the slowest rank's
    lancet, parts = group["rows"]["lancet"]["targets"], group["rows"]["lancet@partitions=2"]["targets"]
    assert lancet["step_ratio"] == pytest.approx(610 / 810) and lancet["step_met"]    # link-bound: <= 0.87
    assert lancet["exposed_ratio"] == pytest.approx(0.475) and lancet["exposed_met"] and lancet["bytes"] == "equal"
    assert parts["step_ratio"] == pytest.approx(760 / 810) and not parts["step_met"]
    assert not parts["exposed_met"] and parts["bytes"].startswith("ragged: 0.80x")
    assert group["rows"]["deepspeed"]["step_vs_deepspeed"] == 1.0 and "targets" not in group["rows"]["baseline"]
    assert group["stock_blocked_share"] == pytest.approx(600 / 1010) and group["measured_bound"] == "link"
    assert group["rows"]["deepspeed"]["link_use"] is None                      # no NIC counts (loopback)
    raw = _raw(rows, steps)
    for rank_steps in raw["steps_per_rank"]:      # 1,893,750 bytes at 30 Mbit/s = 0.505 s of a 1.01 s step
        for step in rank_steps["deepspeed"]:
            step["nic_tx_bytes"] = 1_893_750
    stock = rep.summarize_case(dict(raw, case=dict(raw["case"], rate="30mbit")))["rows"]["deepspeed"]
    assert stock["link_use"] == pytest.approx(0.5) and stock["nic_bytes"] == 2 * 1_893_750
    assert stock["copy_peak_bytes"] is None                      # no Hecate layer: no copy ledger
    for rank, rank_steps in enumerate(raw["steps_per_rank"]):    # Hecate's copies: the busiest rank, median round
        for i, step in enumerate(rank_steps["lancet"]):
            step["copy_peak_bytes"] = 1000 * (i + 1) + 7 * rank
    row = rep.summarize_case(raw)["rows"]["lancet"]
    assert row["copy_peak_bytes"] == 3007 and "expert copies alive at most 3.0 kB" in rep._notes(row)


def test_every_row_end_to_end_on_two_ranks(world, tmp_path):
    """The tiny case, every default row, 2 ranks as 2 nodes (loopback), 1 warm-up + 1 timed step each."""
    case = lm.PRESETS["tiny"]
    cfg = {"case": dataclasses.asdict(case), "rows": list(lm.DEFAULT_ROWS), "ranks_per_node": 1, "warmup": 1,
           "iters": 1, "zero": 1, "lr": 1e-3, "seed": 0, "profile_dir": str(tmp_path), "ifname": None}
    raw = world(2).run(rank_main, cfg, timeout_s=300)[0]
    steps = {label: [r[label] for r in raw["steps_per_rank"]] for label in raw["rows"]}
    for label, per_rank in steps.items():            # same math: every rank's every loss equals stock's
        for mine, ref in zip(per_rank, steps["deepspeed"]):
            assert max(abs(a["loss"] - b["loss"]) for a, b in zip(mine, ref)) <= 1e-5, label
    group = rep.summarize_case(raw)
    padded = 2 * (4 * case.moe_layers() * case.exchange_bytes() // 2)   # 2 ranks x 4 exchanges/layer, half remote
    for label, row in group["rows"].items():
        timed = [max(r[1]["step_s"] for r in steps[label]) * 1e3]
        assert row["step_ms"] == pytest.approx(statistics.median(timed))
        assert row["exposed_ms"] == pytest.approx(sum(r[1]["blocked_ns"] for r in steps[label]) / 2 / 1e6)
        assert row["exposed_ms"] > 0 and row["a2a_calls"] >= 8 and row["loss_max_abs_diff"] <= 1e-5
        if lm.parse_row(label).padded:
            assert row["a2a_bytes"] == padded, label
        else:                                         # partitions: kept routes only (top-2 at f = 1 drops some)
            assert 0 < row["a2a_bytes"] < padded, label
        if label != "deepspeed":
            assert row["ledger_bytes"] == row["a2a_bytes"], label
    stock = group["rows"]["deepspeed"]
    assert stock["exposed_ms"] == pytest.approx(stock["a2a_ms"]) and stock["ledger_bytes"] == 0   # all inline
    assert group["rows"]["lancet"]["facts"]["dw_behind_exchange_calls"] > 0
    assert group["rows"]["lancet"]["waits_blocked_ms"] > 0               # it landed exchanges from the lane
    assert group["rows"]["lancet@partitions=4"]["facts"]["chosen_partitions"] == [4]
    assert group["rows"]["lancet@partitions=auto"]["facts"]["chosen_partitions"][0] in (1, 2, 4)
    assert raw["profile"] is not None and all(r["facts_agree_across_ranks"] for r in group["rows"].values())
    # the parent side writes the three files from the raw result
    spec = importlib.util.spec_from_file_location("lancet_model_script", ROOT / "benchmarks" / "lancet_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script.parse_args(["--layout", "2x1", "--out", str(tmp_path / "out"), "--stem", "t"])
    report = script.write(args, {"meta": {"title": "test", "header_lines": ["made in a test"]}, "raw": [raw]})
    assert rep.report_problems(report) == [] and (tmp_path / "out" / "t.png").stat().st_size > 0
    text = (tmp_path / "out" / "t.md").read_text()
    assert all(f"`{label}`" in text for label in lm.DEFAULT_ROWS) and "Targets" in text


def test_the_gate_skew_hits_its_share_on_layer_norm_like_inputs():
    """``skew_gate`` bisects gamma so that the gate sends ``share`` of the top-k routes to expert 0 for inputs
    N(0, I) + d; on fresh inputs of that law it does, and more gamma gives more share."""
    import torch
    from torch import nn

    from moe_plugins.tools.bench.lancet_model_rank import expected_hot_share, skew_gate

    class Block(nn.Module):         # the two modules skew_gate touches: ln_2 and the MoE gate's wg
        def __init__(self):
            super().__init__()
            self.ln_2 = nn.LayerNorm(32)
            gate = nn.Module()
            gate.wg = nn.Linear(32, 4, bias=False)
            moe = nn.Module()
            moe.deepspeed_moe = nn.Module()
            moe.deepspeed_moe.gate = gate
            self.mlp = nn.Module()
            self.mlp.moe = moe

    torch.manual_seed(0)
    block = Block()
    w0 = block.mlp.moe.deepspeed_moe.gate.wg.weight.detach().clone()
    gamma = skew_gate(block, 0.4, 2, seed=3)
    d = block.ln_2.bias.detach()
    assert abs(float(d.norm()) - 1.0) < 1e-6 and gamma > 0
    assert torch.allclose(block.mlp.moe.deepspeed_moe.gate.wg.weight[0], w0[0] + gamma * d)
    assert abs(expected_hot_share(w0, d, gamma, 2, seed=11) - 0.4) < 0.02        # fresh draws: the aimed share
    shares = [expected_hot_share(w0, d, g, 2) for g in (0.0, gamma, 4 * gamma)]
    assert shares[0] < shares[1] < shares[2]


def test_the_gate_grade_favours_the_lower_experts():
    """``grade_gate``: expert e's gate row gains grade (1 - e / (E - 1)) d and ln_2's bias d, so on inputs N(0, I) + d
    the routes' shares fall with the expert id (the hottest on the first ranks' node under expert parallelism)."""
    import torch
    from torch import nn

    from moe_plugins.tools.bench.lancet_model_rank import grade_gate

    block = nn.Module()
    block.ln_2 = nn.LayerNorm(64)
    block.mlp = nn.Module()
    block.mlp.moe = nn.Module()
    block.mlp.moe.deepspeed_moe = nn.Module()
    block.mlp.moe.deepspeed_moe.gate = nn.Module()
    block.mlp.moe.deepspeed_moe.gate.wg = nn.Linear(64, 8, bias=False)
    torch.manual_seed(0)
    w0 = block.mlp.moe.deepspeed_moe.gate.wg.weight.detach().clone()
    grade_gate(block, 1.5, seed=3)
    d = block.ln_2.bias.detach()
    w = block.mlp.moe.deepspeed_moe.gate.wg.weight.detach()
    assert torch.allclose(w - w0, torch.outer(1.5 * (1 - torch.arange(8.0) / 7), d), atol=1e-6)
    x = torch.randn(20000, 64, generator=torch.Generator().manual_seed(1)) + d
    top = (x @ w.t()).topk(2, dim=1).indices
    shares = torch.bincount(top.flatten(), minlength=8).float() / top.numel()
    assert float(shares[:4].sum()) > 0.6 and shares[0] > shares[7]
