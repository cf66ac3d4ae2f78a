"""Lancet on Megatron-core (patches/megatron_lancet.py): the plugin's MoE layers compute Megatron's SequentialMLP
experts with their weight gradients deferred, run behind the layers' backward exchanges. On 4 gloo ranks under the
CPU shims, through Megatron's DDP (overlap_grad_reduce, gradient accumulation 2): every ``main_grad`` equal to the
run without Lancet (fp64, <= 1e-12), each parameter's gradient accumulated once per backward, the queue empty and
run behind exchanges; 20 fp32 Adam steps with equal losses; refusals."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.workers import lancet_megatron as jobs  # noqa: E402

TIMEOUT_S = 600
EXACT = 1e-12


def _check(results, steps: int, accumulate: int):
    # every parameter got a gradient on some rank (a rank's expert may receive no token in a step)
    assert all(any(r["nonzero"][n] for r in results) for n in results[0]["nonzero"])
    for r in results:
        assert r["layers"] and r["queue_empty"] and r["items_run"] > 0
        # dW ran while a backward exchange flew (at PipeMoE degree > 1: while a chunk's stage flew on the lane)
        assert r["overlap_calls"] > 0, r["overlap_calls"]
        for step in r["diffs"]:
            assert step["dense"] <= EXACT and step["expert"] <= EXACT, r["diffs"]
        assert len(r["hooks"]) == steps * accumulate
        for calls in r["hooks"]:                                   # once per parameter and backward
            assert calls == dict.fromkeys(r["params"], 1), calls


@pytest.mark.parametrize("tp,ep,degree", [(1, 4, 1), (2, 2, 1), (1, 2, 2)], ids=["ep4", "tp2-ep2", "ep2-pipemoe2"])
def test_deferred_expert_grads_equal_and_delivered_once(world, tp, ep, degree):
    _check(world(4).run(jobs.grads_job, tp, ep, pipeline_degree=degree, timeout_s=TIMEOUT_S), 2, 2)


@pytest.mark.parametrize("tp,ep,degree", [(1, 4, 1), (1, 2, 2)], ids=["ep4", "ep2-pipemoe2"])
def test_lina_micro_ops_beside_deferred_grads(world, tp, ep, degree):
    """Lina and Lancet on one engine per layout: Lancet's exchanges (and its dW behind them) on the pipeline lane,
    Lina's gradient micro-ops on the background lane; every main_grad equal to the plain plugin's (Megatron's own
    reduction) in fp64 and delivered once."""
    results = world(4).run(jobs.grads_job, tp, ep, pipeline_degree=degree, lina=True, timeout_s=TIMEOUT_S)
    _check(results, 2, 2)
    for r in results:
        assert r["micro_ops"] > 0 and r["routed"] > 0, (r["micro_ops"], r["routed"])


@pytest.mark.parametrize("tp,ep", [(1, 4), (2, 2)], ids=["ep4", "tp2-sequence_parallel-ep2"])
def test_dense_wgrad_defers_megatron_parallel_linears(world, tp, ep):
    """``dense_wgrad`` on Megatron: the model's ColumnParallelLinear / RowParallelLinear layers (4 here; at TP 2
    sequence parallel, their input all-gathered and its gradient reduce-scattered) defer dW to the queue, every
    ``main_grad`` equal (fp64) and each gradient delivered once; disable() puts Megatron's GEMM back."""
    results = world(4).run(jobs.grads_job, tp, ep, dense=True, timeout_s=TIMEOUT_S)
    _check(results, 2, 2)
    for r in results:
        assert r["dense_deferred"] == 4 and r["restored"]
        assert r["dense_names"] == ["ColumnParallelLinear.0", "ColumnParallelLinear.1", "RowParallelLinear.2",
                                    "RowParallelLinear.3"], r["dense_names"]


def test_gated_linear_unit_experts(world):
    _check(world(4).run(jobs.grads_job, 1, 4, steps=1, gated=True, timeout_s=TIMEOUT_S), 1, 2)


def test_twenty_steps_equal_losses(world):
    for r in world(4).run(jobs.train_job, 1, 2, timeout_s=TIMEOUT_S):
        assert max(abs(a - b) for a, b in zip(r["off"], r["lancet"])) <= 1e-5, r
        assert len(r["lancet"]) == 20


def test_bare_spec_refused():
    """The spec provider alone (no enable()) refuses the section, deferred dW or partitions alike."""
    for lancet in ({}, {"partitions": 2, "defer_wgrad": False}):
        enabled, bare = jobs.refused({"schedule": "baseline", "lancet": lancet})
        assert enabled == "" and "moe_plugins.lancet needs the plugin enabled" in bare, (enabled, bare)
