"""Hecate (FSSDP, schedule ``hecate``) on DeepSpeed's ``deepspeed.moe`` layer, 4 gloo ranks (2 nodes x 2), against
stock DeepSpeed: fp64 outputs and every gradient, training under ZeRO 0, 1 and 2, checkpoints across Hecate on and
off, and the refusals (docs/hecate.md, "On DeepSpeed")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moe_plugins.core.plugin_config import PluginConfig
from moe_plugins.patches.deepspeed_hecate import config_choices, hecate_class, hecate_config, hecate_on
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify_deepspeed import DeepSpeedVerifySpec, host_spec_problems, run_rank
from tests.workers import deepspeed as ds_jobs
from tests.workers import hecate_deepspeed as jobs

pytest.importorskip("deepspeed")

WORLD = 4
HECATE = {"hecate": {"enabled": True}}


def _spec(**kw) -> DeepSpeedVerifySpec:
    base = dict(world=WORLD, ranks_per_node=2, experts=8, tokens=16, hidden=8, ffn=16, min_capacity=0,
                dtype="float64", schedule="hecate", exchange="ragged", skew=6.0)
    base.update(kw)
    spec = DeepSpeedVerifySpec(**base)
    assert host_spec_problems(spec) == []
    return spec


# ---- config (pure) ---------------------------------------------------------------------------------------

def test_the_deepspeed_adapter_reads_the_section_and_other_readers_refuse_it():
    on = PluginConfig.from_dict(HECATE, **config_choices())
    assert hecate_on(on) and on.exchange == "padded"         # absent exchange: the adapter runs it ragged
    assert hecate_on(PluginConfig.from_dict({"schedule": "hecate"}, **config_choices()))
    assert not hecate_on(PluginConfig.from_dict({"hecate": {"enabled": False}}, **config_choices()))
    assert not hecate_on(PluginConfig(enabled=False, hecate={}))
    with pytest.raises(ValueError, match=r"moe_plugins\.exchange \('padded'\) cannot be used with Hecate"):
        PluginConfig.from_dict({**HECATE, "exchange": "padded"}, **config_choices())
    with pytest.raises(ValueError, match=r"moe_plugins\.hecate: Hecate is run by the DeepSpeed and Megatron-core"):
        PluginConfig.from_dict(HECATE, **default_registry().config_choices())     # a reader without their rules
    tanh = _moe(nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 8)))
    cls = hecate_class(PluginConfig(hecate={"extra_experts": 3}), default_registry().schedule_class("hecate"), tanh)
    assert cls.options.extra_experts == 3 and cls.name == "hecate" and cls.activation == "gelu_tanh"
    base = default_registry().schedule_class("baseline")
    assert hecate_class(PluginConfig(), base, tanh) is base


def _moe(*experts):
    """What hecate_config reads of a deepspeed.moe MoE module."""
    return SimpleNamespace(deepspeed_moe=SimpleNamespace(experts=SimpleNamespace(deepspeed_experts=nn.ModuleList(
        experts)), gate=SimpleNamespace(wg=nn.Linear(8, 2, bias=False))))


def test_a_plugin_config_given_directly_is_checked_too():
    ffn = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    assert hecate_config(PluginConfig(hecate={}), _moe(ffn), "moe") == PluginConfig(
        hecate={}, schedule="hecate", exchange="ragged")
    assert hecate_config(PluginConfig(hecate={}, pipeline_degree=2), _moe(ffn), "moe").pipeline_degree == 2
    assert hecate_config(PluginConfig(hecate={}, pipeline_degree="auto"), _moe(ffn), "moe").pipeline_degree == "auto"
    with pytest.raises(ValueError, match=r"moe_plugins\.pipeline_degree \('auto'\) must be 1 with "
                                         r"moe_plugins\.hecate\.rematerialize"):
        hecate_config(PluginConfig(hecate={"rematerialize": True}, pipeline_degree="auto"), _moe(ffn), "moe")
    with pytest.raises(ValueError, match=r"moe_plugins\.hecate\.extra_experts \(0\) must be an integer >= 1"):
        hecate_config(PluginConfig(hecate={"extra_experts": 0}), _moe(ffn), "moe")
    odd = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    with pytest.raises(ValueError, match=r"layer moe with Hecate: expert moe\.deepspeed_moe\.experts\.deepspeed_experts"
                                         r"\.1 \(torch\.nn\.modules\.container\.Sequential\) is not nn\.Sequential"):
        hecate_config(PluginConfig(hecate={}), _moe(ffn, odd), "moe")
    with pytest.raises(ValueError, match=r"experts\.0 \(torch\.nn\.modules\.linear\.Linear\) is not"):
        hecate_config(PluginConfig(schedule="hecate"), _moe(nn.Linear(8, 8)), "moe")
    with pytest.raises(ValueError, match=r"the local experts use several activations \(gelu, relu\)"):
        hecate_config(PluginConfig(hecate={}), _moe(ffn, nn.Sequential(nn.Linear(8, 16), nn.GELU(),
                                                                        nn.Linear(16, 8))), "moe")
    with pytest.raises(ValueError, match=r"moe_plugins\.lina\.inference cannot be used with Hecate"):
        hecate_config(PluginConfig(hecate={}, lina={"inference": {}}), _moe(ffn), "moe")
    assert hecate_config(PluginConfig(), None, "moe") == PluginConfig()       # Hecate off: untouched


# ---- fp64 against stock DeepSpeed ----------------------------------------------------------------------

@pytest.mark.parametrize("combo", [dict(ep=4, k=1, drop=False), dict(ep=4, k=2, drop=True),
                                   dict(ep=4, k=2, drop=False), dict(ep=2, k=1, drop=True),
                                   dict(ep=2, k=2, drop=False), dict(ep=4, k=2, drop=False, gelu="tanh"),
                                   dict(ep=4, k=2, drop=False, degree=3), dict(ep=4, k=1, drop=True, degree=3)],
                         ids=str)
def test_fp64_hecate_equals_stock_deepspeed(world, combo):
    """gelu "tanh": the experts use GPT-2's gelu_new (nn.GELU(approximate="tanh")), as the GPT-2 recipe's do.
    degree 3: PipeMoE's chunks (each piece routed on its own, the copies shared), on the engine's pipeline lane."""
    combo = dict(combo)
    gelu, degree = combo.pop("gelu", "none"), combo.pop("degree", 1)
    section = {**HECATE, "pipeline_degree": degree}
    report = world(WORLD).run(jobs.fp64_against_stock, _spec(**combo), section, gelu)[0]
    assert report["ok"], report
    for key in ("max_err_out", "max_err_grad_in", "max_err_grad_w", "max_err_aux"):
        assert report[key] <= 1e-9, (key, report[key])
    # the same gate calls, capacity and dropped routes on every rank; the expert gradients per global id
    assert report["routing_equal"] and report["expert_ids_equal"] and report["state_keys_equal"]
    assert report["attrs_equal"]
    assert (report["dropped_routes"] > 0) == combo["drop"], report["dropped_routes"]
    assert report["swaps"][0]["schedule"] == "hecate" and report["swaps"][0]["exchange"] == "ragged"
    ranks = [r["hecate"] for r in report["ranks"]]
    assert all(r["extra"] > 0 for r in ranks), ranks                             # copies beyond the homes
    for members in {tuple(r["ep_ranks"]) for r in ranks}:                       # per EP (FSSDP) group
        group = [ranks[m] for m in members]
        assert all(r["copies_E"] == group[0]["copies_E"] and r["load_E"] == group[0]["load_E"] for r in group)
        load = group[0]["load_E"]
        assert [sum(r["rows_E"][e] for r in group) for e in range(8)] == load    # each kept route computed once
        hot, e_l = load.index(max(load)), 8 // combo["ep"]
        assert len(group[0]["copies_E"][hot]) > 1, group                         # the hot expert is copied
        non_owners = [r["rows_E"][hot] for r in group if r["ep_rank"] != hot // e_l]
        assert any(n > 0 for n in non_owners), group                             # non-owners computed its tokens
    assert ranks[0]["load_E"][0] == max(ranks[0]["load_E"])                      # the skewed gate: expert 0 hot
    assert all(r["activation"] == {"none": "gelu", "tanh": "gelu_tanh"}[gelu] for r in ranks)
    layer = next(iter(report["ledger"].values()))
    assert layer["forward:spag@ep"]["count"] == layer["backward:sprs@ep"]["count"] == 1
    assert layer["forward:all_to_all@ep"]["count"] == 2 * degree        # each piece: dispatch and combine
    assert report["swaps"][0]["pipeline_degree"] == degree
    for r in report["ranks"]:          # one forward and backward: each parameter's gradient accumulated once
        assert r["accumulated"] == {n: 1 for n in r["params"]}, r["accumulated"]


@pytest.mark.parametrize("combo", [dict(mp=2, ep=2, k=2, drop=True), dict(mp=2, ep=4, k=1, drop=False)], ids=str)
def test_fp64_hecate_under_tensor_parallelism_equals_stock(world, combo):
    """Under an mpu with TP 2 (no expert TP): moe-plugins verify's comparison (the MP replicas compute every row at
    1/N_MP, as the baseline does; DeepSpeed's sum over expert-DP makes the gradient)."""
    report = world(WORLD).run(run_rank, _spec(skew=0.0, **combo))[0]
    assert report["ok"] and report["routing_equal"] and report["expert_ids_equal"], report
    assert max(report[k] for k in ("max_err_out", "max_err_grad_in", "max_err_grad_w", "max_err_aux")) <= 1e-9
    assert report["swaps"][0]["schedule"] == "hecate" and report["swaps"][0]["mp"] == 2
    layer = next(iter(report["ledger"].values()))
    assert layer["forward:spag@ep"]["count"] == layer["backward:sprs@ep"]["count"] == 1


# ---- training, checkpoints, refusals -------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2])
def test_training_20_steps_hecate_equals_stock(world, stage):
    steps = 20
    results = world(WORLD).run(jobs.train_on_and_off, stage, HECATE, 2, 2, 0, steps)
    for rank, res in enumerate(results):
        off, on = res["off"], res["on"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(off["losses"], on["losses"]))
        assert len(on["losses"]) == steps and rel <= 1e-5, (rank, rel)
        assert on["swaps"][0]["schedule"] == "hecate" and on["extra_copies"] > 0
        for run in (off, on):          # each parameter's gradient accumulated, and its ZeRO hook run, once a step
            assert run["accumulated"] == {n: steps for n in run["params"]}, run["accumulated"]
            if stage:                  # ZeRO 1 and 2 register a gradient hook per parameter (counted)
                assert run["zero_hooks"] == {n: steps for n in run["params"]}, run["zero_hooks"]
        assert on["zero_hooks"] == off["zero_hooks"]


@pytest.mark.parametrize("save,load,stage", [(HECATE, None, 1), (None, HECATE, 2)],
                         ids=["hecate-to-stock-zero1", "stock-to-hecate-zero2"])
def test_checkpoint_round_trip_across_hecate(world, tmp_path, save, load, stage):
    """Hecate keeps DeepSpeed's own expert parameters as the owners, so its checkpoints are stock files."""
    results = world(WORLD).run(ds_jobs.checkpoint_round_trip, save, load, stage, 2, 2, str(tmp_path))
    files = results[0]["files"]
    assert {f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(ds_jobs.E)} <= set(files), files
    saved, loaded, initial = {}, {}, {}
    for res in results:
        assert res["saver"]["keys"] == res["loader"]["keys"]                      # stock state_dict keys
        saved.update(res["saver"]["state"])
        loaded.update(res["loader"]["state"])
        initial.update(res["loader"]["initial"])
    assert set(saved) == set(loaded) and all(torch.equal(saved[n], loaded[n]) for n in saved)
    assert not all(torch.equal(saved[n], initial[n]) for n in saved)             # the load did it
    for rank, res in enumerate(results):     # the same next steps (the resumed run's losses)
        rel = max(abs(a - b) / abs(a) for a, b in zip(res["saver"]["after"], res["loader"]["after"]))
        assert rel <= 1e-5, (rank, res["saver"]["after"], res["loader"]["after"])


def test_an_expert_hecate_cannot_copy_is_refused_before_the_swap(world):
    results = world(WORLD).run(jobs.refusal, HECATE)
    for res in results:
        assert res["error"] is not None, res
        assert "moe_plugins cannot run DeepSpeed MoE layer" in res["error"] and "with Hecate" in res["error"]
        assert "deepspeed_moe.experts.deepspeed_experts.0 (torch.nn.modules.container.Sequential)" in res["error"]
        assert "deepspeed_experts.1 (" in res["error"]                           # every local expert listed
        assert res["swaps"] == [] and res["swapped"] == 0 and not res["registered"]
