"""Hecate (schedule ``hecate``) on Megatron-core (patches/megatron_hecate.py): the plugin's layer against Megatron's
stock MoELayer on 4 gloo ranks (2 nodes x 2) under the CPU shims: fp64 outputs and every gradient <= 1e-9 with
copies really made, 20 training steps through Megatron's DDP and optimizer, checkpoints both ways; in this process
the section's rules as the Megatron adapter reads them and the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from moe_plugins.core.plugin_config import PluginConfig  # noqa: E402
from moe_plugins.patches import megatron_hecate as mh  # noqa: E402
from moe_plugins.patches.megatron_config import section_config  # noqa: E402
from moe_plugins.plugins import default_registry  # noqa: E402
from moe_plugins.tools.verify_megatron import MegatronVerifySpec  # noqa: E402
from tests.workers import megatron as jobs  # noqa: E402

WORLD, RPN = 4, 2
JOB_TIMEOUT_S = 1800


def spec(tp: int, ep: int, **kw) -> MegatronVerifySpec:
    return MegatronVerifySpec(world=WORLD, ranks_per_node=RPN, mp=tp, ep=ep, esp=1, tokens=8, schedule="hecate",
                              exchange="ragged", **kw)


def test_the_megatron_adapter_reads_the_section():
    cfg = section_config({"hecate": {"enabled": True, "extra_experts": 1}}, "moe_plugins")
    assert mh.hecate_on(cfg) and mh.hecate_plugin(cfg).schedule == "hecate" and cfg.exchange == "ragged"
    assert mh.hecate_plugin(section_config({}, "moe_plugins")).schedule == "baseline"
    with pytest.raises(ValueError) as err:
        section_config({"hecate": {"reshard_every": 2, "prefetch": True}, "esp": 2}, "moe_plugins")
    assert "reshard_every" not in str(err.value) and "prefetch" not in str(err.value)    # both run on Megatron
    assert "moe_plugins.esp (2) must be 1 or null with Hecate" in str(err.value)
    with pytest.raises(ValueError, match=r"Hecate is run by the DeepSpeed and Megatron-core adapters"):
        PluginConfig.from_dict({"hecate": {}}, **default_registry().config_choices())     # a reader without them
    cls = mh.hecate_class(cfg, default_registry().schedule_class("hecate"), SimpleNamespace(activation_func=F.silu))
    assert cls.options.extra_experts == 1 and cls.activation == "silu"

    def gelu_tanh(x):                  # the recipes' GPT-2 activation, known by its name and checked on a probe
        return F.gelu(x, approximate="tanh")

    def gelu_tanh_wrong(x):
        return F.gelu(x)
    gelu_tanh_wrong.__name__ = "gelu_tanh"
    assert mh.activation_name(SimpleNamespace(activation_func=gelu_tanh)) == "gelu_tanh"
    assert mh.activation_name(SimpleNamespace(activation_func=gelu_tanh_wrong)) is None


def test_experts_hecate_cannot_copy_are_named():
    config = SimpleNamespace(activation_func=torch.tanh, gated_linear_unit=True, bias_activation_fusion=True)
    problems = mh.expert_problems(config, torch.nn.Linear(2, 2), "megatron.moe.1")
    assert len(problems) == 4, problems
    assert "its experts are a Linear; Hecate copies SequentialMLP experts only" in problems[0]
    assert "activation_func ('tanh') must be F.gelu, F.relu, F.silu or a function named gelu_tanh" in problems[1]
    assert "gated_linear_unit (True) must be False" in problems[2]
    assert "bias_activation_fusion (True) must be False" in problems[3]


def _check(results, tol: float):
    jobs.assert_equivalent(results, tol)


@pytest.mark.parametrize("tp,ep", [(1, 4), (2, 2)], ids=["tp1-ep4", "tp2-ep2"])
def test_hecate_matches_stock_megatron_fp64(world, tp, ep):
    """Top-1 dropping padded to capacity, top-2 dropless, top-2 dropping: outputs, input gradients, every
    parameter gradient (experts' biases included at EP > 1) and the aux loss <= 1e-9; spAG and spRS ran."""
    specs = [spec(tp, ep, k=1, drop=True, capacity_factor=1.0, pad=True), spec(tp, ep, k=2, drop=False),
             spec(tp, ep, k=2, drop=True, capacity_factor=1.25), spec(tp, ep, k=2, drop=False, seed=3)]
    results = [r for rank in world(WORLD).run(jobs.equivalence_job, specs, timeout_s=JOB_TIMEOUT_S) for r in rank]
    _check(results, 1e-9)
    spag = [r["ledger"]["megatron.moe.1"].get("forward:spag@ep", {}).get("bytes", 0) for r in results]
    sprs = [r["ledger"]["megatron.moe.1"].get("backward:sprs@ep", {}).get("bytes", 0) for r in results]
    assert sum(spag) > 0 and sum(sprs) > 0                                     # copies were made and reduced back
    assert all("forward:all_gather@ep" in r["ledger"]["megatron.moe.1"] for r in results)   # Hecate's counts


def test_hecate_with_pipemoe_chunks_on_megatron(world):
    """PipeMoE's chunks at degree 3 (each chunk routed on its own over one spAG's copies, on the plugin's engines'
    pipeline lane): still stock Megatron's outputs and gradients in fp64."""
    specs = [spec(1, 4, k=2, drop=False, pipeline_degree=3), spec(1, 4, k=2, drop=True, capacity_factor=1.25,
                                                                pipeline_degree=3)]
    results = [r for rank in world(WORLD).run(jobs.equivalence_job, specs, timeout_s=JOB_TIMEOUT_S) for r in rank]
    _check(results, 1e-9)
    assert sum(r["ledger"]["megatron.moe.1"].get("forward:spag@ep", {}).get("bytes", 0) for r in results) > 0


def test_twenty_training_steps_through_megatron_ddp_equal_stock(world):
    results = world(WORLD).run(jobs.training_job, spec(2, 2, k=2, drop=False, dtype="float32"), 20, True,
                               timeout_s=JOB_TIMEOUT_S)
    for r in results:
        assert len(r["stock"]) == len(r["plugin"]) == 20
        for a, b in zip(r["stock"], r["plugin"]):
            assert abs(a - b) <= 1e-5 * abs(a), (r["stock"], r["plugin"])
        assert sum(r["stock"][-4:]) < sum(r["stock"][:4])
        stock_n, plugin_n = r["expert_buffer_params"]
        assert stock_n == plugin_n > 0


def test_checkpoints_load_both_ways(world):
    for r in world(WORLD).run(jobs.checkpoint_job, spec(2, 2, k=2, drop=False), timeout_s=JOB_TIMEOUT_S):
        assert r["keys"] == r["plugin_keys"] and r["attrs_equal"]
        assert r["err_plugin_to_stock"] <= 1e-12 and r["err_stock_to_plugin"] <= 1e-12


def test_early_gather_in_megatron_blocks_matches_stock(world):
    """``prefetch`` on Megatron: Megatron's own TransformerLayer built while the plugin is enabled issues its MoE
    layer's spAG from its forward pre-hook (before the attention), on the engine's pipeline lane; 4 calls in fp64
    equal the stock block's outputs and every gradient (<= 1e-9), with copies made from the second call (the first
    has no load to plan from); disable() takes the hook off."""
    from tests.workers.hecate_early_megatron import blocks_job
    for res in world(WORLD).run(blocks_job, 4, timeout_s=JOB_TIMEOUT_S):
        assert res["same_grads"] and max(res["err"]) <= 1e-9, res["err"]
        assert res["extra"][0] == 0 and all(n > 0 for n in res["extra"][1:]), res["extra"]
        assert res["hooked"] and res["pre_hooks"] == 1 and res["pre_hooks_after"] == 0
        assert res["measured"] == 4 and "gathered early" in res["notes"][0], res


def test_rematerialised_megatron_blocks_regather_early_and_match_stock(world):
    """``rematerialize`` on Megatron: two of Megatron's own TransformerLayers built while the plugin is enabled are
    linked into one re-gather chain (patches/megatron_hecate_early.py): 3 calls in fp64 equal the stock blocks'
    outputs and every gradient (<= 1e-9); the first layer's copies are gathered again on the lane when the second
    releases its copies, the second's when the backward reaches it, and none is alive after a call."""
    from tests.workers.hecate_early_megatron import remat_blocks_job
    for res in world(WORLD).run(remat_blocks_job, 3, timeout_s=JOB_TIMEOUT_S):
        assert len(res["err"]) == res["calls"] and max(res["err"]) <= 1e-9, res["err"]     # the same grads, equal
        assert res["regathers"] == [{"next_layer": 3}, {"own_output": 3}], res["regathers"]
        assert res["live"] == [0, 0] and all(n > 0 for n in res["extra"]), res
