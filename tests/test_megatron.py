"""Megatron-core host (issue 5): the plugin's layer against Megatron-core's stock MoELayer (0.16.1, whose layer specs
are ModuleSpec objects, and 0.19.2, whose are functools.partial objects; the few checks that differ branch on the
installed version).

Layers: pure functions and patching in this process; then 4 gloo ranks of the ``world`` pool running stock
Megatron and the plugin side by side under the CPU shims (fp64 layer equivalence over TP x EP x expert-TP x k,
20 training steps through Megatron's DDP and optimizer, checkpoints both ways, construction-time checks).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import pytest
import torch

pytest.importorskip("megatron.core")

from moe_plugins.core.dispatch import combine, dispatch  # noqa: E402
from moe_plugins.patches import megatron as mp  # noqa: E402
from moe_plugins.patches.megatron_config import facts_from_args, plugin_problems, token_layout  # noqa: E402
from moe_plugins.patches.megatron_specs import (MODULE_SPEC, PARTIAL, spec_layer_class, spec_params,  # noqa: E402
                                                spec_style, spec_submodules)
from moe_plugins.core.plugin_config import PluginConfig  # noqa: E402
from moe_plugins.plugins import default_registry  # noqa: E402
from moe_plugins.tools.verify_megatron import MegatronVerifySpec, collect  # noqa: E402
from tests.workers import megatron as jobs                                            # noqa: E402

WORLD, RPN = 4, 2
VERSION = __import__("megatron.core.package_info", fromlist=["__version__"]).__version__
STYLE = spec_style(VERSION)                # ModuleSpec (0.16.1) or functools.partial (0.19.2) layer specs
JOB_TIMEOUT_S = 1800        # the first job imports Megatron on every rank: minutes on 2 shared, busy cores
PLUGIN_PARAMS = ("plugin", "groups", "ranks_per_node", "ledger")
LAYOUTS = [(tp, ep, etp) for tp in (1, 2) for ep in (1, 2, 4) for etp in (1, 2) if ep * etp <= WORLD]


def spec(tp: int, ep: int, etp: int, **kw) -> MegatronVerifySpec:
    return MegatronVerifySpec(world=WORLD, ranks_per_node=RPN, mp=tp, ep=ep, esp=etp, tokens=8, **kw)


def run(world, fn, *args):
    return world(WORLD).run(fn, *args, timeout_s=JOB_TIMEOUT_S)


def megatron_args(**kw) -> argparse.Namespace:
    """Megatron-LM's parsed arguments, the fields the adapter reads (its defaults unless given)."""
    fields = dict(world_size=WORLD, tensor_model_parallel_size=2, expert_model_parallel_size=2,
                  expert_tensor_parallel_size=None, pipeline_model_parallel_size=1, context_parallel_size=1,
                  num_experts=4, hidden_size=8, ffn_hidden_size=16, moe_ffn_hidden_size=None, moe_router_topk=2,
                  moe_expert_capacity_factor=None, moe_token_dispatcher_type="alltoall", moe_plugins=None)
    fields.update(kw)
    return argparse.Namespace(**fields)


# ---- the flag and its validation (no processes) ----------------------------------------------------------------

def test_flag_takes_a_json_object_or_a_file(tmp_path):
    parser = mp.extra_args_provider(argparse.ArgumentParser())
    args = parser.parse_args([mp.FLAG, '{"schedule": "baseline-tp", "pipeline_degree": 2}'])
    # a section naming no exchange runs Megatron's own flow, the ragged one, where the schedule allows it
    assert mp.resolve_plugin(args.moe_plugins) == PluginConfig(schedule="baseline-tp", pipeline_degree=2,
                                                               exchange="ragged")
    path = tmp_path / "plugins.json"
    path.write_text(json.dumps({"moe_plugins": {"schedule": "baseline", "ranks_per_node": 8}}))
    args = parser.parse_args([mp.FLAG, str(path)])
    assert isinstance(args.moe_plugins, str)                 # Megatron-LM pickles args into checkpoints
    assert mp.resolve_plugin(args.moe_plugins) == PluginConfig(ranks_per_node=8, exchange="ragged")
    for section, exchange in (('{"schedule": "parm-s2-saa"}', "ragged"), ('{"schedule": "parm-auto"}', "ragged"),
                              ('{"schedule": "parm-s2"}', "ragged"), ('{"pipeline_degree": "auto"}', "ragged"),
                              ('{"schedule": "parm-s2", "pipeline_degree": "auto"}', "ragged"),
                              ('{"exchange": "padded"}', "padded"), ('{"lancet": {"defer_wgrad": true}}', "padded"),
                              ('{"schedule": "baseline-tp"}', "ragged"), ('{"pipeline_degree": 3}', "ragged")):
        assert mp.resolve_plugin(section).exchange == exchange, section   # Lancet's defer_wgrad: padded
    assert parser.parse_args([]).moe_plugins is None


def test_flag_reports_every_problem_at_once(capsys, tmp_path):
    parser = mp.extra_args_provider(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args([mp.FLAG, '{"schedul": "baseline", "pipeline_degree": 0, "fssdp": true}'])
    err = capsys.readouterr().err
    assert "--moe-plugins.schedul: unknown key (did you mean 'schedule'?)" in err
    assert "--moe-plugins.pipeline_degree (0) must be an integer >= 1" in err
    assert "--moe-plugins.fssdp (True) is reserved" in err
    with pytest.raises(SystemExit):
        parser.parse_args([mp.FLAG, str(tmp_path / "missing.json")])
    assert "must be a JSON object or the path of a JSON file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is not valid JSON"):
        mp.resolve_plugin("{schedule: baseline}")


def test_megatron_settings_report_every_problem_at_once():
    args = megatron_args(moe_token_dispatcher_type="flex", pipeline_model_parallel_size=2,
                         moe_shared_expert_overlap=True, moe_apply_probs_on_input=True,
                         expert_tensor_parallel_size=2, moe_input_jitter_eps=0.1, moe_ffn_hidden_size=15)
    plugin = PluginConfig(esp=1, pipeline_degree="auto", schedule="baseline-tp")
    problems = plugin_problems(facts_from_args(args), plugin, world=WORLD, ranks_per_node=RPN,
                               profile=lambda layout: None)                    # the layer's lookup: none cached
    expected = ["moe_token_dispatcher_type ('flex') must be one of alltoall, allgather",
                "pipeline_model_parallel_size (2) must be 1", "moe_shared_expert_overlap (True) must be False",
                "moe_apply_probs_on_input (True) must be False",
                "moe_plugins.esp (1) must equal expert_tensor_parallel_size (2)",
                "moe_plugins.pipeline_degree ('auto') needs a cost profile",
                "moe_input_jitter_eps must be off with expert_tensor_parallel_size (2) > 1",
                "moe_plugins.schedule on Megatron's token layout", "ffn (15) must be divisible by esp (2)"]
    for text in expected:
        assert any(text in p for p in problems), (text, problems)
    assert len(problems) == len(expected)
    flag_time = plugin_problems(facts_from_args(args), plugin, world=WORLD, ranks_per_node=RPN)  # no lookup yet
    assert not any("cost profile" in p for p in flag_time) and len(flag_time) == len(expected) - 1
    assert plugin_problems(facts_from_args(megatron_args()), PluginConfig(), world=WORLD, ranks_per_node=RPN) == []
    wgrad = megatron_args(overlap_dispatch_backward_with_experts_wgrad=True)        # a megatron-core 0.19.2 field
    assert plugin_problems(facts_from_args(wgrad), PluginConfig(), world=WORLD, ranks_per_node=RPN) == [
        "overlap_dispatch_backward_with_experts_wgrad (True) must be False: Megatron's delayed expert wgrad is keyed "
        "to its own dispatch and expert stages, which the plugin replaces"]
    bad_world = plugin_problems(facts_from_args(megatron_args(expert_model_parallel_size=3)), PluginConfig(),
                                world=WORLD, ranks_per_node=RPN)
    assert bad_world == ["layout of tensor_model_parallel_size 2, expert_model_parallel_size 3, "
                         "expert_tensor_parallel_size 2: world (4) must be divisible by ep*esp (3*2=6)"]


def test_megatron_tokens_are_one_block_per_rank():
    """Sequence parallelism: the schedule's layout has MP = 1 whatever Megatron's TP, so the baseline-tp
    schedule (which splits an MP group's replicated capacity) runs only without expert-TP."""
    facts = facts_from_args(megatron_args(tensor_model_parallel_size=2, expert_tensor_parallel_size=2))
    layout = token_layout(facts, WORLD, RPN)
    assert (layout.mp, layout.ep, layout.esp, layout.dp) == (1, 2, 2, WORLD)
    assert default_registry().schedule_problems("baseline", layout) == []
    assert default_registry().schedule_problems("baseline-tp", layout) != []


def _snapshot():
    import importlib
    return {name: dict(vars(importlib.import_module(name))) for name, _ in mp.HOOKS}


def _same(before, after) -> bool:
    return all(before[m].keys() == after[m].keys() and all(after[m][k] is v for k, v in before[m].items())
               for m in before)


def test_enable_from_args_validates_before_patching():
    before = _snapshot()
    args = megatron_args(moe_plugins='{"schedule": "baseline"}', moe_token_dispatcher_type="flex",
                         context_parallel_size=2)
    with pytest.raises(ValueError, match=r"moe_token_dispatcher_type \('flex'\).*context_parallel_size \(2\)"):
        mp.enable_from_args(args)
    assert mp.active() is None and _same(before, _snapshot())
    assert mp.enable_from_args(megatron_args()) is None                          # no flag: nothing happens
    assert mp.enable_from_args(megatron_args(moe_plugins='{"enabled": false}')) is None
    assert mp.active() is None and _same(before, _snapshot())


def test_disable_restores_megatron_exactly():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_plugins.patches.megatron_layer import PluginMoELayer
    before = _snapshot()
    originals = [before[m][a] for m, a in mp.HOOKS]
    handle = mp.enable_from_args(megatron_args(moe_plugins='{"schedule": "baseline"}'))
    try:
        assert mp.active() is handle and not _same(before, _snapshot())
        with pytest.raises(ValueError, match="already enabled"):
            mp.enable(PluginConfig())
        mlp = get_gpt_layer_local_spec(num_experts=4).submodules.mlp
        assert spec_layer_class(mlp) is PluginMoELayer and spec_params(mlp)["plugin"] == PluginConfig(schedule="baseline",
                                                                                                exchange="ragged")
        assert handle.specs_built == 1
    finally:
        mp.disable()
    assert mp.active() is None and not handle.active and _same(before, _snapshot())
    assert [vars(__import__(m, fromlist=[a]))[a] for m, a in mp.HOOKS] == originals
    assert spec_layer_class(get_gpt_layer_local_spec(num_experts=4).submodules.mlp) is MoELayer
    mp.disable()                                                                   # idempotent


def _shape(spec):
    """A comparable form of a spec tree: functools.partial (0.19.2's builders) compares by identity, so two calls
    of Megatron's spec function give unequal partials; here they compare by function and arguments."""
    if isinstance(spec, functools.partial):
        return ("partial", spec.func, _shape(spec.args), _shape(spec.keywords))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return (type(spec), tuple((f.name, _shape(getattr(spec, f.name))) for f in dataclasses.fields(spec)))
    if isinstance(spec, dict):
        return tuple(sorted((k, _shape(v)) for k, v in spec.items()))
    if isinstance(spec, (list, tuple)):
        return tuple(_shape(v) for v in spec)
    return spec


def test_spec_provider_swaps_only_the_layer_class():
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as stock_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    stock = stock_spec(use_te=False, num_experts=4)
    ours = mp.get_moe_module_spec(use_te=False, num_experts=4, plugin={"schedule": "baseline"})
    assert type(ours) is type(stock) and STYLE == (PARTIAL if isinstance(stock, functools.partial) else MODULE_SPEC)
    assert issubclass(spec_layer_class(ours), MoELayer) and spec_layer_class(ours) is not MoELayer
    assert _shape(spec_submodules(ours)) == _shape(spec_submodules(stock))
    assert _shape({k: v for k, v in spec_params(ours).items() if k not in PLUGIN_PARAMS}) == _shape(spec_params(stock))
    if STYLE == MODULE_SPEC:
        assert ours.metainfo == stock.metainfo
    assert spec_layer_class(mp.get_moe_module_spec(use_te=False, num_experts=4, plugin={"enabled": False})) is MoELayer
    with pytest.raises(ValueError, match="moe_plugins.schedule .'nope'. must be one of"):
        mp.get_moe_module_spec(use_te=False, num_experts=4, plugin={"schedule": "nope"})
    if STYLE == PARTIAL:                                # megatron-core 0.18 dropped the legacy grouped GEMM
        with pytest.raises(ValueError, match=r"moe_use_legacy_grouped_gemm \(True\) is not an argument"):
            mp.get_moe_module_spec(use_te=False, num_experts=4, moe_use_legacy_grouped_gemm=True, plugin={})
    else:
        assert mp.get_moe_module_spec(use_te=False, num_experts=4, moe_use_legacy_grouped_gemm=True, plugin={})


def test_spec_helpers_read_and_rewrite_both_styles():
    """Whatever Megatron is installed: a ModuleSpec (0.16.1's style) and a functools.partial (0.19.2's) of the same
    layer give the same class, submodules and params, and the swap keeps each style; bad input names what it got."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from moe_plugins.patches.megatron_specs import build_layer, call_accepting, version_tuple, with_layer_class

    class Layer:
        def __init__(self, config=None, submodules=None, **params):
            self.config, self.submodules, self.params = config, submodules, params

    class Other(Layer):
        pass

    subs = object()
    specs = {MODULE_SPEC: ModuleSpec(module=Layer, params={"a": 1}, submodules=subs, metainfo={"m": True}),
             PARTIAL: functools.partial(Layer, submodules=subs, a=1)}
    for style, stock in specs.items():
        assert (spec_layer_class(stock), spec_submodules(stock), spec_params(stock)) == (Layer, subs, {"a": 1})
        ours = with_layer_class(stock, Other, {"b": 2})
        assert type(ours) is type(stock) and spec_layer_class(ours) is Other and spec_submodules(ours) is subs
        assert spec_params(ours) == {"a": 1, "b": 2} and spec_params(stock) == {"a": 1}
        if style == MODULE_SPEC:
            assert ours.metainfo == {"m": True}
        built = build_layer(ours, "cfg", layer_number=3)
        assert type(built) is Other and built.config == "cfg" and built.submodules is subs
        assert built.params == {"a": 1, "b": 2, "layer_number": 3}
    assert (version_tuple("0.19.2"), version_tuple("0.20.0rc1")) == ((0, 19, 2), (0, 20))
    assert (spec_style("0.16.1"), spec_style("0.17.3"), spec_style("0.18.0"), spec_style("1.0")) == (
        MODULE_SPEC, MODULE_SPEC, PARTIAL, PARTIAL)
    with pytest.raises(ValueError, match=r"MoE layer spec 3 is a int; allowed: a ModuleSpec"):
        spec_layer_class(3)
    with pytest.raises(ValueError, match=r"positional arguments \(1,\); allowed: keywords only"):
        spec_params(functools.partial(Layer, 1))

    def old(use_te=True, num_experts=None):
        return use_te, num_experts
    assert call_accepting(old, use_te=False, num_experts=4, moe_use_legacy_grouped_gemm=False) == (False, 4)
    with pytest.raises(ValueError, match=r"legacy \(True\) is not an argument of this Megatron's .*allowed: use_te, "
                                         r"num_experts"):
        call_accepting(old, use_te=False, legacy=True)


# ---- Megatron's routing as the core's Routing (one process) ------------------------------------------------------

@pytest.mark.parametrize("k,capacity_factor,pad,policy", [(1, None, False, "probs"), (2, None, False, "probs"),
                                                          (2, 0.75, False, "probs"), (2, 1.0, True, "position"),
                                                          (1, 1.0, True, "probs")])
def test_routing_matches_megatron_permute_and_unpermute(k, capacity_factor, pad, policy):
    """dispatch/combine of the converted routing reproduce Megatron's permute -> experts (scaled by the routing
    probability) -> unpermute, values and gradients, including dropped routes and zero-probability padding."""
    from megatron.core.transformer.moe.moe_utils import (apply_router_token_dropping, get_capacity, permute,
                                                         topk_routing_with_score_function, unpermute)

    from moe_plugins.patches.megatron_layer import routing_from_megatron
    tokens, experts, dim = 12, 4, 3
    gen = torch.Generator().manual_seed(17 * k + int(pad))
    x = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    upstream = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(rows * (e + 1)) + e

    def routed(logits):
        probs, rmap = topk_routing_with_score_function(logits, k, use_pre_softmax=k == 1)
        if capacity_factor is None:
            return probs, rmap, int(rmap.sum(0).max())
        probs, rmap = apply_router_token_dropping(probs, rmap, router_topk=k, capacity_factor=capacity_factor,
                                                  drop_policy=policy, pad_to_capacity=pad)
        return probs, rmap, get_capacity(tokens * k, experts, capacity_factor)

    logits = torch.randn(tokens, experts, generator=gen, dtype=torch.float64)
    results = []
    for side in ("megatron", "core"):
        lg = logits.clone().requires_grad_(True)
        probs, rmap, cap = routed(lg)
        if side == "megatron":
            drop_and_pad = pad and capacity_factor is not None
            # (permuted, probs, order) on 0.16.1; 0.19.2 adds pad offsets and tokens per expert after them
            perm, perm_probs, order = permute(x, rmap, probs=probs, num_out_tokens=cap * experts if drop_and_pad
                                              else int(rmap.sum()), drop_and_pad=drop_and_pad)[:3]
            counts = [cap] * experts if drop_and_pad else rmap.sum(0).tolist()
            out = torch.cat([expert(e, c) for e, c in enumerate(torch.split(perm, counts))]) * perm_probs[:, None]
            y = unpermute(out, order, restore_shape=x.shape, routing_map=rmap, drop_and_pad=drop_and_pad)
        else:
            routing = routing_from_megatron(probs, rmap, cap)
            d_ECM = dispatch(x, routing, experts, cap)
            y = combine(torch.stack([expert(e, d_ECM[e]) for e in range(experts)]), routing)
        (y * upstream).sum().backward()
        results.append((y.detach(), lg.grad))
    assert torch.allclose(results[0][0], results[1][0], rtol=0, atol=1e-12)
    assert torch.allclose(results[0][1], results[1][1], rtol=0, atol=1e-12)
    if capacity_factor is not None and not pad:
        assert int(routed(logits)[1].sum()) < tokens * k            # the case really drops routes


# ---- 4 gloo ranks: stock MoELayer (alltoall) vs the plugin -------------------------------------------------------

def _check(results, tol: float):
    jobs.assert_equivalent(results, tol)


@pytest.mark.parametrize("tp,ep,etp", LAYOUTS, ids=[f"tp{t}-ep{e}-etp{x}" for t, e, x in LAYOUTS])
def test_plugin_matches_stock_alltoall_fp64(world, tp, ep, etp):
    """Outputs, input gradients, every parameter gradient and the tracked aux loss agree to 1e-9 in fp64: top-1
    with capacity dropping padded to capacity, top-2 dropless, top-2 dropping without padding."""
    specs = [spec(tp, ep, etp, k=1, drop=True, capacity_factor=1.0, pad=True),
             spec(tp, ep, etp, k=2, drop=False),
             spec(tp, ep, etp, k=2, drop=True, capacity_factor=1.25)]
    results = [r for rank in run(world, jobs.equivalence_job, specs) for r in rank]
    _check(results, 1e-9)
    assert sum(r["dropped_routes"] for r in results if r["spec"].pad) > 0          # dropping was exercised
    report = collect(specs[1], [r for r in results if r["spec"] == specs[1]])
    assert report["ok"] and report["host"] == "megatron"
    ops = report["ledger"].get("megatron.moe.1", {})                               # no collective at all: no entry
    assert (ep > 1) == ("forward:all_to_all@ep" in ops)                            # the schedule's exchanges
    assert (etp > 1) == ("forward:all_gather@esp" in ops and "forward:all_reduce@esp" in ops)


def test_other_schedules_and_pipeline_degree_match_stock(world):
    """Every registered schedule that is valid on Megatron's token layout (MP = 1) and needs no expert weights
    from the host (Hecate's copies: tests/test_hecate_megatron.py), and
    PipeMoE's pipelined chunks (degree 2), on a layout with expert-TP and one without."""
    specs = []
    for tp, ep, etp in ((2, 2, 1), (1, 2, 2)):
        args = megatron_args(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                             expert_tensor_parallel_size=etp)
        layout = token_layout(facts_from_args(args), WORLD, RPN)
        specs += [spec(tp, ep, etp, k=2, drop=False, schedule=name) for name in default_registry().schedule_names()
                  if name != "baseline" and not default_registry().schedule_problems(name, layout)
                  and not default_registry().schedule_class(name).needs_expert_weights]
        specs.append(spec(tp, ep, etp, k=2, drop=True, capacity_factor=1.25, pipeline_degree=2))
    assert any(s.schedule == "baseline-tp" for s in specs)
    _check([r for rank in run(world, jobs.equivalence_job, specs) for r in rank], 1e-9)


@pytest.mark.parametrize("tp,ep,etp,overlap", [(2, 2, 1, False), (1, 2, 2, True)])
def test_twenty_training_steps_through_megatron_ddp_and_optimizer(world, tp, ep, etp, overlap):
    """fp32, Adam, Megatron's DistributedDataParallel (expert parameters in its expert buffers; overlapped
    bucketed grad reduction in the second case), finalize_model_grads: equal losses to 1e-5 relative."""
    results = run(world, jobs.training_job, spec(tp, ep, etp, k=2, drop=True, capacity_factor=1.25,
                                                       dtype="float32"), 20, overlap)
    for r in results:
        assert len(r["stock"]) == len(r["plugin"]) == 20
        for a, b in zip(r["stock"], r["plugin"]):
            assert abs(a - b) <= 1e-5 * abs(a), (r["stock"], r["plugin"])
        assert sum(r["stock"][-4:]) < sum(r["stock"][:4])                              # it did learn
        stock_n, plugin_n = r["expert_buffer_params"]
        assert stock_n == plugin_n > 0


def test_checkpoints_load_both_ways(world):
    for r in run(world, jobs.checkpoint_job, spec(2, 2, 1, k=2, drop=False)):
        assert r["keys"] == r["plugin_keys"] and r["attrs_equal"]
        assert r["expert_params"] and all(n.startswith("experts.") for n in r["expert_params"])
        assert r["err_plugin_to_stock"] <= 1e-12 and r["err_stock_to_plugin"] <= 1e-12


def test_bad_layer_config_lists_every_problem_before_building(world):
    for r in run(world, jobs.bad_layer_job):
        message = r["message"]
        for text in ("moe_token_dispatcher_type ('flex')", "overlap_moe_expert_parallel_comm (True) must be False",
                     "moe_plugins.esp (1) must equal expert_tensor_parallel_size (2)",
                     "moe_plugins.pipeline_degree ('auto')", "moe_input_jitter_eps must be off",
                     "runs on an engine's pipeline lane, which the layer does not build",
                     "schedule 'baseline-tp' needs esp (2)"):
            assert text in message, (text, message)
        assert r["rng_untouched"]


def test_pg_collection_that_breaks_the_layout_is_refused(world):
    for rank, message in enumerate(run(world, jobs.mismatched_groups_job)):
        assert f"pg_collection.ep of rank {rank} holds ranks" in message
        assert "needs [0, 1]" in message or "needs [2, 3]" in message


def test_verify_cli_rejects_bad_megatron_flags(capsys):
    from moe_plugins.tools.cli import main
    code = main(["verify", "--host", "megatron", "--world", "4", "--ep", "3", "--min-capacity", "2", "--skew", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "min_capacity (2) must be 0" in err and "skew (1.0)" in err and "ep*esp (3*1=3)" in err


def test_flag_path_builds_the_plugin_inside_megatron_transformer_layer(world):
    """Parse --moe-plugins, enable from the parsed args, build a TransformerLayer from Megatron's own local spec:
    its MoE layer is the plugin's, on the layout's groups, and matches the stock layer's MoE in fp64."""
    for r in run(world, jobs.flag_path_job, '{"schedule": "baseline"}'):
        assert (r["stock_class"], r["class"], r["specs_built"]) == ("MoELayer", "PluginMoELayer", 1)
        assert (r["ep_ranks"], r["esp_ranks"]) == (r["layout_ep"], r["layout_esp"])
        assert r["grad_names_equal"] and r["err"] <= 1e-9 and not r["active_after"]
        assert r["degree"] == 1 and not r["has_engines"]          # unpipelined: no engine, no twin groups


def test_flag_path_pipelined_layers_run_on_the_plugins_engines(world):
    """A pipeline degree through the flag: the layer builds no process groups of its own; it runs on the engine
    enable() owns for its layout, which disable() closes."""
    for r in run(world, jobs.flag_path_job, '{"schedule": "baseline", "pipeline_degree": 2}'):
        assert (r["class"], r["degree"], r["has_engines"], r["on_handles_engine"]) == ("PluginMoELayer", 2, True, True)
        assert r["grad_names_equal"] and r["err"] <= 1e-9 and r["engines_closed"] and not r["active_after"]


def _fake_cluster_profile(tmp_path, ep: int, esp: int) -> str:
    """A cost profile cached for Megatron's token layout (mp 1) whose start-up terms are tiny, so PipeMoE's
    choice is clearly above 1: the plumbing under test is "the adapter finds and uses the cached profile"."""
    from moe_plugins.core.costmodel import CostProfile, LinearModel, ProfileKey, cache_path
    key = ProfileKey(world=WORLD, ranks_per_node=RPN, mp=1, ep=ep, esp=esp, backend="gloo", device="cpu")
    a2a = LinearModel(alpha=1e-9, beta=1e-8, unit="byte")
    models = {"all_to_all@ep": a2a, "all_to_all@ep_esp": a2a, "gemm": LinearModel(alpha=1e-9, beta=1e-9, unit="mac")}
    CostProfile(key=key, dtype="float64", models=models, source="test").save(cache_path(tmp_path, key))
    return str(tmp_path)


@pytest.mark.parametrize("schedule, exchange, drop", [("baseline", "padded", True), ("parm-auto", "padded", True),
                                                     ("baseline", "ragged", True), ("baseline", "ragged", False)])
def test_auto_degree_reads_the_cached_profile_and_matches_stock(world, tmp_path, schedule, exchange, drop):
    """The ragged rows: "auto" priced by the busiest rank's rows (Schedule.row_load), with drops and dropless."""
    profile_dir = _fake_cluster_profile(tmp_path, ep=2, esp=2)
    s = dataclasses.replace(spec(1, 2, 2, k=2, drop=drop, capacity_factor=1.5), tokens=16)
    for r in run(world, jobs.auto_job, s, schedule, profile_dir, exchange):
        assert max(r["err_out"], r["err_grad_in"], r["err_grad_w"]) <= 1e-9, r
        assert r["decisions"] and min(r["decisions"]) > 1, r
        assert "w4-n2-mp1-ep2-esp2-gloo-cpu" in r["source"]


def test_auto_degree_needs_no_profile_where_nothing_is_exchanged(world, tmp_path):
    """TP = EP = ETP = 1 (pure data parallelism; one GPU alike): "auto" is r = 1 with no profile cached."""
    s = dataclasses.replace(spec(1, 1, 1, k=2, drop=True, capacity_factor=1.5), tokens=16)
    for r in run(world, jobs.auto_job, s, "baseline", str(tmp_path)):
        assert max(r["err_out"], r["err_grad_in"], r["err_grad_w"]) <= 1e-9, r
        assert r["decisions"] == [1] and r["source"] == "", r


def test_router_gemm_runs_without_transformer_engine_under_the_compat_fix():
    """megatron-core 0.16.1's router GEMM names te_general_gemm, defined only with Transformer Engine (absent
    here, as on the GPU run of issue #27): NameError without the fix, Megatron's torch GEMM with it, and the
    module as it was afterwards. enable() applies the same fix for as long as the plugin is on. From 0.17 the name
    is defined (None without Transformer Engine): no fix is applied, and the GEMM runs as it is."""
    from megatron.core.transformer.moe import moe_utils

    from moe_plugins.patches.megatron_compat import compat_patches, megatron_compat
    from moe_plugins.patches.megatron_specs import version_tuple
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    if version_tuple(VERSION)[:2] >= (0, 17):
        assert vars(moe_utils)["te_general_gemm"] is None and compat_patches() == []
        assert torch.allclose(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.T)
        with megatron_compat(), mp.enable({"schedule": "baseline"}):
            assert vars(moe_utils)["te_general_gemm"] is None
        assert vars(moe_utils)["te_general_gemm"] is None
        return
    assert "te_general_gemm" not in vars(moe_utils) and len(compat_patches()) == 1
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(x, w, None, torch.float32)
    with megatron_compat():
        y = moe_utils.router_gating_linear(x, w, None, torch.float32)
    assert torch.allclose(y, x @ w.T) and "te_general_gemm" not in vars(moe_utils)
    with mp.enable({"schedule": "baseline"}):
        assert moe_utils.router_gating_linear(x, w, None, torch.float32).shape == (4, 3)
    assert "te_general_gemm" not in vars(moe_utils)
