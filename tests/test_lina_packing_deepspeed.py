"""Lina's expert packing on DeepSpeed (patches/deepspeed_lina_packing.py): 4 gloo ranks, ZeRO 0, the tiny MoE model
of tests/workers/deepspeed.py (4 experts at EP 4), trained with ``"lina": {"packing": p}`` against stock DeepSpeed."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("deepspeed")

from moe_plugins.core.plugin_config import PluginConfig  # noqa: E402
from moe_plugins.lina.config import LinaConfig  # noqa: E402
from moe_plugins.lina.packing import decide_packing, MicroOpTimes  # noqa: E402
from moe_plugins.patches.deepspeed_hecate import config_choices  # noqa: E402
from moe_plugins.patches.deepspeed_lina_packing import config_problems  # noqa: E402
from tests.workers import lina_packing_deepspeed as jobs  # noqa: E402

STEPS = 20


def _merged(results, run):
    out = {}
    for res in results:
        out.update(res[run]["experts"])
    return out


LANCET = {"defer_wgrad": True}


@pytest.mark.parametrize("packing,ep,k,stage,gas,degree,lancet", [
    (2, 4, 1, 0, 1, 1, None), (4, 4, 2, 0, 1, 1, None), ("auto", 4, 1, 0, 1, 1, None), (2, 4, 1, 0, 2, 1, None),
    (2, 4, 1, 1, 1, 1, None), (2, 4, 2, 2, 1, 1, None), ("auto", 4, 1, 1, 1, 1, None), ("auto", 4, 2, 2, 1, 1, None),
    (2, 4, 2, 0, 1, 2, None), ("auto", 4, 1, 2, 1, 2, None), (2, 4, 2, 2, 1, 1, LANCET), ("auto", 4, 1, 1, 1, 1, LANCET)],
    ids=["p2-k1", "p4-k2", "auto", "p2-gas2", "p2-zero1", "p2-k2-zero2", "auto-zero1", "auto-k2-zero2",
         "p2-k2-pipemoe2", "auto-zero2-pipemoe2", "p2-k2-zero2-lancet", "auto-zero1-lancet"])
def test_packed_training_equals_stock_deepspeed(world, packing, ep, k, stage, gas, degree, lancet):
    """A fixed packing regroups when the optimizer is built, before the first step (at ZeRO 1/2 before ZeRO
    flattens and partitions it over the packed expert-DP group); "auto" decides at steps 10, 14, 18 from the
    agreed micro-op timings (at ZeRO 1/2 the ZeRO optimizer is rebuilt around each regroup, its master values
    and moments carried). Either way the 20 losses are stock's (fp32, 1e-5), and so are the experts and their
    Adam moments, matched by global expert id over every rank (the packed layout's replicas hold equal copies);
    with gradient accumulation 2 the packing changes at optimizer steps only. Under PipeMoE's degree 2 the
    layers' pipelined executor and schedule are rebuilt on the packed layout's engine, and Lina's reducer moves to
    it (one engine orders the exchanges and the gradient micro-ops)."""
    results = world(4).run(jobs.train_vs_stock, packing, ep, k, 3, STEPS, stage, gas, degree, lancet)
    for rank, res in enumerate(results):
        off, on = res["off"], res["on"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(off["losses"], on["losses"]))
        assert len(on["losses"]) == STEPS and rel <= 1e-5, (rank, rel)
        assert on["wrapped_after"] == []                       # destroy() took the engine's wrappers off
        assert on["packings"] == results[0]["on"]["packings"]  # every rank packs alike, at the same step
    on = results[0]["on"]
    if packing == "auto":
        assert [d[0] for d in on["decisions"]] == [s for s in (10, 14, 18) if s <= STEPS][:len(on["decisions"])]
        assert on["decisions"], on
        current = 1
        for step, expert_s, a2a_s, frm, to in on["decisions"]:
            times = MicroOpTimes(expert_s=expert_s, expert_n=1, a2a_s=a2a_s, a2a_n=1)
            assert frm == current and to == decide_packing(frm, times, ep), on["decisions"]
            assert on["packings"][step - 1] == to
            current = to
        final = current
    else:
        assert set(on["packings"]) == {packing}
        final = packing
    assert jobs.local_counts(results) == [4 // ep * final] * 4
    assert on["group_names"] == [f"ep_size_{ep // final}"]
    assert on["lane"] == (degree, True, ep // final) if degree > 1 else on["lane"][0] == 1
    if lancet is not None:        # Lancet's exchanges on the packed layout's engine, where Lina's reducer is too
        assert on["lane"][1:] == (True, ep // final) and on["lancet_runs"] > 0, on["lane"]
    if stage == 0:       # inp, gate, head: 5; 4 per local expert (ZeRO 1/2 hold one flat partition per group)
        assert on["optimizer_params"] == 5 + 4 * (4 // ep * final)
    moves = 1 if packing != "auto" else sum(frm != to for _, _, _, frm, to in on["decisions"])
    assert on["regroups"] == ["regroup:all_to_all@ep"] * moves
    off_experts, on_experts = _merged(results, "off"), _merged(results, "on")
    assert set(off_experts) == set(on_experts) and off_experts
    worst = max(float((off_experts[n] - on_experts[n]).abs().max() / off_experts[n].abs().max().clamp_min(1e-12))
                for n in off_experts)
    assert worst <= 1e-4, worst
    for res in results:          # the replicas of an expert (expert-DP grew by the packing) hold the same values
        for name, value in res["on"]["experts"].items():
            assert torch.equal(value, on_experts[name]), name


@pytest.mark.parametrize("packing,stage", [(2, 2), pytest.param("auto", 1, marks=pytest.mark.full(
    covered_by="[p2-zero2] (packing's regroup with ZeRO-Offload) and test_packed_training_equals_stock_deepspeed"
               "[auto-zero1] (auto's rebuilt ZeRO optimizer)"))], ids=["p2-zero2", "auto-zero1"])
def test_packing_with_zero_offload_equals_stock(world, packing, stage):
    """ZeRO-Offload (the fp32 partitions and Adam's moments on the host; the torch Adam there): a fixed p regroups
    before ZeRO partitions, "auto" rebuilds the offloaded ZeRO optimizer around its regroup; 20 losses equal stock
    DeepSpeed's offloaded run (1e-5), the experts and their moments by global id within 1e-4 relative, the offload
    on in both runs."""
    results = world(4).run(jobs.train_vs_stock, packing, 4, 1, 3, STEPS, stage, 1, 1, None, "offload")
    assert all(res["off"]["offload"] and res["on"]["offload"] for res in results)
    _equal_to_stock(results)


def test_packing_with_gradient_predivide_factor_equals_stock(world):
    """DeepSpeed's ``gradient_predivide_factor`` (3, ZeRO 0; packing 2): Lina multiplies the dense gradients around
    their sums as DeepSpeed's ``allreduce_bucket`` would, DeepSpeed the experts' over the packed expert-DP group;
    20 losses equal stock DeepSpeed's with the same factor (1e-5), the experts and their moments within 1e-4."""
    results = world(4).run(jobs.train_vs_stock, 2, 4, 1, 3, STEPS, 0, 1, 1, None, "predivide")
    assert all(res["off"]["predivide"] == res["on"]["predivide"] == 3.0 for res in results)
    _equal_to_stock(results)


def _equal_to_stock(results):
    for rank, res in enumerate(results):
        off, on = res["off"], res["on"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(off["losses"], on["losses"]))
        assert len(on["losses"]) == STEPS and rel <= 1e-5, (rank, rel)
        assert on["packings"] == results[0]["on"]["packings"] and on["packings"][-1] > 1, on["packings"]
    off_experts, on_experts = _merged(results, "off"), _merged(results, "on")
    assert set(off_experts) == set(on_experts) and any(n.endswith("exp_avg_sq") for n in off_experts)
    worst = max(float((off_experts[n] - on_experts[n]).abs().max() / off_experts[n].abs().max().clamp_min(1e-12))
                for n in off_experts)
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("packing,stage,half", [(2, 2, True), ("auto", 1, True), (2, 0, True), ("auto", 0, True),
                                               ("auto", 1, "fp16"), ("auto", 0, "fp16")],
                         ids=["p2-zero2", "auto-zero1", "p2-zero0", "auto-zero0", "fp16-auto-zero1", "fp16-auto-zero0"])
def test_half_packing_carries_the_fp32_masters(world, packing, stage, half):
    """DeepSpeed's bf16 and fp16 under ZeRO 1/2 (the model 16-bit, ZeRO's flat partitions its fp32 masters): a fixed p
    regroups before ZeRO partitions; "auto" rebuilds the ZeRO optimizer around the regroup with every expert's
    fp32 master and moments carried whole. At ZeRO 0 (DeepSpeed's FP16_UnfusedOptimizer: an fp32 master per
    parameter) both rebuild that optimizer around the regroup, every master and its moments carried. In fp16
    (DeepSpeed's dynamic loss scale, under tests/workers/deepspeed.py's ``cpu_half``) the rebuilt optimizer goes
    on with the old one's loss scale: the same steps skipped and the same scale after every step as stock's. 20
    steps track stock DeepSpeed's run (losses within 2e-2 relative; the packed copies' gradients are summed over
    the grown expert-DP), every expert's fp32 master and moments by global id within 5e-2 of stock's, and the
    replicas of each expert (values, master, moments) are bitwise equal. Unpacked and packed again after the run
    (two more regroups, each rebuilding the optimizer), every expert's values, master and moments are bitwise what
    they were (masters re-made from the 16-bit values would not be)."""
    results = world(4).run(jobs.train_vs_stock, packing, 4, 1, 3, STEPS, stage, 1, 1, None, half)
    for rank, res in enumerate(results):
        off, on = res["off"], res["on"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(off["losses"], on["losses"]))
        assert len(on["losses"]) == STEPS and rel <= 2e-2, (rank, rel, off["losses"], on["losses"])
        assert on["packings"] == results[0]["on"]["packings"] and on["packings"][-1] > 1, on["packings"]
        assert (on["skipped"], on["scales"]) == (off["skipped"], off["scales"]), (on["scales"], off["scales"])
    if half == "fp16":           # the scale moved during the run (ZeRO 1/2 also overflowed: DeepSpeed 0.19.8
        scales = results[0]["off"]["scales"]                               # scales no loss at ZeRO 0)
        assert len(set(scales)) > 1 and (stage == 0 or results[0]["off"]["skipped"] >= 1), scales
    off_experts, on_experts = _merged(results, "off"), _merged(results, "on")
    masters = [n for n in off_experts if n.endswith((".fp32", "exp_avg", "exp_avg_sq"))]
    assert set(off_experts) == set(on_experts) and any(n.endswith(".fp32") for n in masters)
    worst = max(float((off_experts[n] - on_experts[n]).abs().max()) for n in masters)
    assert worst <= 5e-2, worst            # 2e-3 measured
    unpacked = {}
    for res in results:
        unpacked.update(res["on"]["unpacked_experts"])
        assert all(torch.equal(v, res["on"]["experts"][n]) for n, v in res["on"]["experts_after"].items())
        for name, value in res["on"]["experts"].items():
            assert torch.equal(value, on_experts[name]), name
    assert set(unpacked) == set(on_experts) and all(torch.equal(unpacked[n], on_experts[n]) for n in unpacked)


@pytest.mark.parametrize("save,load,via_tool,stage", [(2, None, False, 0), (None, 2, False, 0), (2, 4, False, 0),
                                                      (None, 2, True, 0), (2, None, False, 1), (None, 2, True, 1),
                                                      (2, 4, False, 2)],
                         ids=["packed-to-stock", "stock-to-packed", "p2-to-p4", "stock-to-packed-recipe-resume",
                              "zero1-packed-to-stock", "zero1-stock-to-packed-recipe-resume", "zero2-p2-to-p4"])
def test_checkpoints_are_stock_files_both_ways(world, tmp_path, save, load, via_tool, stage):
    """Saved while packed, the files are stock DeepSpeed's (the experts are unpacked around the write): a stock
    engine loads them, and the other way, also through the recipes' resume (which reads the engine's checkpoint
    EP: the stock one); the loaded experts and Adam moments equal the saved ones bitwise, and the resumed losses
    the saver's."""
    sections = {None: None, 2: jobs.section(2), 4: jobs.section(4)}
    results = world(4).run(jobs.checkpoint_across, sections[save], sections[load], 4, str(tmp_path), 4, via_tool,
                           stage)
    saved, loaded = {}, {}
    for res in results:
        saved.update(res["saver"]["experts"])
        loaded.update(res["loader"]["experts"])
        assert res["saver"]["packing"] == (save or 1) and res["loader"]["packing"] == (load or 1)
        rel = max(abs(a - b) / abs(a) for a, b in zip(res["saver"]["after"], res["loader"]["after"]))
        assert rel <= 1e-6, (res["saver"]["after"], res["loader"]["after"])
    assert set(saved) == set(loaded) and any(n.endswith("exp_avg") for n in saved)
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)


def test_refusals_through_deepspeed_initialize_name_the_field_and_register_nothing(world):
    """ZeRO 3 is refused before set-up; a packing that does not divide ep after the layers are swapped, before
    anything is patched or regrouped: no packed DeepSpeed group is left registered either way."""
    zero3, three = world(4).run(jobs.refused, jobs.section(2), 3), world(4).run(jobs.refused, jobs.section(3))
    for res in zero3:
        assert "moe_plugins.lina.packing (2) runs on zero_optimization.stage 0, 1 or 2, and it is 3" in res["error"], res
        assert res["extra_groups"] == []
    for res in three:
        assert "moe_plugins.lina.packing (3) must divide ep (4)" in res["error"], res
        assert res["extra_groups"] == []


def test_config_problems_name_every_field():
    cfg = PluginConfig.from_dict({"schedule": "parm-s1", "pipeline_degree": "auto", "esp": 2,
                                  "lina": {"packing": "auto", "inference": {"table": "t.json"}}}, **config_choices())
    cfg = dataclasses.replace(cfg, hecate={"enabled": True},   # sections the host's across-rules may refuse first
                              lancet={"partitions": 2})
    engine = SimpleNamespace(zero_optimization_stage=lambda: 2, fp16_enabled=lambda: True,
                             bfloat16_enabled=lambda: False, device=torch.device("cuda", 0))
    problems = config_problems(engine, cfg, LinaConfig.from_dict(cfg.lina))
    text = "\n".join(problems)
    for needle in ("moe_plugins.schedule is 'parm-s1'", "an integer moe_plugins.pipeline_degree (got 'auto')",
                   "moe_plugins.esp 1 (got 2)",
                   "does not combine with moe_plugins.hecate", "does not combine with moe_plugins.lina.inference",
                   '"auto" times the micro-ops by the wall clock', "does not combine with moe_plugins.lancet.partitions "
                   "(2): \"auto\" times the schedule's micro-ops"):
        assert needle in text, (needle, problems)
    assert len(problems) == 7 and not any("fp16" in p for p in problems)       # fp16 packs (its loss scale carried)
    assert config_problems(engine, cfg, LinaConfig.from_dict({"packing": 1})) == []
    assert not any("lancet" in p for p in config_problems(engine, cfg, LinaConfig.from_dict({"packing": 2})))
    bf16 = {stage: SimpleNamespace(zero_optimization_stage=lambda s=stage: s, fp16_enabled=lambda: False,
                                   bfloat16_enabled=lambda: True, device=torch.device("cpu")) for stage in (0, 2)}
    plain = PluginConfig.from_dict({"lina": {"packing": 2}}, **config_choices())
    assert config_problems(bf16[2], plain, LinaConfig.from_dict(plain.lina)) == []      # bf16 at ZeRO 1/2 packs
    assert config_problems(bf16[0], plain, LinaConfig.from_dict(plain.lina)) == []      # and at ZeRO 0
    accumulating = SimpleNamespace(zero_optimization_stage=lambda: 1, fp16_enabled=lambda: False,
                                   bfloat16_enabled=lambda: True, device=torch.device("cpu"),
                                   get_data_types=lambda: (torch.bfloat16, torch.float32))
    assert config_problems(accumulating, plain, LinaConfig.from_dict(plain.lina)) == [
        "moe_plugins.lina.packing (2) does not rebuild DeepSpeed's BF16_Optimizer (bf16 at zero_optimization.stage "
        "1 with data_types.grad_accum_dtype fp32): accumulate in bf16, or use stage 2"]
