"""Row ``deepspeed@plugin=<schedule>``: the ``deepspeed`` row's stock layer swapped through the DeepSpeed adapter
(moe_plugins.enable with a ds_config section, then DeepSpeed's own set_deepspeed_parallelism). It must compute
what the stock row computes (same gate routing through the exact fast gate), count its bytes in the adapter's
ledger, and leave DeepSpeed as it found it when the row is closed."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Dict, Tuple

import pytest
import torch
import torch.distributed as dist

from moe_plugins.core.groups import build_process_groups, destroy_process_groups
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.tools.bench.case import close_rows, fwd_bwd, make_case_data
from moe_plugins.tools.bench.matrix import BenchPlan, CaseConfig, RowSpec, parse_row
from moe_plugins.tools.bench.rows import ROW_KINDS, build_row, needs_profile, row_problems, rows_problems
from moe_plugins.tools.bench.runner import RankJob, run_plan

STOCK, PLUGIN = RowSpec(name="deepspeed"), parse_row("deepspeed@plugin=baseline")
# S=64 tokens per rank, E=4, k=2, f=2: capacity 64 = S, nothing dropped; dispatch buffer E*C*M fp32
CASE = CaseConfig(tokens=64, hidden=16, ffn=32, experts=4, k=2, capacity_factor=2.0, ep=4)
BUFFER_BYTES = 4 * 64 * 16 * 4


def _deepspeed_state() -> Tuple[Any, ...]:
    """What the adapter patches and restores: its hook functions, DeepSpeed's expert-group registry, the plugin."""
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.sharded_moe import MOELayer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups
    from moe_plugins.patches import deepspeed as adapter
    return (MoE.__dict__["_create_process_groups"], MOELayer.__dict__["forward"],
            DeepSpeedEngine.__dict__["_configure_distributed_model"], dict(groups._EXPERT_PARALLEL_GROUP),
            groups.mpu, groups.expert_tensor_parallel_world_size, adapter.active())


def compare_rows(ep: int) -> Dict[str, Any]:
    """Pool job: build both rows of a tiny case on the same CaseData, one step each; outputs, gate gradients,
    the ledger's bytes, and whether DeepSpeed is restored after ``close``."""
    from moe_plugins.tools.bench.stock_deepspeed import init_deepspeed_comm
    init_deepspeed_comm()
    case = CaseConfig(tokens=48, hidden=16, ffn=32, experts=4, k=2, capacity_factor=1.0, ep=ep)
    groups = build_process_groups(ParallelLayout(world=dist.get_world_size(), ranks_per_node=2, ep=ep))
    before = _deepspeed_state()
    try:
        data = make_case_data(case, groups, seed=3, dtype="float32")
        stock, plugin = build_row(STOCK, data), build_row(PLUGIN, data)
        during = _deepspeed_state()
        try:
            y_stock, y_plugin = fwd_bwd(stock, data), fwd_bwd(plugin, data)
            plugin.meter.start()
            fwd_bwd(plugin, data)
            ledger_bytes = plugin.meter.stop()
            grads = [r.module.deepspeed_moe.gate.wg.weight.grad.clone() for r in (stock, plugin)]
        finally:
            close_rows([stock, plugin])
        after = _deepspeed_state()
    finally:
        destroy_process_groups(groups)
    return {"bitwise": bool(torch.equal(y_stock, y_plugin)), "max_diff": float((y_stock - y_plugin).abs().max()),
            "grad_diff": float((grads[0] - grads[1]).abs().max()), "ledger_bytes": ledger_bytes,
            "notes": plugin.notes, "swapped_while_live": during[6] is not None and during[1] is not before[1],
            "restored": all(a is b or a == b for a, b in zip(before, after))}


def refuse_foreign_profile() -> Tuple[str, bool]:
    """Pool job: a ``parm-auto`` adapter row given a profile of another layout. The adapter reads the file the
    row cached for it and names the mismatch; the failed swap leaves DeepSpeed as it was."""
    from moe_plugins.core.costmodel import CostProfile, ProfileKey
    from moe_plugins.tools.bench.rows import PROFILE
    from moe_plugins.tools.bench.stock_deepspeed import init_deepspeed_comm
    init_deepspeed_comm()
    groups = build_process_groups(ParallelLayout(world=dist.get_world_size(), ranks_per_node=2, ep=2))
    before = _deepspeed_state()
    try:
        data = make_case_data(CaseConfig(tokens=16, hidden=8, ffn=16, experts=4, k=2, ep=2), groups, 0, "float32")
        data.extras[PROFILE] = CostProfile(key=ProfileKey(world=8, ranks_per_node=8, mp=1, ep=8, esp=1,
                                                          backend="gloo", device="cpu"), dtype="float32", models={})
        try:
            build_row(parse_row("deepspeed@plugin=parm-auto"), data)
            error = ""
        except ValueError as exc:
            error = str(exc)
    finally:
        destroy_process_groups(groups)
    return error, all(a is b or a == b for a, b in zip(before, _deepspeed_state()))


def run_and_check_restored(job: RankJob) -> Tuple[Any, bool]:
    """Pool job: ``run_plan``, then whether DeepSpeed is as before (every adapter row closed)."""
    from moe_plugins.tools.bench.stock_deepspeed import init_deepspeed_comm
    init_deepspeed_comm()
    before = _deepspeed_state()
    records = run_plan(job)
    after = _deepspeed_state()
    return records, all(a is b or a == b for a, b in zip(before, after))


# ---- validation (no ranks) -----------------------------------------------------------------------------------

def test_option_is_registered_and_checked():
    assert set(ROW_KINDS["deepspeed"].options) == {"plugin", "r", "exchange"}
    assert row_problems(PLUGIN) == [] and row_problems(parse_row("deepspeed@plugin=parm-s2,r=2")) == []
    (bad,) = row_problems(parse_row("deepspeed@plugin=nope"))
    assert "deepspeed@plugin=nope" in bad and "'nope'" in bad and "baseline, baseline-tp" in bad
    (alone,) = row_problems(parse_row("deepspeed@r=2"))
    assert "option 'r' is unknown for the stock layer" in alone and "with plugin=<schedule>" in alone
    (degree,) = row_problems(parse_row("deepspeed@plugin=baseline,r=0"))
    assert "deepspeed@plugin=baseline,r=0" in degree and "pipeline_degree (0)" in degree
    (unknown,) = row_problems(parse_row("deepspeed@schedule=baseline"))
    assert "allowed: plugin, r" in unknown


def test_profiled_choices_are_rebuilt_per_rate_and_one_adapter_row_per_run():
    assert not needs_profile(STOCK) and not needs_profile(PLUGIN)
    assert needs_profile(parse_row("deepspeed@plugin=parm-auto"))
    assert needs_profile(parse_row("deepspeed@plugin=baseline,r=auto"))
    (two,) = rows_problems([STOCK, PLUGIN, parse_row("deepspeed@plugin=parm-s1")])
    assert "deepspeed@plugin=baseline, deepspeed@plugin=parm-s1" in two and "at most one" in two
    assert rows_problems([STOCK, PLUGIN, RowSpec(name="baseline")]) == []


# ---- on 4 gloo ranks -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ep", [1, 2, 4])
def test_adapter_row_matches_stock_row_and_is_undone(world, ep):
    results = world(4).run(compare_rows, ep, timeout_s=300)
    for r in results:
        assert r["swapped_while_live"] and r["restored"], r
        assert r["bitwise"] or r["max_diff"] <= 1e-6, r        # same routing: bitwise or fp round-off
        assert r["grad_diff"] <= 1e-5, r
        assert r["notes"] == (f"adapter: schedule baseline, pipeline_degree 1, mp1 ep{ep} esp1",)
    # 2 ranks per node: with EP 4, 2 of the 4 peers are remote in each of the 4 all-to-alls (E*C*M = 4*24*16 fp32)
    expected = {1: 0, 2: 0, 4: 4 * (4 * 24 * 16 * 4) // 2}[ep]
    assert [r["ledger_bytes"] for r in results] == [expected] * 4


def test_adapter_reads_the_profile_the_row_caches(world):
    for error, restored in world(4).run(refuse_foreign_profile, timeout_s=120):
        assert restored, error
        assert "holds the profile of w8-n8-mp1-ep8-esp1-gloo-cpu, not w4-n2-mp1-ep2-esp1-gloo-cpu" in error, error


def test_bench_times_adapter_row_beside_stock_and_restores(world):
    """Through the runner: the row under its full name, its difference to ``deepspeed`` ~0, its ledger bytes equal
    to the stock layer's counted collectives; a second adapter row is skipped with the reason; DeepSpeed restored."""
    plan = BenchPlan(nodes=2, ranks_per_node=2, cases=(CASE,), rates=("unshaped",), iters=2, warmup=1,
                     rows=(STOCK, PLUGIN, parse_row("deepspeed@plugin=parm-s1")))
    results = world(4).run(run_and_check_restored, RankJob(plan=plan, cluster=None), timeout_s=300)
    assert all(restored for _, restored in results)
    (group,) = results[0][0]
    assert list(group["rows"]) == ["deepspeed", "deepspeed@plugin=baseline"]
    ds, swapped = group["rows"]["deepspeed"], group["rows"]["deepspeed@plugin=baseline"]
    assert swapped["traffic_source"] == "ledger" and ds["traffic_source"] == "counter"
    assert swapped["model_bytes_per_rank"] == ds["model_bytes_per_rank"] == [4 * BUFFER_BYTES // 2] * 4
    assert swapped["max_abs_diff_vs_first"] <= 1e-6 * max(1.0, swapped["first_row_max_abs"])
    assert "already enabled" in group["skipped"]["deepspeed@plugin=parm-s1"]


def test_profiled_adapter_row_reads_the_bench_profile(world):
    """``deepspeed@plugin=parm-auto``: the adapter reads the profile the runner measured at this rate (through a
    private ``$MOE_PLUGINS_CACHE``), and its output still equals the stock layer's."""
    case = CaseConfig(tokens=32, hidden=16, ffn=32, experts=4, k=2, capacity_factor=1.0, ep=4)
    plan = BenchPlan(nodes=2, ranks_per_node=2, cases=(case,), rates=("unshaped",), iters=1, warmup=1,
                     rows=(STOCK, parse_row("deepspeed@plugin=parm-auto")))
    results = world(4).run(run_and_check_restored, RankJob(plan=plan, cluster=None), timeout_s=300)
    assert all(restored for _, restored in results)
    (group,) = results[0][0]
    assert group["skipped"] == {} and "profile" in group
    row = group["rows"]["deepspeed@plugin=parm-auto"]
    assert row["notes"] == ["adapter: schedule parm-auto, pipeline_degree 1, mp1 ep4 esp1"]
    assert row["max_abs_diff_vs_first"] <= 1e-5 * max(1.0, row["first_row_max_abs"])


# ---- the console script, tiny -----------------------------------------------------------------------------------

def _bench_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_plugins.tools.cli", "bench", *args, "--rates", "unshaped",
                           "--nodes", "1", "--ranks-per-node", "4", "--mode", "loopback", "--iters", "2",
                           "--warmup", "1", "--out", str(tmp_path), "--no-progress"],
                          capture_output=True, text=True, timeout=120)


def test_cli_reports_the_adapter_row_beside_stock(tmp_path):
    proc = _bench_cli(tmp_path, "--case", "S=64,M=16,H=32,E=4,k=2,f=1,ep=2", "--rows", "deepspeed",
                      "deepspeed@plugin=baseline")
    assert proc.returncode == 0, proc.stderr
    # the first line naming the row is the main table's (the paired-ratio table names it again)
    line = next(l for l in (tmp_path / "bench.md").read_text().splitlines() if "| deepspeed@plugin=baseline |" in l)
    assert line.rstrip(" |").endswith("0.0e+00")               # max|Δy| to the stock row: bitwise here
    rows_ = json.loads((tmp_path / "bench.json").read_text())["groups"][0]["rows"]
    assert rows_["deepspeed@plugin=baseline"]["traffic_source"] == "ledger"


def test_cli_refuses_a_bad_schedule_naming_row_value_and_choices(tmp_path):
    proc = _bench_cli(tmp_path, "--case", "S=64,M=16,H=32,E=4,k=2,f=1,ep=2", "--rows", "deepspeed",
                      "deepspeed@plugin=fastest")
    assert proc.returncode == 2
    assert "row ('deepspeed@plugin=fastest'): plugin ('fastest') is not a registered schedule; allowed: " \
           "baseline, baseline-tp" in proc.stderr
