"""Lina in Megatron-core's DistributedDataParallel (0.16.1 and 0.19.2; issue 23): gradient buckets reduced as
Lina's micro-ops on the engine the plugin's MoE layers share.

Layers: checks in this process (pure functions, enable() refusing before it patches anything); then gloo ranks
of the ``world`` pool, each running a tiny model (dense linears around two MoE layers) through Megatron's DDP with
``overlap_grad_reduce`` and gradient accumulation 2, with the ``lina`` section and without: ``main_grad`` after
``finish_grad_sync`` equal (bitwise at DP = 2, 1e-12 in fp64 at DP = 4), the engine's timeline in Lina's order,
20 Adam steps with equal losses, checkpoints both ways, and Megatron settings refused before DDP is built.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.core")

from megatron.core import package_info  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel  # noqa: E402
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup  # noqa: E402

from moe_plugins.core.layout import ParallelLayout  # noqa: E402
from moe_plugins.core.plugin_config import PluginConfig  # noqa: E402
from moe_plugins.patches import megatron as mp  # noqa: E402
from moe_plugins.patches.megatron_lina import LinaState, ddp_problems, version_problems  # noqa: E402
from moe_plugins.plugins import default_registry  # noqa: E402
from tests.lina_checks import micro_op_order as _order  # noqa: E402
from tests.workers import lina_megatron as jobs  # noqa: E402

TIMEOUT_S = 900
LINA = {"priority": True, "micro_op_mb": 0.0004}      # 400-byte micro-ops: several per bucket of this tiny model


def _section(**lina):
    return PluginConfig.from_dict({"schedule": "baseline", "lina": dict(LINA, **lina)},
                                  **default_registry().config_choices())


def _originals():
    return DistributedDataParallel.__dict__["__init__"], _ParamAndGradBucketGroup.__dict__["start_grad_sync"]


# ---- in this process -------------------------------------------------------------------------------------------

def test_unsupported_ddp_settings_are_listed_with_their_values():
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2,
                                           average_in_collective=True, reduce_scatter_with_fp32_accumulation=True)
    text = "; ".join(ddp_problems(config))
    assert "use_distributed_optimizer" not in text            # reduce-scattered as micro-ops
    for needle in ("reduce_scatter_with_fp32_accumulation (True) must be False with moe_plugins.lina: Lina's "
                   "micro-ops reduce in the gradients' dtype", "num_distributed_optimizer_instances (2) must be 1",
                   "average_in_collective (True) must be False", "gloo has no AVG"):
        assert needle in text, (needle, text)
    assert ddp_problems(DistributedDataParallelConfig(overlap_grad_reduce=True)) == []
    assert version_problems("0.16.1") == [] and version_problems("0.19.2") == []
    assert "needs megatron-core 0.16.1 or 0.19.2 (found 0.17.0)" in version_problems("0.17.0")[0]


def test_enable_refuses_an_unchecked_version_before_patching(monkeypatch):
    before = _originals()
    hooks = {(m, a): getattr(__import__(m, fromlist=[a]), a) for m, a in mp.HOOKS}
    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(ValueError) as err:
        mp.enable({"schedule": "baseline", "pipeline_degree": "auto", "lina": dict(LINA, packing=2)})
    assert "moe_plugins.lina needs megatron-core 0.16.1 or 0.19.2 (found 0.17.0)" in str(err.value)
    assert "moe_plugins.lina.packing (2) needs an integer moe_plugins.pipeline_degree (got 'auto')" in str(err.value)
    assert mp.active() is None and _originals() == before
    assert all(getattr(__import__(m, fromlist=[a]), a) is f for (m, a), f in hooks.items())


def test_flag_path_lists_every_ddp_argument_lina_cannot_run():
    args = argparse.Namespace(world_size=4, tensor_model_parallel_size=1, expert_model_parallel_size=2,
                              num_experts=4, hidden_size=8, ffn_hidden_size=16, moe_router_topk=2,
                              moe_token_dispatcher_type="alltoall", use_distributed_optimizer=True,
                              num_distributed_optimizer_instances=2, ddp_average_in_collective=True,
                              use_custom_fsdp=False,
                              moe_plugins='{"lina": {"micro_op_mb": 1}}')
    before = _originals()
    with pytest.raises(ValueError) as err:
        mp.enable_from_args(args)
    for needle in ("num_distributed_optimizer_instances (2) must be 1", "ddp_average_in_collective (True) must be False"):
        assert needle in str(err.value)
    assert "use_custom_fsdp" not in str(err.value) and "use_distributed_optimizer" not in str(err.value)
    assert mp.active() is None and _originals() == before


def test_enable_patches_ddp_only_with_lina_and_disable_restores_it():
    before = _originals()
    with mp.enable({"schedule": "baseline"}) as handle:
        assert handle.lina is None and _originals() == before
    with mp.enable({"schedule": "baseline", "lina": LINA}) as handle:
        assert handle.lina is not None
        patched = _originals()
        assert patched[0] is not before[0] and patched[1] is not before[1]
        assert patched[0].__wrapped__ is before[0] and patched[1].__wrapped__ is before[1]
    assert _originals() == before and mp.active() is None


def test_lina_needs_enable_not_the_bare_spec_provider():
    with pytest.raises(ValueError, match=r"moe_plugins.lina needs the plugin enabled"):
        mp.get_moe_module_spec(use_te=False, num_experts=4, plugin={"lina": LINA})


def test_auto_micro_op_size_without_a_profile_fails_before_any_group_is_built():
    state = LinaState.create(_section(micro_op_mb="auto"), "0.16.1")
    layout = ParallelLayout(world=2, ranks_per_node=2, ep=2)
    groups = SimpleNamespace(layout=layout)
    with pytest.raises(ValueError, match=r'micro_op_mb \("auto"\) needs a cost profile'):
        state.engine_for(groups, groups, lambda layout: None)
    assert state.engines == {}


# ---- gloo ranks -----------------------------------------------------------------------------------------------

def _issued_during_exchanges(r):
    """Per step: whether some micro-op was issued (DDP handed Lina a bucket) before that step's last exchange
    ended. Deterministic: with overlap_grad_reduce and 200-element buckets, from the second step on the buckets
    of the layers after the first MoE layer are complete before that layer's backward exchanges are issued; in
    the first step Megatron counts each bucket's ready gradients and starts every bucket from finish_grad_sync.
    (When a micro-op *starts* is the lane thread's timing: on 4 ranks over 2 cores a step can end its exchanges
    before any starts (1 CI run), so that is not asserted; the order check covers every start.)"""
    records = r["timeline"]
    micro = [x for x in records if x["priority"] == "background"]
    issued = []
    for start, end in r["bounds"]:
        exchanges = [x["end_ns"] for x in records if x["op"] == "all_to_all" and start <= x["start_ns"] <= end]
        issued.append(any(start <= x["issue_ns"] < max(exchanges) for x in micro))
    return issued


def _check_grads(results, tolerance, *, expect_expert=True):
    waited = 0
    for r in results:
        assert r["nonzero"] and r["routed"] >= 2, r["routed"]
        for step in r["diffs"]:
            assert step["dense"] <= tolerance and step["expert"] <= tolerance, r["diffs"]
        records = r["timeline"]
        micro = [x for x in records if x["priority"] == "background"]
        assert {x["group"] for x in micro} == ({"dp", "expert_dp"} if expect_expert else {"dp"})
        waited += _order(records)
        issued = _issued_during_exchanges(r)
        assert issued == [False] + [True] * (len(issued) - 1), f"buckets handed to Lina during exchanges: {issued}"
    assert waited > 0, "no micro-op ever waited for an exchange: the test exercised nothing"


def test_dp2_gradients_bitwise_and_in_lina_order_on_4_ranks(world):
    """TP 2 x EP 2 on 4 ranks: dense DP = expert DP = 2 (fp64, the background lane on the TP>1 layout)."""
    _check_grads(world(4).run(jobs.grads_job, 2, 2, LINA, timeout_s=TIMEOUT_S), 0.0)


def test_dp4_gradients_within_1e12_in_fp64(world):
    """TP 1 x EP 2 on 4 ranks: dense DP = 4 (a sum of 4 may round differently in slices), expert DP = 2."""
    _check_grads(world(4).run(jobs.grads_job, 1, 2, LINA, steps=3, timeout_s=TIMEOUT_S), 1e-12)


def test_pipemoe_degree_2_shares_the_engine_and_stays_exact(world):
    """PipeMoE r = 2: the chunks' exchanges run on the shared engine's pipeline lane, still urgent."""
    results = world(4).run(jobs.grads_job, 1, 2, LINA, pipeline_degree=2, timeout_s=TIMEOUT_S)
    _check_grads(results, 1e-12)
    assert all({"pipeline"} <= {x["lane"] for x in r["timeline"] if x["priority"] == "urgent"} for r in results)


def test_tied_weights_bitwise_at_dp2(world):
    """One dense weight used at both ends (a tied embedding): DDP holds it once, its gradient (both uses
    summed) goes through Lina's micro-ops once, bitwise equal to stock's."""
    tied, untied = (world(4).run(jobs.grads_job, 2, 2, LINA, tied=t, timeout_s=TIMEOUT_S)
                    for t in (True, False))
    _check_grads(tied, 0.0)
    assert all(a["params"] == b["params"] - 1 for a, b in zip(tied, untied))      # the tied weight counted once


def test_dp2_on_2_ranks_bitwise_with_and_without_overlap(world):
    """EP 2 on 2 ranks: expert DP is 1 (nothing to reduce), dense DP 2; without overlap_grad_reduce stock calls
    start_grad_sync from finish_grad_sync and Lina waits at once."""
    for overlap in (True, False):
        results = world(2).run(jobs.grads_job, 1, 2, LINA, overlap=overlap, timeout_s=TIMEOUT_S)
        for r in results:
            assert all(step["dense"] == 0.0 and step["expert"] == 0.0 for step in r["diffs"]), r["diffs"]
            assert r["nonzero"] and {x["group"] for x in r["timeline"] if x["priority"] == "background"} == {"dp"}
            _order(r["timeline"])
            # without overlap every bucket reaches Lina from finish_grad_sync, after the backward's exchanges
            assert _issued_during_exchanges(r) == [False, overlap], (overlap, _issued_during_exchanges(r))


@pytest.mark.parametrize("tp,ep,tolerance", [(2, 2, 0.0), (1, 2, 1e-12)], ids=["dp2-bitwise", "dp4-fp64"])
def test_distributed_optimizer_shards_equal_stock(world, tp, ep, tolerance):
    """Megatron's distributed optimizer: each bucket reduce-scattered as Lina's micro-ops (every shard's slices
    together), so each rank's shard of every ``main_grad`` is stock's sum (bitwise at DP 2, fp64 <= 1e-12 at DP
    4) and the rest of the buffer its own gradient, as stock leaves it; in Lina's order."""
    _check_grads(world(4).run(jobs.grads_job, tp, ep, LINA, distributed=True, timeout_s=TIMEOUT_S), tolerance)


def test_twenty_steps_with_the_distributed_optimizer_equal_stock(world):
    for r in world(4).run(jobs.train_job, 1, 2, LINA, distributed=True, timeout_s=TIMEOUT_S):
        assert r["routed"] >= 2 and len(r["lina"]) == len(r["off"]) == 20
        assert max(abs(a - b) / abs(a) for a, b in zip(r["off"], r["lina"])) <= 1e-5, (r["off"], r["lina"])
        assert sum(r["lina"][-4:]) < sum(r["lina"][:4])                      # it did learn


def test_twenty_steps_equal_losses_and_checkpoints_load_both_ways(world):
    for r in world(4).run(jobs.train_job, 1, 2, LINA, timeout_s=TIMEOUT_S):
        assert r["routed"] >= 2 and len(r["lina"]) == len(r["off"]) == 20
        for a, b in zip(r["off"], r["lina"]):
            assert abs(a - b) <= 1e-5 * abs(a), (r["off"], r["lina"])
        assert sum(r["lina"][-4:]) < sum(r["lina"][:4])                      # it did learn
        assert r["keys_equal"] and r["lina_to_off"] == 0.0 and r["off_to_lina"] == 0.0


def test_ddp_settings_and_groups_lina_cannot_run_are_refused_before_ddp_is_built(world):
    """TP 2 x EP 2; then a model without the plugin's layers, while Lina is on, keeps Megatron's reduction."""
    for rank, r in enumerate(world(4).run(jobs.bad_ddp_job, LINA, timeout_s=TIMEOUT_S)):
        settings, groups = r["messages"]
        for needle in ("moe_plugins.lina cannot reduce this model's gradients",
                       "reduce_scatter_with_fp32_accumulation (True) must be False",
                       "average_in_collective (True) must be False",
                       "delay_wgrad_compute (True) must be False"):
            assert needle in settings, (needle, settings)
        want = [0, 2] if rank % 2 == 0 else [1, 3]
        assert (f"reduces the dense gradients of rank {rank} over ranks [0, 1, 2, 3], but the plugin's layout puts "
                f"them in its dp group {want}") in groups, groups
        assert r["untouched"] and r["routed"] == 0
        assert r["routed_after"] == 0 and r["stock_err"] <= 1e-6        # a model without the plugin: stock DDP
