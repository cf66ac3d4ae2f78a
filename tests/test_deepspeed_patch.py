"""The DeepSpeed adapter in one process, no process group: enable/disable restore DeepSpeed exactly, a bad
section leaves it unpatched, DeepSpeed's sparse gate output converts to a Routing that dispatches and combines
exactly as DeepSpeed does, and a layer DeepSpeed shards in a way the plugin cannot follow is refused with
every reason."""

from __future__ import annotations

import importlib

import pytest
import torch

import moe_plugins
from moe_plugins.core.dispatch import combine, dispatch
from moe_plugins.core.plugin_config import PluginConfig

ds = pytest.importorskip("deepspeed")
adapter = importlib.import_module("moe_plugins.patches.deepspeed")
sharded_moe = importlib.import_module("deepspeed.moe.sharded_moe")
FORWARD = ("deepspeed.moe.sharded_moe", "MOELayer", "forward")


def hooked():
    """The functions the adapter may replace, as the classes hold them now."""
    return {hook: getattr(importlib.import_module(hook[0]), hook[1]).__dict__[hook[2]] for hook in adapter.HOOKS}


@pytest.fixture
def originals():
    before = hooked()
    yield before
    moe_plugins.disable()
    assert hooked() == before


def test_enable_patches_and_disable_restores_the_identical_functions(originals):
    handle = moe_plugins.enable({"schedule": "baseline-tp"})
    now = hooked()
    assert all(now[h] is not originals[h] for h in adapter.HOOKS)
    assert all(now[h].__wrapped__ is originals[h] for h in adapter.HOOKS)
    assert adapter.active() is handle and handle.config == PluginConfig(schedule="baseline-tp")
    moe_plugins.disable()
    assert all(hooked()[h] is originals[h] for h in adapter.HOOKS)
    assert adapter.active() is None
    moe_plugins.disable()                     # a second disable is a no-op


def test_context_manager_restores_on_error(originals):
    with pytest.raises(RuntimeError, match="inside"):
        with moe_plugins.enable():
            assert hooked()[FORWARD] is not originals[FORWARD]
            raise RuntimeError("inside")
    assert all(hooked()[h] is originals[h] for h in adapter.HOOKS)


def test_bad_section_lists_everything_and_leaves_deepspeed_unpatched(originals):
    ds_config = {"train_batch_size": 8, "moe_plugins": {"schedule": "fast", "pipline_degree": 2, "esp": 0,
                                                       "overlap": True}}
    with pytest.raises(ValueError) as info:
        moe_plugins.enable(ds_config)
    msg = str(info.value)
    assert "moe_plugins.schedule ('fast')" in msg and "moe_plugins.pipline_degree: unknown key (did you mean " \
        "'pipeline_degree'?)" in msg and "moe_plugins.esp (0)" in msg and "moe_plugins.overlap (True)" in msg
    assert all(hooked()[h] is originals[h] for h in adapter.HOOKS)
    assert adapter.active() is None


def test_a_hook_failing_midway_leaves_deepspeed_untouched(originals, monkeypatch):
    def boom(self, original):
        raise RuntimeError("cannot build this replacement")
    monkeypatch.setattr(adapter.DeepSpeedPlugin, "_boom", boom, raising=False)
    monkeypatch.setitem(adapter.HOOKS, ("deepspeed.moe.experts", "Experts", "forward"), "_boom")
    with pytest.raises(RuntimeError, match="cannot build this replacement"):
        moe_plugins.enable()
    assert all(hooked()[h] is originals[h] for h in originals)     # the hooks replaced before it are back
    assert adapter.active() is None


def test_second_enable_is_refused(originals):
    moe_plugins.enable()
    with pytest.raises(ValueError, match="already enabled"):
        moe_plugins.enable()


def test_unknown_host_is_refused(originals):
    with pytest.raises(ValueError, match=r"host \('megablocks'\) must be"):
        moe_plugins.enable(host="megablocks")
    assert all(hooked()[h] is originals[h] for h in adapter.HOOKS)


@pytest.mark.parametrize("k,drop", [(1, True), (2, True), (3, True), (1, False), (2, False)])
def test_routing_from_gate_dispatches_and_combines_like_deepspeed(k, drop):
    """DeepSpeed's own gating function (sparse routes) -> Routing -> the core's dispatch/combine equals
    DeepSpeed's _sparse_encode/_sparse_decode on the same routes, bit for bit."""
    gen = torch.Generator().manual_seed(k)
    S, E, M = 24, 4, 6
    logits = torch.randn(S, E, generator=gen) * 2
    x_SM = torch.randn(S, M, generator=gen, dtype=torch.float64)
    y_ECM_of = lambda C: torch.randn(E, C, M, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    if k == 1:
        out = sharded_moe.top1gating(logits, 0.5, 0, None, None, drop, False, None, True)
    elif k == 2:
        out = sharded_moe.top2gating(logits, 0.5, 0, drop, None, False, True)
    else:
        out = sharded_moe.topkgating(logits, k, 0.5, 0, drop, None, "position", True)
    l_aux, C, _, indices, locations, gates, counts = out
    C = int(C)
    routing = adapter.routing_from_gate(out)
    slots = sharded_moe._route_slots(indices, locations, E, C)
    ds_d = sharded_moe._sparse_encode(x_SM, slots, E, C)
    assert torch.equal(dispatch(x_SM, routing, E), ds_d)
    y_ECM = y_ECM_of(C)
    assert torch.equal(combine(y_ECM, routing), sharded_moe._sparse_decode(y_ECM.view(E * C, M), slots, gates, S))
    assert routing.capacity == C and routing.aux_loss is l_aux and torch.equal(routing.exp_counts_E, counts)
    assert routing.dropped == int((indices < 0).sum()) and (routing.dropped > 0) == drop


def _facts(**kw):
    base = dict(name="layers.0.moe", hidden=8, num_experts=4, ep=2, k=1, capacity_factor=1.0, min_capacity=0,
                drop_tokens=True, expert_tp=False, tp=1, pp=1, tp_ranks=(), use_tutel=False, ffn=16)
    base.update(kw)
    return adapter.HostLayerFacts(**base)


def test_layer_problems_lists_every_reason():
    facts = _facts(use_tutel=True, pp=2, tp=2, tp_ranks=(0, 2), num_experts=6, ep=4)
    problems = adapter.layer_problems(facts, PluginConfig(esp=2), world=8, rank=0, ranks_per_node=4,
                                      use_data_before_expert_parallel=True)
    text = "; ".join(problems)
    assert "use_data_before_expert_parallelism (true) is not supported" in text
    assert "use_tutel (true) is not supported" in text
    assert "pipeline parallel degree (2) must be 1" in text
    assert "moe_plugins.esp (2) > 1 without DeepSpeed's expert tensor parallelism needs every expert to be " \
        "nn.Sequential(nn.Linear(M, H)" in text
    assert len(problems) == 4            # layout problems are checked once these are fixed
    etp = _facts(expert_tp=True, tp=2, tp_ranks=(0, 1))
    assert adapter.layer_problems(etp, PluginConfig(esp=4), world=8, rank=0, ranks_per_node=8,
                                  use_data_before_expert_parallel=False) == [
        "moe_plugins.esp (4) must equal the tensor-parallel degree (2) that enable_expert_tensor_parallelism "
        "shards this layer's expert modules by"]
    assert adapter.layer_problems(etp, PluginConfig(schedule="parm-s1"), world=4, rank=0, ranks_per_node=2,
                                  use_data_before_expert_parallel=False) == [
        "moe_plugins.schedule ('parm-s1') cannot run with DeepSpeed's expert tensor parallelism (esp 2): its "
        "local combine needs the experts' partial sums, and enable_expert_tensor_parallelism's expert modules "
        "all-reduce inside themselves; allowed here: 'baseline', 'baseline-tp'; or turn "
        "enable_expert_tensor_parallelism off and set moe_plugins.esp to 2: the plugin then slices plain FFN "
        "experts over ESP itself and Parm runs (docs/parm.md)"]
    sliceable = _facts(ffn_activation="gelu", ffn=18)
    assert adapter.layer_problems(sliceable, PluginConfig(esp=4), world=8, rank=0, ranks_per_node=8,
                                  use_data_before_expert_parallel=False) == ["ffn (18) must be divisible by esp (4)"]


def test_layer_problems_checks_the_mpu_and_the_layout():
    facts = _facts(tp=2, tp_ranks=(0, 2), num_experts=6, ep=2)
    text = "; ".join(adapter.layer_problems(facts, PluginConfig(schedule="baseline-tp"), world=4, rank=0,
                                            ranks_per_node=4, use_data_before_expert_parallel=False))
    assert "tensor-parallel group of rank 0 [0, 2] must be the contiguous block [0, 1]" in text
    facts = _facts(tp=2, tp_ranks=(0, 1), num_experts=6, ep=4)
    assert adapter.layer_problems(facts, PluginConfig(), world=8, rank=0, ranks_per_node=4,
                                  use_data_before_expert_parallel=False) == [
        "num_experts (6) must be divisible by ep (4)"]
    assert adapter.layer_problems(_facts(expert_tp=True, tp=2, tp_ranks=(0, 1)), PluginConfig(), world=4, rank=1,
                                  ranks_per_node=2, use_data_before_expert_parallel=False) == []


def test_ffn_activation_recognises_only_plain_ffns():
    from torch import nn
    assert adapter.ffn_activation(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), 8) == "gelu"
    assert adapter.ffn_activation(nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8, bias=False)), 8) == "silu"
    assert adapter.ffn_activation(nn.Sequential(nn.Linear(8, 16), nn.GELU("tanh"), nn.Linear(16, 8)), 8) is None
    assert adapter.ffn_activation(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)), 8) is None
    assert adapter.ffn_activation(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(12, 8)), 8) is None
    assert adapter.ffn_activation(nn.Linear(8, 8), 8) is None


def test_replica_groups():
    from moe_plugins.core.layout import ParallelLayout
    layout = ParallelLayout(world=8, ranks_per_node=4, ep=2, esp=2)
    assert adapter.replica_groups(layout) == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_expert_ffn_width():
    from torch import nn
    assert adapter.expert_ffn_width(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)), 8, 1) == 32
    assert adapter.expert_ffn_width(nn.Linear(8, 12), 8, 2) == 24
    with pytest.raises(ValueError, match="no 2-D weight of the expert takes M=8 inputs"):
        adapter.expert_ffn_width(nn.Linear(4, 8), 8, 1)
