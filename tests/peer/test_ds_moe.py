# Ported from DeepSpeed (https://github.com/deepspeedai/DeepSpeed) tests/unit/v1/moe/test_moe.py.
# Copyright (c) Microsoft Corporation. SPDX-License-Identifier: Apache-2.0 (the original test logic).
# Changed: CPU/gloo pool harness instead of DistributedTest, fp32 instead of fp16, torch Adam; each test runs stock
# and with the moe_plugins DeepSpeed adapter on, and the plugin runs are compared with the stock ones.
"""DeepSpeed's own MoE unit tests (tests/unit/v1/moe/test_moe.py at DeepSpeed revision 70211f41, run against the
installed DeepSpeed 0.19.8), stock and with the plugin on: ``moe_plugins.enable(ds_config)`` with the section
``{"schedule": "baseline", "pipeline_degree": 1}`` ("baseline") and with pipeline degree 2 ("baseline-r2").

DeepSpeed's training tests assert only that training runs. The port also checks that every loss is finite and
that with the plugin on the losses equal stock DeepSpeed's, step by step (the plugin keeps DeepSpeed's gate, its
experts and its RNG draws, so the trajectory is the same up to fp32 rounding), and that the plugin swapped every
MoE layer to the section's schedule.

The gating-function tests (TestTopkGate, TestMoESingleton::test_capacity / test_no_ep_group, the capacity tests)
test DeepSpeed functions the plugin does not patch. They run stock as DeepSpeed wrote them; "with the plugin on"
they run the same inputs through the plugin's router (``patches/deepspeed_layer.gate_router``, which a swapped
layer calls instead of ``TopKGate.forward``) and check the same property.

Parm schedules need tensor parallelism (MP > 1), which no layout here has (tests/peer/test_ds_moe_tp.py runs
Parm). ``MOE_PLUGINS_PEER=full`` runs every parametrisation with DeepSpeed's 50 samples; the default is a bounded
CI share (fewer samples per training run; pipeline degree 2 on a subset)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.peer import workers as jobs

ds = pytest.importorskip("deepspeed")
sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")

FULL = os.environ.get("MOE_PLUGINS_PEER", "") == "full"
SAMPLES = 50 if FULL else 8           # DeepSpeed trains on 50 samples; CI runs fewer steps of the same loop
REL_TOL = 1e-4                        # fp32: the plugin's losses against stock DeepSpeed's
PLUGIN = ["baseline", "baseline-r2"]
CI_MOE_LAYOUTS = {(2, 1), (4, 0), (4, 2)}   # test_moe's plain-MoE (EP, ZeRO) share in CI: each stage, each EP

_stock = {}


def run_stock(world, size, fn, *args):
    """The stock run of a job, once per module: every plugin mode compares with the same stock run."""
    key = (fn.__name__, size, args)
    if key not in _stock:
        _stock[key] = world(size).run(fn, "stock", *args)
    return _stock[key]


def run(world, size, mode, fn, *args):
    """(this mode's per-rank results, the stock ones)."""
    base = run_stock(world, size, fn, *args)
    return (base if mode == "stock" else world(size).run(fn, mode, *args)), base


def ci_share(mode: str, keep: bool) -> None:
    if mode == "baseline-r2" and not (keep or FULL):
        pytest.skip("CI share: pipeline degree 2 runs on a subset (MOE_PLUGINS_PEER=full runs all)")


def check_swaps(ranks, mode, layers: int) -> None:
    for r in ranks:
        if mode == "stock":
            assert r["swaps"] == []
        else:
            section = jobs.SECTIONS[mode]
            assert len(r["swaps"]) == layers, r["swaps"]
            assert all(s["schedule"] == section["schedule"] and s["pipeline_degree"] == section["pipeline_degree"]
                       for s in r["swaps"]), r["swaps"]


def check_training(ranks, base, mode, layers: int) -> None:
    for r in ranks:
        assert "refused" not in r, r
        assert r["losses"] and all(math.isfinite(v) for v in r["losses"]), r["losses"]
    check_swaps(ranks, mode, layers)
    for rank, (r, s) in enumerate(zip(ranks, base)):
        assert len(r["losses"]) == len(s["losses"])
        for step, (a, b) in enumerate(zip(r["losses"], s["losses"])):
            assert a == pytest.approx(b, rel=REL_TOL, abs=1e-6), (rank, step, a, b)


# ---- training through deepspeed.initialize -------------------------------------------------------------

@pytest.mark.parametrize("mode", ["stock"] + PLUGIN)
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_simple_moe(world, zero_stage, mode):
    """Ports tests/unit/v1/moe/test_moe.py::TestSimpleMoE::test@70211f41 (world 2, EP 1, ZeRO 0/1/2, DeepSpeed's
    Adam from the config; here torch Adam, fp32)."""
    ci_share(mode, keep=zero_stage == 2)
    ranks, base = run(world, 2, mode, jobs.simple_moe, zero_stage, SAMPLES)
    check_training(ranks, base, mode, layers=2)


@pytest.mark.parametrize("mode", ["stock"] + PLUGIN)
@pytest.mark.parametrize("use_residual", [True, False])
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("ep_size", [2, 4])
def test_moe(world, ep_size, zero_stage, use_residual, mode):
    """Ports tests/unit/v1/moe/test_moe.py::TestMoE::test@70211f41 (world 4; EP 2 = expert + data parallel, EP 4 =
    expert only; ZeRO 0/1/2; residual MoE on/off; a client AdamW over DeepSpeed's MoE param groups). DeepSpeed's
    check is kept: ZeRO 1/2's ``average_tensor`` is wrapped so that every slice one reduction narrows belongs to
    parameters of one process group (dense: DP group; experts: their expert-DP group); the port also asserts
    that the check ran, on buckets holding expert parameters."""
    if not FULL and use_residual and (ep_size, zero_stage) != (2, 2):
        pytest.skip("CI share: the residual MoE at EP 2, ZeRO 2 only (MOE_PLUGINS_PEER=full runs all)")
    if not FULL and not use_residual and (ep_size, zero_stage) not in CI_MOE_LAYOUTS:
        pytest.skip("CI share: EP 2 at ZeRO 1 (ZeRO 2 with the residual MoE), EP 4 at ZeRO 0 and 2 "
                    "(MOE_PLUGINS_PEER=full runs all)")
    ci_share(mode, keep=(ep_size, zero_stage, use_residual) == (4, 2, False))
    ranks, base = run(world, 4, mode, jobs.moe_ep, ep_size, zero_stage, use_residual, SAMPLES)
    check_training(ranks, base, mode, layers=2)
    for r in ranks:
        if zero_stage == 0:
            assert r["strict"]["calls"] == 0          # ZeRO 0 has no average_tensor: DeepSpeed's `if` skips it
        else:
            assert r["strict"]["calls"] >= len(r["losses"]) and r["strict"]["slices"] > 0, r["strict"]
            assert r["strict"]["moe_buckets"] > 0, r["strict"]


@pytest.mark.parametrize("mode", ["stock"] + PLUGIN)
@pytest.mark.parametrize("use_residual", [True, False])
def test_prmoe(world, use_residual, mode):
    """Ports tests/unit/v1/moe/test_moe.py::TestPRMoE::test@70211f41 (world 4, EP 2, pyramid: 2 then 4 Linear
    experts, train_batch_size 8, client AdamW)."""
    ci_share(mode, keep=not use_residual)
    ranks, base = run(world, 4, mode, jobs.prmoe, 2, use_residual, SAMPLES)
    check_training(ranks, base, mode, layers=2)


@pytest.mark.parametrize("mode", ["stock"] + PLUGIN)
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_expert_weight_grad_with_zero(world, zero_stage, mode):
    """Ports tests/unit/v1/moe/test_moe.py::TestExpertWeightGradWithZero::test@70211f41 (world 2, ZeRO 0/1/2): a
    model with 2 experts at EP 1 and the same weights at EP 2 give each expert the same gradient
    (``safe_get_full_grad``, rtol 1e-4, DeepSpeed's bound). With the plugin on, both engines run the plugin, and
    their expert gradients also equal stock DeepSpeed's (rtol 1e-4, atol 1e-5 x the tensor's largest entry)."""
    ci_share(mode, keep=zero_stage == 0)
    ranks, base = run(world, 2, mode, jobs.expert_grad_with_zero, zero_stage)
    check_swaps(ranks, mode, layers=4)
    for r, s in zip(ranks, base):
        assert "refused" not in r, r
        assert len(r["grads_ep1"]) == len(r["grads_ep2"]) == 8 * 2      # 2 layers x 4 tensors x 2 samples
        for mine, theirs in zip(r["grads_ep1"] + r["grads_ep2"], s["grads_ep1"] + s["grads_ep2"]):
            # fp32; pipelined chunks sum in another order: relative to the tensor's largest entry
            assert torch.allclose(mine, theirs, atol=1e-5 * float(theirs.abs().max()), rtol=1e-4)
    # DeepSpeed's bound; pipelined chunks sum each expert's gradient in two parts, so an entry 1e4 times below the
    # tensor's largest is off by fp32 rounding of that sum (seen: 4.7e-10 on -1.85e-7, largest 4.8e-3)
    pipelined = (jobs.SECTIONS[mode] or {}).get("pipeline_degree", 1) != 1
    ep1_equals_ep2 = all(torch.allclose(g1, g2, atol=1e-6 * float(g2.abs().max()) if pipelined else 0, rtol=1e-4)
                         for r in ranks for g1, g2 in zip(r["grads_ep1"], r["grads_ep2"]))
    if zero_stage and not ep1_equals_ep2:
        # stock fails this too (checked: the plugin's gradients equal stock's above): DeepSpeed 0.19.8's
        # safe_get_full_grad returns zeros for the EP = 2 engine's experts under ZeRO 1/2 on CPU/gloo
        pytest.xfail("DeepSpeed 0.19.8 (stock too): ZeRO 1/2 safe_get_full_grad gives zero EP=2 expert grads")
    assert ep1_equals_ep2


# ---- TestMoESingleton::test_all_to_all: DeepSpeed's exchange counter ------------------------------------

@pytest.mark.parametrize("mode", ["stock"] + PLUGIN)
@pytest.mark.parametrize("ep_size, expected_calls", [(1, 0), (2, 2)], ids=["single", "multi"])
def test_all_to_all(world, ep_size, expected_calls, mode):
    """Ports tests/unit/v1/moe/test_moe.py::TestMoESingleton::test_all_to_all@70211f41 (world 2, a bare MoE layer
    under deepspeed.initialize; ``sharded_moe._AllToAll.apply`` replaced by a counting identity).

    Plugin-specific: a swapped layer never calls DeepSpeed's ``_AllToAll`` (its schedule issues the exchanges
    through the core's comm layer), and the plugin reports none through DeepSpeed's hooks or counters. So with
    the plugin on, the ``_AllToAll`` count is 0 whatever EP is, and DeepSpeed's expected count is checked on the
    plugin's own ledger (``moe_plugins.enable(..., ledger=CommLedger())``) instead: ``expected_calls``
    all-to-alls in the forward (dispatch, combine; per chunk at pipeline degree r, so r times as many), none on a
    single-rank EP group, and as many in the backward.
    The rest of DeepSpeed's checks (input and parameter gradients exist) are unchanged."""
    ranks, _ = run(world, 2, mode, jobs.all_to_all_count, ep_size)
    check_swaps(ranks, mode, layers=1)
    for r in ranks:
        assert r["x_grad"] and r["param_grad"]
        if mode == "stock":
            assert r["after_forward"] == expected_calls and r["after_backward"] == expected_calls
        else:
            assert r["after_forward"] == 0 and r["after_backward"] == 0
            chunks = jobs.SECTIONS[mode]["pipeline_degree"]    # PipeMoE: one dispatch and combine per chunk
            assert r["ledger_forward"] == ["all_to_all"] * expected_calls * chunks, r["ledger_forward"]
            assert r["ledger_backward"] == ["all_to_all"] * expected_calls * chunks, r["ledger_backward"]


# ---- TestTopk: dropless top-1 on unequal token counts --------------------------------------------------

def _topk_uneven(rank: int):
    """TestTopk's gating call on one rank: 2 tokens on rank 0, 10 on rank 1, dropless, RTS on, no ep_group."""
    torch.manual_seed(rank)
    logits = torch.rand(2 if rank == 0 else 10, 2)
    out = sharded_moe.top1gating(logits=logits, capacity_factor=1, min_capacity=0, used_token=None,
                                 noisy_gate_policy=None, drop_tokens=False, use_rts=True, sparse_routes=False)
    return logits, out


@pytest.mark.parametrize("mode", ["stock", "baseline"])
def test_topk_uneven_tokens(mode):
    """Ports tests/unit/v1/moe/test_moe.py::TestTopk::test@70211f41 (dropless top-1 gating with RTS, 2 tokens on
    rank 0 and 10 on rank 1, no ep_group). DeepSpeed's test only calls ``top1gating``; the port checks what that
    call promises (no token dropped; without an ep_group the capacity is the largest local expert count), for
    both ranks' token counts. With the plugin on: the plugin's router on the same logits, the same checks and
    the same capacity as DeepSpeed's."""
    for rank in (0, 1):
        logits, (_, _, dispatch_mask, exp_counts) = _topk_uneven(rank)
        if mode == "stock":
            assert int(dispatch_mask.sum()) == logits.shape[0]
            assert dispatch_mask.shape[-1] == int(exp_counts.max())
        else:
            capacity, routed = _plugin_capacity(1, logits, capacity_factor=1, min_capacity=0, drop_tokens=False,
                                                use_rts=True)
            assert routed == logits.shape[0] and capacity == dispatch_mask.shape[-1]


# ---- TestMoESingleton::test_capacity / test_no_ep_group: the dropless capacity's collectives -----------

@pytest.mark.parametrize("mode", ["stock", "baseline"])
@pytest.mark.parametrize("gate", ["top1", "top2", "topk"])
@pytest.mark.parametrize("ep_world_size, expected_calls", [(1, 0), (2, 1)], ids=["single", "multi"])
def test_capacity(world, ep_world_size, expected_calls, gate, mode):
    """Ports tests/unit/v1/moe/test_moe.py::TestMoESingleton::test_capacity@70211f41 (world 2; a dropless gating
    call all-reduces its capacity with MAX over the EP group once, and not at all on a single-rank group).
    With the plugin on: the plugin's router (fast gate for top-1/top-2, DeepSpeed's gate for k = 3) on the same
    logits makes the same collectives, and every rank gets the same capacity."""
    ranks = world(2).run(jobs.capacity_collectives, mode, gate, ep_world_size)
    for r in ranks:
        assert r["calls"] == expected_calls
        if expected_calls:
            assert r["max"] == [True] and r["group_is_ep"] == [True]
    if ep_world_size == 2:
        assert len({r["capacity"] for r in ranks}) == 1
    if mode != "stock":
        base = run_stock(world, 2, jobs.capacity_collectives, gate, ep_world_size)
        assert [r["capacity"] for r in ranks] == [r["capacity"] for r in base]


@pytest.mark.parametrize("mode", ["stock", "baseline"])
def test_no_ep_group(mode):
    """Ports tests/unit/v1/moe/test_moe.py::TestMoESingleton::test_no_ep_group@70211f41 (dropless top-2 with
    ep_group None makes no collective: DeepSpeed's get_world_size/all_reduce are replaced by ones that fail).
    With the plugin on, the plugin's router on the same logits; both must route every token twice."""
    torch.manual_seed(0)
    r = jobs.gate_collectives_without_ep_group(mode)
    assert r["routed"] == 8 * 2 and r["capacity"] >= 1


# ---- TestTopkGate: sparse routes against the dense masks -----------------------------------------------

def _gate(k, logits, sparse, **kw):
    if k == 1:
        return sharded_moe.top1gating(logits, 1.0, 0, use_rts=False, sparse_routes=sparse, **kw)
    if k == 2:
        return sharded_moe.top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False, sparse_routes=sparse, **kw)
    return sharded_moe.topkgating(logits, k, 1.0, 0, sparse_routes=sparse, **kw)


@pytest.mark.parametrize("mode", ["stock", "baseline"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_dispatch_matches_dense(k, mode):
    """Ports tests/unit/v1/moe/test_moe.py::TestTopkGate::test_sparse_dispatch_matches_dense@70211f41: the sparse
    routes dispatch and combine like the dense dispatch/combine masks. Stock: DeepSpeed's ``_route_slots`` /
    ``_sparse_encode`` / ``_sparse_decode``. With the plugin on: the plugin's conversion of the same sparse output
    (``routing_from_gate``) and the core's ``dispatch`` / ``combine``, which a swapped layer runs instead."""
    from moe_plugins.core.dispatch import combine, dispatch
    from moe_plugins.patches.deepspeed_layer import routing_from_gate
    torch.manual_seed(k)
    num_tokens, num_experts, d_model = 16, 4, 8
    logits = torch.randn(num_tokens, num_experts)
    hidden = torch.randn(num_tokens, d_model)
    dense, sparse = _gate(k, logits, False), _gate(k, logits, True)
    combine_weights, dispatch_mask = dense[1], dense[2]
    capacity, indices_, locations_, gates_ = int(sparse[1]), sparse[3], sparse[4], sparse[5]
    expected = torch.einsum("sec,sm->ecm", dispatch_mask.float(), hidden)
    expert_output = torch.randn_like(expected)
    expected_out = torch.einsum("sec,ecm->sm", combine_weights, expert_output)
    if mode == "stock":
        slots = sharded_moe._route_slots(indices_, locations_, num_experts, capacity)
        encoded = sharded_moe._sparse_encode(hidden, slots, num_experts, capacity)
        decoded = sharded_moe._sparse_decode(expert_output.view(num_experts * capacity, d_model), slots, gates_,
                                             num_tokens)
    else:
        routing = routing_from_gate(sparse)
        encoded = dispatch(hidden, routing, num_experts)
        decoded = combine(expert_output, routing)
    torch.testing.assert_close(encoded, expected)
    torch.testing.assert_close(decoded, expected_out)


def _assert_sparse_routes_match(combine_weights, sparse_output):
    _, capacity, num_experts, indices_, locations_, gates_, _ = sparse_output
    reconstructed = torch.zeros_like(combine_weights)
    for indices_s, locations_s, gates_s in zip(indices_, locations_, gates_):
        route_mask = indices_s.ge(0)
        expert_mask = torch.nn.functional.one_hot(indices_s.clamp_min(0).long(), num_classes=num_experts)
        expert_mask *= route_mask.unsqueeze(1)
        location_mask = torch.nn.functional.one_hot(locations_s.long(), num_classes=int(capacity))
        reconstructed += torch.einsum("s,se,sc->sec", gates_s, expert_mask, location_mask)
    torch.testing.assert_close(reconstructed, combine_weights)


def _assert_routing_matches(combine_weights, routing):
    """The plugin's Routing (expert, slot, weight per route) rebuilds DeepSpeed's dense combine weights."""
    reconstructed = torch.zeros_like(combine_weights)
    S, K = routing.expert_SK.shape
    for s in range(S):
        for j in range(K):
            if int(routing.slot_SK[s, j]) >= 0:
                reconstructed[s, int(routing.expert_SK[s, j]), int(routing.slot_SK[s, j])] += routing.weight_SK[s, j]
    torch.testing.assert_close(reconstructed, combine_weights)


@pytest.mark.parametrize("mode", ["stock", "baseline"])
@pytest.mark.parametrize("k", [2, 3])
def test_sparse_topk_routes(k, mode):
    """Ports tests/unit/v1/moe/test_moe.py::TestTopkGate::test_sparse_top2_routing and ::test_sparse_topk_routing
    @70211f41 (DeepSpeed's fixed logits; k sparse route sets rebuild the dense combine weights). With the plugin
    on: the plugin's Routing of the same sparse output rebuilds them."""
    from moe_plugins.patches.deepspeed_layer import routing_from_gate
    if k == 2:
        logits = torch.tensor([[0.1, 0.9, 0.2], [0.8, 0.1, 0.3], [0.4, 0.6, 0.5], [0.7, 0.2, 0.1]])
        native = sharded_moe.top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False)
        sparse = sharded_moe.top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False, sparse_routes=True)
    else:
        logits = torch.tensor([[0.1, 0.9, 0.2, 0.3], [0.8, 0.1, 0.3, 0.2], [0.4, 0.6, 0.5, 0.7],
                               [0.7, 0.2, 0.1, 0.8]])
        native = sharded_moe.topkgating(logits, 3, 0.5, 0)
        sparse = sharded_moe.topkgating(logits, 3, 0.5, 0, sparse_routes=True)
    assert len(sparse[3]) == k
    if mode == "stock":
        _assert_sparse_routes_match(native[1], sparse)
    else:
        routing = routing_from_gate(sparse)
        assert routing.expert_SK.shape == (logits.shape[0], k)
        _assert_routing_matches(native[1], routing)


# ---- capacity rules of the gating functions ------------------------------------------------------------

def _plugin_capacity(k, logits, **kw):
    """The capacity and routed count the plugin's router (gate_router) gives for these logits."""
    from moe_plugins.patches.deepspeed_layer import gate_router
    gate = jobs.identity_gate(logits.shape[1], k, **kw)
    routing = gate_router(gate, None, logits)
    return int(routing.capacity), int((routing.slot_SK >= 0).sum())


@pytest.mark.parametrize("mode", ["stock", "baseline"])
def test_top1gating_drop_capacity_exceeds_num_tokens(mode):
    """Ports tests/unit/v1/moe/test_moe.py::test_top1gating_drop_capacity_exceeds_num_tokens@70211f41 (s = 8,
    e = 2, capacity_factor 4: capacity 16 > 8 tokens, every token routed). Plugin: its router, same settings."""
    torch.manual_seed(0)
    logits = torch.randn(8, 2)
    if mode == "stock":
        _, _, dispatch_mask, _ = sharded_moe.top1gating(logits, capacity_factor=4.0, min_capacity=0,
                                                        drop_tokens=True, use_rts=False)
        capacity, routed = dispatch_mask.shape[-1], int(dispatch_mask.sum())
    else:
        capacity, routed = _plugin_capacity(1, logits, capacity_factor=4.0, min_capacity=0, use_rts=False)
    assert capacity == 16 and routed == 8


@pytest.mark.parametrize("mode", ["stock", "baseline"])
def test_top1gating_preserves_tensor_parallel_capacity(mode):
    """Ports tests/unit/v1/moe/test_moe.py::test_top1gating_preserves_tensor_parallel_capacity@70211f41 (s = 3,
    e = 4, capacity_factor 8: capacity 6, which drop_tokens needs divisible by TP 2). Plugin: its router."""
    torch.manual_seed(0)
    logits = torch.randn(3, 4)
    if mode == "stock":
        _, _, dispatch_mask, _ = sharded_moe.top1gating(logits, capacity_factor=8.0, min_capacity=0,
                                                        drop_tokens=True, use_rts=False)
        capacity = dispatch_mask.shape[-1]
    else:
        capacity, _ = _plugin_capacity(1, logits, capacity_factor=8.0, min_capacity=0, use_rts=False)
    assert capacity == 6


def test_topkgating_capacity_rules():
    """Ports tests/unit/v1/moe/test_moe.py::test_topkgating_probs_capacity_exceeds_num_tokens and
    ::test_topkgating_position_preserves_min_capacity@70211f41 (stock only: k > 2 is routed by DeepSpeed's own
    ``topkgating`` with the plugin on too, the fast gate falls back to the gate; see test_capacity[topk])."""
    torch.manual_seed(0)
    _, _, dispatch_mask, _ = sharded_moe.topkgating(torch.randn(8, 2), 2, capacity_factor=2.0, min_capacity=0,
                                                    drop_policy="probs")
    assert dispatch_mask.shape[-1] == 16 and int(dispatch_mask.sum()) == 8 * 2
    _, _, dispatch_mask, _ = sharded_moe.topkgating(torch.randn(4, 2), 1, capacity_factor=1.0, min_capacity=8,
                                                    drop_policy="position")
    assert dispatch_mask.shape[-1] == 8


def test_topkgating_drop_policies(world):
    """Ports tests/unit/v1/moe/test_moe.py::TestTopkGate::test@70211f41 (world 2; DeepSpeed's fixed logits scaled by
    rank + 1 and its expected dispatch masks for drop_policy 'probs' / 'position' and dropless). Stock only:
    ``topkgating`` (k > 2) is not replaced by the plugin's router."""
    ranks = world(2).run(jobs.topkgating_drop_policies)
    assert ranks == [{"probs_k2": True, "position_k2": True, "probs_k3": True, "position_k3": True,
                      "dropless": True}] * 2
