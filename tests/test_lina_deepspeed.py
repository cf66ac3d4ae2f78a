"""Lina inside DeepSpeed (ZeRO 0/1/2) on gloo ranks: the dense gradients reduced as Lina's micro-ops during
backward, DeepSpeed's own dense collective replaced by the wait. Against the same plugin schedule without
``lina``: the reduced gradients bitwise equal at DP = 2 (fp32) and within 1e-12 at DP = 4 (fp64), with gradient
accumulation 2 and tied embeddings; 20-step losses within 1e-5; checkpoints load across the flag both ways;
from the ledger's timeline no micro-op starts while an MoE exchange is pending or in flight; bad input is
refused with every problem named, before anything is patched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_plugins.lina.config import LinaConfig
from tests.lina_checks import micro_op_order as _order
from tests.workers import lina_deepspeed as jobs

pytest.importorskip("deepspeed")

LINA = {"micro_op_mb": 0.0002}          # 200 bytes: every dense gradient is cut into several micro-ops


def _check(results, tolerance: float, bitwise: bool, steps: int, hooked: bool):
    waited = 0
    for rank, res in enumerate(results):
        assert res["steps"][0] == res["steps"][1] == steps
        assert max(res["diffs"]) <= tolerance, (rank, res["diffs"])
        assert res["bitwise"] or not bitwise, (rank, res["diffs"])
        rel = max(abs(a - b) / abs(a) for a, b in zip(res["stock_losses"], res["lina_losses"]))
        assert rel <= 1e-5, (rank, rel)
        (lina,) = res["lina"]
        assert res["stock_lina"] == []                                     # no section, no Lina
        assert res["left"] == (0, []), res["left"]     # engine.destroy() undid Lina's patches on it
        assert lina["mode"] == ("after-bucketing" if hooked else "boundary-hook")
        # DeepSpeed's dense collective was replaced by the wait at every reduction; expert-DP ones still ran
        # (inside ZeRO 1/2's average_tensor; ZeRO 0 reduces experts outside the wrapped call)
        assert lina["skipped"] >= steps and (lina["mode"] == "boundary-hook" or lina["passed"] >= steps), lina
        micro = [r for r in res["records"] if r["priority"] == "background"]
        assert micro and all(r["op"] == "all_reduce" and r["group"] == "dp" for r in micro)
        assert len(micro) > lina["submitted"] >= steps * lina["dense"]      # cut into micro-ops
        assert any(r["op"] == "all_to_all" for r in res["records"])
        waited += _order(res["records"])
    return waited


@pytest.mark.parametrize("stage,gas,zero,degree", [(0, 2, None, 1), (1, 2, None, 1), (2, 2, None, 1),
                                                   (1, 1, {"overlap_comm": True}, 1), (2, 1, {"overlap_comm": True}, 1),
                                                   (2, 1, None, 2)], ids=str)
def test_dp2_bitwise_and_20_steps(world, stage, gas, zero, degree):
    """With overlap_comm, ZeRO 1 buckets (and Lina submits) during backward at the boundary, as ZeRO 2 always
    does; DeepSpeed's reduction stream and double buffer stay its own. Degree 2: PipeMoE's pipelined layers
    on the same engine (its pipeline lane beside Lina's background lane), against the same degree without Lina."""
    results = world(2).run(jobs.compare, stage, gas, 20, LINA, zero, degree, timeout_s=300)
    assert results[0]["stock_losses"][-1] != results[0]["stock_losses"][0]
    hooked = stage == 2 or bool(zero and zero.get("overlap_comm"))
    _check(results, 0.0, True, 20, hooked)


@pytest.mark.parametrize("stage,gas", [pytest.param(1, 2, marks=pytest.mark.full(
    covered_by="[2-2] (ZeRO-Offload's reduction through average_tensor) and test_dp2_bitwise_and_20_steps at ZeRO 1")),
    (2, 2)])
def test_dp2_bitwise_with_zero_offload(world, stage, gas):
    """ZeRO-Offload (``offload_optimizer`` on the host; the torch Adam there): the reduced gradients DeepSpeed
    copies into its host fp32 partitions bitwise equal to the run without Lina, 20 steps' losses equal, the offload
    on in both runs."""
    results = world(2).run(jobs.compare, stage, gas, 20, LINA, {"offload_optimizer": {"device": "cpu"}}, 1,
                           {"zero_force_ds_cpu_optimizer": False}, timeout_s=300)
    assert all(res["offload"] == (True, True) for res in results)
    _check(results, 0.0, True, 20, stage == 2)


@pytest.mark.parametrize("stage,extra,scaling", [
    (0, {"prescale_gradients": True}, (("mul", 0.5), None)),
    (0, {"gradient_predivide_factor": 3.0}, (("mul", 1 / 3.0), ("mul", 1.5))),
    pytest.param(0, {"gradient_predivide_factor": 2.0}, (("mul", 0.5), None), marks=pytest.mark.full(
        covered_by="[0-predivide3] (the predivide path; at DP 2 a factor 2 skips the multiply after the sum)")),
    (1, {"prescale_gradients": True, "gradient_predivide_factor": 3.0}, (("div", 2.0), None))],
    ids=["0-prescale", "0-predivide3", "0-predivide2", "1-both"])
def test_prescale_and_predivide(world, stage, extra, scaling):
    """DeepSpeed's ``prescale_gradients`` and ``gradient_predivide_factor``: at ZeRO 0 Lina multiplies each dense
    gradient before its sum and the sum after it as ``allreduce_bucket`` would (``GradScaling``), and DeepSpeed's
    call runs undivided: bitwise equal to the run without Lina at DP 2 (gradient accumulation 2), 20 steps'
    losses equal. ZeRO 1's reduce-scatter path reads neither setting, with Lina or without."""
    results = world(2).run(jobs.compare, stage, 2, 20, LINA, None, 1, extra, timeout_s=300)
    _check(results, 0.0, True, 20, False)
    read = (extra.get("prescale_gradients", False), extra.get("gradient_predivide_factor", 1.0))
    for res in results:
        assert res["read"] == (read, read), res["read"]        # DeepSpeed took the settings in both runs
        assert res["lina"][0]["scaling"] == scaling, res["lina"][0]["scaling"]


@pytest.mark.parametrize("half,extra", [
    ("bf16", {"gradient_predivide_factor": 3.0}),
    pytest.param("fp16", {}, marks=pytest.mark.full(
        covered_by="[bf16-extra0] (the cast, the fp32 sum and the copy back; fp16's loss scale is the gradients')"))],
    ids=["bf16-predivide3", "fp16"])
def test_fp32_communication_at_zero_0(world, half, extra):
    """``communication_data_type`` fp32 with 16-bit gradients at ZeRO 0: DeepSpeed casts its bucket to fp32, sums
    and scales there, and copies back; Lina does the same per dense gradient (an fp32 copy summed by the micro-ops,
    scaled, copied back at the wait). Bitwise equal to the run without Lina at DP 2 (gradient accumulation 2), 20
    steps' losses equal; the micro-ops moved fp32. With factor 3 a sum in the gradients' own dtype would differ
    (the products round in bf16)."""
    setting = {"bf16": {"enabled": True}} if half == "bf16" else {"fp16": {"enabled": True, "loss_scale": 1024}}
    results = world(2).run(jobs.compare, 0, 2, 20, LINA, None, 1,
                           {**setting, "communication_data_type": "fp32", **extra}, timeout_s=300)
    low = torch.bfloat16 if half == "bf16" else torch.float16
    assert all(g.dtype == low for g in results[0]["grads"][0]), [g.dtype for g in results[0]["grads"][0]]
    _check(results, 0.0, True, 20, False)
    micro = [r for r in results[0]["records"] if r["priority"] == "background"]
    assert micro and all(r["bytes"] == 4 * r["numel"] for r in micro)      # summed in fp32


@pytest.mark.parametrize("gas", [1, 2])
def test_bf16_at_zero_0(world, gas):
    """bf16 at ZeRO 0: DeepSpeed 0.19.8 wraps the torch optimizer in its FP16_UnfusedOptimizer (an fp32 master per
    parameter) and reduces the bf16 gradients at the boundary as at fp32 ZeRO 0; Lina's micro-ops (in bf16) give
    them bitwise at DP 2 over 20 steps, the losses equal."""
    results = world(2).run(jobs.compare, 0, gas, 20, LINA, None, 1, {"bf16": {"enabled": True}}, timeout_s=300)
    assert all(g.dtype == torch.bfloat16 for g in results[0]["grads"][0]), [g.dtype for g in results[0]["grads"][0]]
    _check(results, 0.0, True, 20, False)


@pytest.mark.parametrize("stage,gas", [(0, 2), (1, 2), (2, 1)])
def test_fp16_bitwise_at_dp_2_with_the_same_overflows(world, stage, gas):
    """fp16 under DeepSpeed's dynamic loss scale (tests/workers/deepspeed.py's FP16, from 2^15; its ``cpu_half``
    lever lets DeepSpeed build fp16 on a CPU): the reduced gradients bitwise at DP 2 over 20 steps, the losses
    equal, the same steps skipped for overflow (the order of division and sum is tested at DP 4, below).
    DeepSpeed 0.19.8 scales no loss at ZeRO 0, so no step overflows there."""
    from tests.workers.deepspeed import FP16
    results = world(2).run(jobs.compare, stage, gas, 20, LINA, None, 1, {"fp16": dict(FP16)}, timeout_s=300)
    assert all(g.dtype == torch.float16 for g in results[0]["grads"][0]), [g.dtype for g in results[0]["grads"][0]]
    _check(results, 0.0, True, 20, stage == 2)
    skipped = {res["skipped"] for res in results}
    assert len(skipped) == 1 and len(set(*skipped)) == 1, skipped
    assert stage == 0 or skipped.pop()[0] >= 1, "no step overflowed: the scaled sums were not tested"


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_at_dp_4_overflows_where_stock_does(world, stage):
    """fp16 at DP 4 (20 steps, dynamic loss scale from 2^15): fp16 sums in another order round differently, so
    the gradients are not bitwise, but every step's reduced gradients are finite in Lina's run exactly where they
    are in stock's (summed before the division, as Lina did first, some overflowed where stock's did not: the
    losses then parted by 10%), the same steps skipped, the losses within 1e-2 (4e-3 measured)."""
    from tests.workers.deepspeed import FP16
    results = world(4).run(jobs.compare, stage, 1, 20, LINA, None, 1, {"fp16": dict(FP16)}, timeout_s=300)
    for rank, res in enumerate(results):
        assert all(stock == lina for stock, lina in res["finite"]), (rank, res["finite"])
        assert not all(stock for stock, _ in res["finite"]), "no step overflowed: the scaled sums were not tested"
        assert res["skipped"][0] == res["skipped"][1] >= 1, res["skipped"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(res["stock_losses"], res["lina_losses"]))
        assert rel <= 1e-2, (rank, rel)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_dp4_within_rounding(world, stage):
    """DeepSpeed on CPU reduces only fp32 and bf16 gradients (ZeRO 0 refuses fp64 ones, ZeRO 1/2 bucket them
    in fp32), so DP = 4 is compared in fp32: dividing by 4 is exact, and the sums differ from stock's only in
    gloo's summation order (cut into micro-ops): measured up to about 7e-7 of each tensor's largest entry (a few
    ulp; partial sums may exceed the result), bounded here by 4e-6. A missing or doubled contribution is O(1).
    The fp64 DP = 4 bound (1e-12) of the micro-op reduction itself is tests/test_lina.py's."""
    results = world(4).run(jobs.compare, stage, 2, 4, LINA, timeout_s=300)
    waited = _check(results, 4e-6, False, 4, stage == 2)
    assert waited > 0, "no micro-op ever waited for an exchange: the order check exercised nothing"


LINA_ON = {"schedule": "baseline", "lina": {"micro_op_mb": 0.0002}}


@pytest.mark.parametrize("save,load,stage", [(LINA_ON, None, 1), (None, LINA_ON, 2)],
                         ids=["lina-to-stock-zero1", "stock-to-lina-zero2"])
def test_checkpoint_across_the_flag(world, tmp_path, save, load, stage):
    results = world(2).run(jobs.checkpoint_round_trip, save, load, stage, str(tmp_path), timeout_s=300)
    assert len(results[0]["lina_log"]) == 1 and "Lina reduces" in results[0]["lina_log"][0]   # one side had Lina
    for rank, res in enumerate(results):
        saver, loader = res["saver"], res["loader"]
        assert saver["keys"] == loader["keys"]
        assert all(torch.equal(saver["state"][n], loader["state"][n]) for n in saver["state"])
        assert not all(torch.equal(saver["state"][n], loader["initial"][n]) for n in saver["state"])
        rel = max(abs(a - b) / abs(a) for a, b in zip(saver["after"], loader["after"]))
        assert rel <= 1e-5, (rank, saver["after"], loader["after"])


def _fake_engine(stage=2, contiguous=True, fp16=False, bf16=False, comm=torch.float32, prescale=False,
                 predivide=1.0, offload=None, zenflow=None, accumulate=None):
    config = SimpleNamespace(prescale_gradients=prescale, gradient_predivide_factor=predivide,
                             zero_config=SimpleNamespace(zenflow=zenflow))
    return SimpleNamespace(_config=config, zero_optimization_stage=lambda: stage,
                           zero_contiguous_gradients=lambda: contiguous, zero_offload_optimizer=lambda: offload,
                           fp16_enabled=lambda: fp16, bfloat16_enabled=lambda: bf16, communication_data_type=comm,
                           sequence_parallel_size=1,
                           get_data_types=lambda: (torch.bfloat16 if bf16 else torch.float32, accumulate or comm))


def test_settings_lina_cannot_reproduce_are_all_named():
    from moe_plugins.patches.deepspeed_lina import config_problems
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Embedding(3, 2, sparse=True))
    problems = config_problems(_fake_engine(stage=3, comm=torch.float16, prescale=True, predivide=2.0),
                               model, LinaConfig(packing=2), "0.20.0")
    text = "; ".join(problems)
    for needle in ("moe_plugins.lina needs DeepSpeed 0.19.8", "found 0.20.0",
                   "zero_optimization.stage 0, 1 or 2 (got 3)", "nn.Embedding(sparse=True): 1"):
        assert needle in text, (needle, text)
    assert len(problems) == 3             # packing's own settings: tests/test_lina_packing_deepspeed.py
    assert "prescale" not in text and "predivide" not in text     # DeepSpeed's scaling: test_prescale_and_predivide
    more = config_problems(_fake_engine(stage=1, contiguous=False, offload=object(), zenflow={}), model.float()[:1],
                           LinaConfig(), "0.19.8")
    assert len(more) == 2 and all(field in text for field, text in zip(
        ("zero_optimization.contiguous_gradients", "zero_optimization.zenflow"), more)), more   # offload: runs
    assert config_problems(_fake_engine(stage=0, bf16=True, comm=torch.bfloat16), model[:1].bfloat16(),
                           LinaConfig(), "0.19.8") == []                 # FP16_UnfusedOptimizer: test_bf16_at_zero_0
    assert "BF16_Optimizer reduces its own fp32 copies" in config_problems(
        _fake_engine(stage=1, bf16=True, comm=torch.bfloat16, accumulate=torch.float32), model[:1].bfloat16(),
        LinaConfig(), "0.19.8")[0]
    assert config_problems(_fake_engine(stage=2), model[:1].float(), LinaConfig(), "0.19.8") == []
    for stage in (1, 2):                  # ZeRO 0 sums in communication_data_type: test_fp32_communication_at_zero_0
        (comm,) = config_problems(_fake_engine(stage=stage, bf16=True, accumulate=torch.bfloat16), model[:1].bfloat16(),
                                  LinaConfig(), "0.19.8")
        assert f"communication_data_type equal to the gradients' dtype (torch.bfloat16) at ZeRO {stage}" in comm
    assert config_problems(_fake_engine(stage=0, bf16=True), model[:1].bfloat16(), LinaConfig(), "0.19.8") == []


def test_grad_scaling_follows_deepspeed_arithmetic():
    """allreduce_bucket's (ZeRO 0) and average_tensor's reduce-scatter (ZeRO 1/2) scaling, case by case: nothing
    without averaging, prescale wins over the factor, no multiply after the sum when the factor is the DP size."""
    from moe_plugins.patches.deepspeed_lina_config import GradScaling, reduce_scatter_scaling, zero0_scaling
    assert zero0_scaling(False, True, 3.0, 2.0) == GradScaling() and not GradScaling().active
    assert zero0_scaling(True, True, 3.0, 4.0) == GradScaling(before=("mul", 0.25))
    assert zero0_scaling(True, False, 1.0, 4.0) == GradScaling(after=("mul", 0.25))
    assert zero0_scaling(True, False, 4.0, 4.0) == GradScaling(before=("mul", 0.25))
    assert zero0_scaling(True, False, 2.0, 8.0) == GradScaling(before=("mul", 0.5), after=("mul", 0.25))
    assert reduce_scatter_scaling(True, 4.0) == GradScaling(before=("div", 4.0))
    assert not reduce_scatter_scaling(False, 4.0).active
    grad = torch.tensor([3.0, 6.0], dtype=torch.float64)
    GradScaling.apply(("div", 3.0), grad)
    GradScaling.apply(("mul", 0.5), grad)
    GradScaling.apply(None, grad)
    assert grad.tolist() == [0.5, 1.0]


def test_bad_input_through_deepspeed_initialize(world):
    out = world(2).run(jobs.bad_inputs, timeout_s=300)[0]
    settings = out["settings"]
    for needle in ("contiguous_gradients true with ZeRO 2", "communication_data_type equal to the gradients"):
        # packing's own: tests/test_lina_packing_deepspeed.py
        assert needle in settings, (needle, settings)
    assert out["settings_lina_engines"] == 0
    assert "exactly one layout; found 2" in out["layouts"], out["layouts"]
    assert out["layouts_lina_engines"] == 0 and out["classes_untouched"]
    # "auto" with no cost profile cached: refused when the first layer is validated, before its groups
    assert 'moe_plugins.lina.micro_op_mb ("auto") needs a cost profile' in out["auto_without_profile"], out
    assert "none is cached" in out["auto_without_profile"] and out["auto_without_profile_lina_engines"] == 0
