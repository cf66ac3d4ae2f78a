"""The rank side of ``moe-plugins bench`` on 4 gloo ranks (loopback): every row of a tiny case runs; the
stock DeepSpeed layer computes the same function as the baseline schedule with the same inter-node bytes
(counted collectives == ledger, both equal to the analytic volume); a row that cannot be built is skipped
on every rank with its reason while the others still run."""

from __future__ import annotations

import pytest

from moe_plugins.tools.bench.matrix import BenchPlan, CaseConfig, RowSpec
from moe_plugins.tools.bench.runner import RankJob
from tests.workers.bench import run_bench_plan

# S=64 tokens per rank, E=4, k=2, f=2: capacity C = ceil(2*2*64/4) = 64 = S, so no layer drops a route and
# all three must compute the same function; dispatch buffer E*C*M fp32.
CASE = CaseConfig(tokens=64, hidden=16, ffn=32, experts=4, k=2, capacity_factor=2.0, ep=4)
BUFFER_BYTES = 4 * 64 * 16 * 4
# 4 all-to-alls per forward+backward; with 2 ranks per node, 2 of the 4 EP peers are remote: half the buffer
EXPECTED_INTER_NODE_BYTES = 4 * BUFFER_BYTES // 2


@pytest.fixture(scope="module")
def records(world):
    plan = BenchPlan(nodes=2, ranks_per_node=2, cases=(CASE,), rates=("unshaped",), iters=2, warmup=1,
                     rows=(RowSpec(name="baseline"), RowSpec(name="deepspeed"), RowSpec(name="megatron"),
                           RowSpec(name="baseline", options=(("r", "0"),))))
    return world(4).run(run_bench_plan, RankJob(plan=plan, cluster=None), timeout_s=600)


def test_every_row_runs_and_is_timed(records):
    rank0 = records[0]
    assert records[1:] == [None, None, None]
    (group,) = rank0
    assert group["rate"] == "unshaped" and group["case_label"] == CASE.label
    assert set(group["rows"]) == {"baseline", "deepspeed", "megatron"}
    for row in group["rows"].values():
        assert len(row["times_s"]) == 2 and all(t > 0 for t in row["times_s"])
        assert row["nic_tx_bytes_per_rank"] == [None] * 4          # loopback: no NIC to read


def test_deepspeed_stock_layer_matches_baseline_schedule(records):
    rows = records[0][0]["rows"]
    base, ds = rows["baseline"], rows["deepspeed"]
    assert base["traffic_source"] == "ledger" and ds["traffic_source"] == "counter"
    assert base["model_bytes_per_rank"] == [EXPECTED_INTER_NODE_BYTES] * 4
    assert ds["model_bytes_per_rank"] == [EXPECTED_INTER_NODE_BYTES] * 4
    assert ds["max_abs_diff_vs_first"] <= 1e-5 * max(1.0, ds["first_row_max_abs"])


def test_megatron_stock_layer_is_comparable(records):
    meg = records[0][0]["rows"]["megatron"]
    assert meg["max_abs_diff_vs_first"] <= 1e-5 * max(1.0, meg["first_row_max_abs"])
    # capacity-padded all-to-alls like the others, plus Megatron's small metadata collectives
    assert all(EXPECTED_INTER_NODE_BYTES <= b <= EXPECTED_INTER_NODE_BYTES * 1.1 for b in meg["model_bytes_per_rank"])


def test_unbuildable_row_is_skipped_with_reason(records):
    skipped = records[0][0]["skipped"]
    assert list(skipped) == ["baseline@r=0"]
    assert "pipeline_degree (0) must be a positive integer" in skipped["baseline@r=0"]


def test_tensor_parallel_stock_rows_match_deepspeeds_data_flow(world):
    """MP=2: DeepSpeed's stock layer (drop_tokens/gather_tokens, through the gloo view of its all-gather) and
    the core's baseline-tp schedule compute the same function with the same inter-node bytes; Megatron runs
    sequence-parallel (1/MP of the tokens per rank) and agrees on its slice."""
    case = CaseConfig(tokens=64, hidden=16, ffn=32, experts=4, k=2, capacity_factor=2.0, mp=2, ep=4)
    plan = BenchPlan(nodes=2, ranks_per_node=2, cases=(case,), rates=("unshaped",), iters=1, warmup=1,
                     rows=(RowSpec(name="baseline-tp"), RowSpec(name="deepspeed"), RowSpec(name="megatron")))
    (group,) = world(4).run(run_bench_plan, RankJob(plan=plan, cluster=None), timeout_s=600)[0]
    assert group["skipped"] == {}
    tp, ds, meg = (group["rows"][k] for k in ("baseline-tp", "deepspeed", "megatron"))
    # each MP rank sends half the capacity (C = 64 -> 32 slots), half of it to the other node, 4 times
    assert tp["model_bytes_per_rank"] == ds["model_bytes_per_rank"] == [4 * (4 * 32 * 16 * 4) // 2] * 4
    for row in (ds, meg):
        assert row["max_abs_diff_vs_first"] <= 1e-5 * max(1.0, row["first_row_max_abs"])


def test_auto_rows_decide_from_a_profile_measured_at_each_rate(world):
    """``@r=auto`` and ``parm-auto`` rows are rebuilt per rate on a profile the runner measured on the case's
    groups: the record carries the fit, the rows record what they chose, and their outputs equal the fixed
    rows' (the choice never changes the math)."""
    case = CaseConfig(tokens=64, hidden=16, ffn=32, experts=4, k=2, capacity_factor=1.0, mp=2, ep=2, esp=2)
    other = CaseConfig(tokens=32, hidden=32, ffn=32, experts=4, k=2, capacity_factor=1.0, mp=2, ep=2, esp=2)
    plan = BenchPlan(nodes=2, ranks_per_node=2, cases=(case, other), rates=("unshaped",), iters=1, warmup=1,
                     rows=(RowSpec(name="parm-s1"), RowSpec(name="parm-s2-saa"), RowSpec(name="parm-auto"),
                           RowSpec(name="parm-s2", options=(("r", "auto"),))), profile_repeats=3)
    group, second = world(4).run(run_bench_plan, RankJob(plan=plan, cluster=None), timeout_s=600)[0]
    assert group["skipped"] == {} == second["skipped"]
    # the link part is measured once per layout and rate and shared; the gemm is the case's own shape
    link = {k: v for k, v in group["profile"].items() if k != "gemm"}
    assert link == {k: v for k, v in second["profile"].items() if k != "gemm"} and "chunk" in link
    assert group["profile_measurements"]["gemm"] != second["profile_measurements"]["gemm"]
    assert list(group["rows"]) == ["parm-s1", "parm-s2-saa", "parm-auto", "parm-s2@r=auto"]
    fits = group["profile"]
    for key in ("gemm", "all_to_all@ep_esp", "all_gather@mp", "saa@ep_esp+mp"):
        # unshaped loopback: small messages can time flat, so a slope pinned at 0 is legitimate (and flagged)
        assert fits[key]["beta"] > 0 or fits[key]["beta_clamped"], (key, fits)
        assert fits[key]["alpha"] >= 0 and fits[key]["r2"] is not None, (key, fits)
        points = group["profile_measurements"][key]       # the points behind the fit, for re-fits offline
        assert len(points["x"]) == len(points["seconds"]) >= 2, (key, points)
        assert all(t > 0 for t in points["seconds"]), (key, points)
    (auto_note,) = group["rows"]["parm-auto"]["notes"]
    # whichever candidate the measured profile prices lowest: parm-s1, parm-s2 or DeepSpeed's flow (baseline-tp)
    assert auto_note.startswith(("parm-auto: parm-s1 for 64 tokens", "parm-auto: parm-s2",
                                 "parm-auto: baseline-tp for 64 tokens")), auto_note
    (degree_note,) = group["rows"]["parm-s2@r=auto"]["notes"]
    assert degree_note.startswith("auto degree: r=") and "measured" not in degree_note
    for label in ("parm-s2-saa", "parm-auto", "parm-s2@r=auto"):
        row = group["rows"][label]
        assert row["max_abs_diff_vs_first"] <= 1e-5 * max(1.0, row["first_row_max_abs"]), label
