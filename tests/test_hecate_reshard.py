"""Hecate's heterogeneous sharding (Algorithm 2, moe_plugins/hecate/reshard.py) and the move of the experts to
their new homes (moe_plugins/hecate/rehome.py).

In one process: the plan's rules (underloaded experts spread node-first by load, slots per device kept, ties,
the overlappable experts staying home, pooled slots across layers) and the move's split sizes. On 4 gloo ranks
(2 nodes x 2, EP 4, fp64): the core Hecate layer re-sharded every 2 steps trains as the plain one (losses,
parameters and Adam moments by global expert id <= 1e-9), the homes really move, the move is in the ledger, and
``Resharder.stock_homes`` puts every expert back on its stock owner and returns it after."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_plugins.hecate.reshard import local_experts, move_counts, node_inbound, shard_plan
from moe_plugins.tools.verify import VerifySpec
from tests.workers.hecate_reshard import reshard_training

NODES = (0, 0, 1, 1)
STOCK = (0, 0, 1, 1, 2, 2, 3, 3)


def test_underloaded_experts_spread_over_nodes_then_devices():
    load = [50, 40, 30, 20, 5, 5, 3, 2]
    (homes,) = shard_plan([load], [[]], NODES)
    assert [list(homes).count(r) for r in range(4)] == [2] * 4                      # slots per device kept
    inbound = node_inbound(homes, load, NODES)
    assert inbound == {0: 77.0, 1: 78.0}                                            # stock: 140 vs 15
    assert node_inbound(STOCK, load, NODES) == {0: 140.0, 1: 15.0}
    assert homes[0] != homes[1] and NODES[homes[0]] != NODES[homes[1]]              # the two hottest split nodes


def test_overlappable_experts_fill_the_slots_left():
    load = [90, 30, 20, 10, 1, 1, 1, 1]
    (homes,) = shard_plan([load], [[0]], NODES)          # expert 0 is copied anyway (J): placed last
    assert [list(homes).count(r) for r in range(4)] == [2] * 4 and homes != STOCK
    assert max(node_inbound(homes, load, NODES, [0]).values()) < max(node_inbound(STOCK, load, NODES, [0]).values())
    (dealt,) = shard_plan([load[1:] + [0]], [[]], NODES, homes_LE=[STOCK[1:] + (3,)])
    assert homes[1:] == dealt[:7]                        # J' placed as if J were not there; J takes the slot left
    (kept,) = shard_plan([[5, 5, 1, 1, 1, 1, 1, 1]], [[0, 1, 2, 3, 4, 5, 6, 7]], NODES)
    assert kept == STOCK                                  # all copied: every expert stays where it is



def test_a_plan_that_lowers_no_load_keeps_the_homes():
    assert shard_plan([[5] * 8], [[]], NODES) == (STOCK,)                    # Algorithm 2 alone would re-deal it
    assert shard_plan([[90, 1, 1, 1, 1, 1, 1, 1]], [[0]], NODES) == (STOCK,)  # J' 3 vs 4 routes: nothing to gain


def test_ties_prefer_fewer_free_slots_then_home():
    # after experts 0 (node 0) and 1 (node 1) the loads tie; the node with fewer free slots comes first
    homes = shard_plan([[10, 10, 0, 0]], [[]], (0, 1), homes_LE=[(1, 0, 0, 1)])[0]
    assert homes == (1, 0, 0, 1)                          # equal loads: every expert keeps its home


def test_pooled_slots_let_a_layer_hold_more_experts_on_one_device():
    loads = [[100, 90, 80, 70], [1, 1, 1, 1]]
    pooled = shard_plan(loads, [[], []], (0, 1), pooled=True)
    per_layer = shard_plan(loads, [[], []], (0, 1))
    assert all(list(h).count(r) == 2 for h in per_layer for r in (0, 1))
    assert sum(list(h).count(0) for h in pooled) == 4 and sum(list(h).count(1) for h in pooled) == 4
    with pytest.raises(ValueError, match="multiple of the 2 ranks"):
        shard_plan([[1, 2, 3]], [[]], (0, 1))


def test_plan_refuses_bad_input():
    with pytest.raises(ValueError, match=r"loads_LE\[0\] \(\[-1, 2\]\) must be one load >= 0"):
        shard_plan([[-1, 2]], [[]], (0, 1))
    with pytest.raises(ValueError, match=r"overlappable_L\[0\] \(\[5\]\) must be experts in \[0, 2\)"):
        shard_plan([[1, 2]], [[5]], (0, 1))
    with pytest.raises(ValueError, match="homes_LE must give each layer's experts a rank"):
        shard_plan([[1, 2]], [[]], (0, 1), homes_LE=[(0, 7)])


def test_move_counts_and_local_order():
    new = (0, 1, 0, 1, 2, 3, 2, 3)
    assert [move_counts(STOCK, new, r, 4) for r in range(4)] == [
        ((), (1,), (), ()), ((2,), (), (), ()), ((), (), (), (5,)), ((), (), (6,), ())]
    assert local_experts(new, 0) == (0, 2) and local_experts(new, 3) == (5, 7)


SPEC = VerifySpec(world=4, ranks_per_node=2, ep=4, experts=8, tokens=24, hidden=8, ffn=12, k=2, drop=False,
                  skew=6.0, seed=13, schedule="hecate", exchange="ragged")


def _full(runs, key):
    got = {}
    for r in runs:
        got.update(r[key])
    return [torch.stack([got[e][i] for e in sorted(got)]) for i in range(4)]


@pytest.mark.parametrize("spec,prefetch", [(SPEC, False), (replace(SPEC, ep=2, k=1, seed=7), False), (SPEC, True)],
                         ids=["ep4", "ep2-expert_dp2", "ep4-prefetch"])
def test_resharded_training_equals_plain(world, spec, prefetch):
    """With ``prefetch`` a gather planned on the old homes is pending at each re-shard: it is dropped, and the next
    call gathers from the new homes."""
    runs = world(4).run(reshard_training, spec, 6, 2, 1, prefetch)
    plain, moved = [r["plain"] for r in runs], [r["reshard"] for r in runs]
    for p, m in zip(plain, moved):
        assert max(abs(a - b) for a, b in zip(p["losses"], m["losses"])) <= 1e-9
        assert m["moves"] == 3 and all(h == p["homes"][0] for h in p["homes"])
    assert any(h != moved[0]["homes"][0] for h in moved[0]["homes"]), moved[0]["homes"]    # homes really moved
    assert all(m["homes"] == moved[0]["homes"] for m in moved)                             # one plan everywhere
    for group in ([runs[r] for r in range(4) if r // spec.ep == g] for g in range(4 // spec.ep)):
        for key in ("experts", "moments"):
            for a, b in zip(_full([r["plain"] for r in group], key), _full([r["reshard"] for r in group], key)):
                assert float((a - b).abs().max()) <= 1e-9, key
        stock = _full([r["reshard"] for r in group], "stock")
        for a, b in zip(_full([r["plain"] for r in group], "experts"), stock):
            assert float((a - b).abs().max()) <= 1e-9
        for a, b in zip(_full([r["reshard"] for r in group], "experts"), _full([r["reshard"] for r in group],
                                                                                 "after_stock")):
            assert torch.equal(a, b)                                                       # moved back bitwise
    sent = sum(m["ledger"]["moe"].get("reshard:all_to_all@ep", {}).get("bytes", 0) for m in moved)
    assert sent > 0


# ---- on DeepSpeed (4 gloo ranks, tests/workers/deepspeed.py's tiny model) --------------------------------

def _deepspeed_jobs():
    pytest.importorskip("deepspeed")
    from tests.workers import hecate_reshard_deepspeed
    return hecate_reshard_deepspeed


@pytest.mark.parametrize("stage,ep,k,forced,degree", [(0, 4, 1, None, 1), (0, 2, 2, (1, 0, 0, 1), 1),
                                                      (1, 4, 1, None, 1), (2, 4, 2, None, 1), (0, 4, 2, None, 3),
                                                      (1, 2, 2, (1, 0, 0, 1), 1), (2, 2, 1, (1, 0, 0, 1), 1)],
                         ids=["zero0-ep4-k1", "zero0-ep2-k2-expert_dp2", "zero1-ep4-k1", "zero2-ep4-k2",
                              "zero0-ep4-k2-pipemoe3", "zero1-ep2-k2-expert_dp2", "zero2-ep2-expert_dp2"])
def test_deepspeed_training_with_resharding_equals_stock(world, stage, ep, k, forced, degree):
    """Experts 0 and 1 are hot: at EP 4 both are copied and the other two crowd node 1, which Algorithm 2 undoes.
    At EP 2 (4 experts on 2 ranks, each EP group on one node) the stock homes are already as good as any, so the
    experts are moved by hand once (``forced``) and the expert-DP replicas must move alike. Under ZeRO 1/2 the
    experts' slices of the flat fp32 master partition and of its Adam moments move with them (at expert-DP 2,
    where each rank holds half of the expert group's partition, gathered whole for the move and written back). At PipeMoE's degree
    3 the pipelined executor's twin schedule reads the same homes."""
    jobs = _deepspeed_jobs()
    steps = 20
    results = world(4).run(jobs.train_vs_stock, stage, 2, ep, k, 3, steps, forced, degree)
    for rank, res in enumerate(results):
        off, on = res["off"], res["on"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(off["losses"], on["losses"]))
        assert len(on["losses"]) == steps and rel <= 1e-5, (rank, rel)
        assert on["moves"] == steps // 2 + (forced is not None)
        assert on["wrapped_after"] == []                    # disable() took the engine's wrappers off
    assert jobs.homes_moved(results[0]["on"]["homes"], results[0]["on"]["stock"]), results[0]["on"]["homes"]
    assert all(r["on"]["homes"] == results[0]["on"]["homes"] for r in results)
    for group in ([results[r] for r in range(4) if r // ep == g] for g in range(4 // ep)):   # one EP group each
        off, on = {}, {}
        for r in group:
            off.update(r["off"]["experts"])
            on.update(r["on"]["experts"])
        assert set(off) == set(on)
        assert max(float((off[n] - on[n]).abs().max() / off[n].abs().max().clamp_min(1e-12)) for n in off) <= 1e-4


@pytest.mark.parametrize("save,load,stage", [("reshard", None, 0), ("reshard", "reshard", 0), (None, "reshard", 0),
                                             ("reshard", None, 2), (None, "reshard", 2), ("reshard", None, "2-offload"),
                                             pytest.param(None, "reshard", "2-offload", marks=pytest.mark.full(
                                                 covered_by="[offload-resharded-to-stock] and "
                                                            "[zero2-stock-to-resharded]"))],
                         ids=["resharded-to-stock", "resharded-to-resharded", "stock-to-resharded",
                              "zero2-resharded-to-stock", "zero2-stock-to-resharded", "offload-resharded-to-stock",
                              "offload-stock-to-resharded"])
def test_deepspeed_checkpoints_are_stock_files(world, tmp_path, save, load, stage):
    """Saved away from the stock homes, the files are stock DeepSpeed's (a run without re-sharding resumes them,
    losses and experts by id), and the reverse; at ZeRO 0, 2, and 2 with ZeRO-Offload."""
    jobs = _deepspeed_jobs()
    sections = {"reshard": jobs.section(1), None: None}
    stage, half = (2, "offload") if stage == "2-offload" else (stage, False)
    results = world(4).run(jobs.checkpoint_across, sections[save], sections[load], 4, 1, str(tmp_path), 4, stage,
                           half)
    jobs.round_trip(results)               # the resumed losses and the experts by id, saver against loader
    if save:
        assert results[0]["saver"]["homes"] != results[0]["saver"]["stock"]      # saved away from the stock homes


def test_reshard_problems_name_the_field():
    from types import SimpleNamespace

    from moe_plugins.core.plugin_config import PluginConfig
    from moe_plugins.patches.deepspeed_hecate import config_choices
    from moe_plugins.patches.deepspeed_hecate_reshard import reshard_problems
    cfg = PluginConfig.from_dict({"hecate": {"reshard_every": 3}}, **config_choices())
    engine = SimpleNamespace(zero_optimization_stage=lambda: 3, fp16_enabled=lambda: True,
                             bfloat16_enabled=lambda: False, zero_cpu_offload=lambda: True)
    assert reshard_problems(engine, cfg) == [       # ZeRO-Offload itself is allowed (its masters move too)
        "moe_plugins.hecate.reshard_every (3) runs on ZeRO stage 0, 1 or 2, and zero_optimization.stage is 3"]
    fp16_zero0 = SimpleNamespace(zero_optimization_stage=lambda: 0, fp16_enabled=lambda: True,
                                 bfloat16_enabled=lambda: False, zero_cpu_offload=lambda: False)
    assert reshard_problems(fp16_zero0, cfg) == []
    bf16_zero0 = SimpleNamespace(zero_optimization_stage=lambda: 0, fp16_enabled=lambda: False,
                                 bfloat16_enabled=lambda: True, zero_cpu_offload=lambda: False)
    assert reshard_problems(bf16_zero0, cfg) == []
    bf16_zero2 = SimpleNamespace(zero_optimization_stage=lambda: 2, fp16_enabled=lambda: False,
                                 bfloat16_enabled=lambda: True, zero_cpu_offload=lambda: False)
    assert reshard_problems(bf16_zero2, cfg) == []
    plain = PluginConfig.from_dict({"hecate": {"reshard_every": 0}}, **config_choices())
    assert reshard_problems(engine, plain) == []


HALF_OPTIMIZERS = {"fp32-accum": "BF16_Optimizer", "bf16-fused": "FP16_Optimizer", "fp16-fused": "FP16_Optimizer"}


@pytest.mark.parametrize("stage,ep,forced,half", [
    (2, 4, (3, 2, 1, 0), True), (1, 2, (1, 0, 0, 1), True), (0, 4, (3, 2, 1, 0), True), (0, 2, (1, 0, 0, 1), True),
    (1, 2, (1, 0, 0, 1), "fp32-accum"), (2, 4, (3, 2, 1, 0), "fp16"), (1, 2, (1, 0, 0, 1), "fp16"),
    (0, 2, (1, 0, 0, 1), "fp16"), (0, 4, (3, 2, 1, 0), "fp16-fused"), (0, 2, (1, 0, 0, 1), "bf16-fused"),
    (2, 4, (3, 2, 1, 0), "offload"),
    pytest.param(1, 2, (1, 0, 0, 1), "offload", marks=pytest.mark.full(
        covered_by="[offload-zero2-ep4] (ZeRO-Offload's host partitions moved) and [zero1-ep2-expert_dp2] (gathered "
                   "whole at expert-DP 2)")),
    pytest.param(2, 2, (1, 0, 0, 1), "bf16-offload", marks=pytest.mark.full(
        covered_by="[offload-zero2-ep4] and [zero2-ep4] (bf16's masters)"))],
    ids=["zero2-ep4", "zero1-ep2-expert_dp2", "zero0-ep4", "zero0-ep2-expert_dp2", "bf16opt-zero1-ep2-expert_dp2",
         "fp16-zero2-ep4", "fp16-zero1-ep2-expert_dp2", "fp16-zero0-ep2-expert_dp2", "fp16opt-fp16-zero0-ep4",
         "fp16opt-bf16-zero0-ep2-expert_dp2", "offload-zero2-ep4", "offload-zero1-ep2-expert_dp2",
         "offload-bf16-zero2-ep2-expert_dp2"])
def test_deepspeed_half_resharding_moves_the_fp32_masters(world, stage, ep, forced, half):
    """DeepSpeed's bf16 and fp16 under ZeRO 1/2, at ZeRO 0 (``FP16_UnfusedOptimizer``: an fp32 master per
    parameter, moved with it; around a fused Adam ``FP16_Optimizer``: one flat fp32 master per group, each
    parameter's slices moved), and bf16 with fp32 gradient accumulation at ZeRO 1 (DeepSpeed's ``BF16_Optimizer``:
    its flat partitions gathered whole and written back like ZeRO's): the model 16-bit, the fp32 masters and
    Adam's moments in the optimizer; fp16 under DeepSpeed's dynamic loss scale (tests/workers/deepspeed.py's
    ``cpu_half`` levers let DeepSpeed build its fp16 and fused-Adam optimizers on a CPU). A move by hand after the
    first step carries every expert's 16-bit values, fp32 master and moments (read whole through DeepSpeed's
    safe_get_full_*, or its own layouts at ZeRO 0) bitwise by global id, at expert-DP 1 (views of the flat
    partition) and 2 (gathered whole and written back); then 12 steps re-sharding every 2 track stock DeepSpeed's
    run (losses within 2e-2 relative, masters and moments within 5e-2; in fp16 the same steps skipped)."""
    jobs = _deepspeed_jobs()
    steps = 12
    results = world(4).run(jobs.train_vs_stock, stage, 2, ep, 2, 3, steps, forced, 1, half)
    want = HALF_OPTIMIZERS.get(half, "FP16_UnfusedOptimizer" if stage == 0 else "DeepSpeedZeroOptimizer")
    dtype = jobs.jobs.HALF_DTYPES[half]
    assert all(res["on"]["optimizer"] == want and res["on"]["dtype"] == dtype for res in results), results[0]["on"]
    assert all(res["on"]["skipped"] == res["off"]["skipped"] for res in results), [r["on"]["skipped"] for r in results]
    offload = half in ("offload", "bf16-offload")           # ZeRO-Offload: the masters and moments on the host
    assert all(res[run]["offload"] == offload for res in results for run in ("off", "on")), results[0]["on"]
    if dtype == torch.float16 and stage:     # (DeepSpeed 0.19.8 scales no loss at ZeRO 0)
        assert results[0]["off"]["skipped"] >= 1, "the loss scale never overflowed: no skipped step was tested"
    for group in ([results[r] for r in range(4) if r // ep == g] for g in range(4 // ep)):   # one EP group each
        before, after, off, on = {}, {}, {}, {}
        for r in group:
            before.update(r["on"]["forced"]["before"])
            after.update(r["on"]["forced"]["after"])
            off.update(r["off"]["experts"])
            on.update(r["on"]["experts"])
        assert set(before) == set(after) and any(k.endswith(".fp32") for k in before)
        assert any(k.endswith("exp_avg_sq") for k in before) and before[next(iter(before))].dtype == dtype
        assert all(torch.equal(before[k], after[k]) for k in before), \
            [k for k in before if not torch.equal(before[k], after[k])]
        masters = [k for k in off if k.endswith((".fp32", "exp_avg", "exp_avg_sq"))]
        assert set(off) == set(on) and masters
        worst = max(float((off[k] - on[k]).abs().max()) for k in masters)
        assert worst <= (1e-5 if dtype == torch.float32 else 5e-2), worst
    for rank, res in enumerate(results):
        off, on = res["off"], res["on"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(off["losses"], on["losses"]))
        assert len(on["losses"]) == steps and rel <= (1e-5 if dtype == torch.float32 else 2e-2), \
            (rank, rel, off["losses"], on["losses"])
        assert on["moves"] == steps // 2 + 1 and on["homes"][0] == forced
