"""The exact fast gate (moe_plugins/core/fastgate.py) against DeepSpeed's own ``top1gating`` / ``top2gating``
and ``TopKGate``: same experts, locations, drops, combine weights, l_aux, exp_counts, gate-weight gradients and
random draws (the generator ends in the same state), on random and adversarial logits.

Every float comparison is bitwise (``torch.equal``): the fast gate runs DeepSpeed's float ops in DeepSpeed's
order (softmax, mean, the l_aux products and sums, top-2's clamp and divisions); where it replaces an op, the
replaced one is exact (a row sum of gates times a 0/1 mask equals the gathered gate, a mean of a 0/1 mask equals
count / S on CPU), so no tolerance is needed. fp64 top-2 runs DeepSpeed with its einsum helper promoting
dtypes, as stock top2gating raises on fp64 logits (its float32 masks meet fp64 gates in einsum)."""

from __future__ import annotations

import importlib
import logging
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moe_plugins.core import fastgate
from moe_plugins.core.fastgate import (dense_format, rank_within_key, sparse_format, top1_routing, top2_routing,
                                       topk_routing)

sm = pytest.importorskip("deepspeed.moe.sharded_moe")
layer = importlib.import_module("moe_plugins.patches.deepspeed_layer")

STYLES = ("normal", "ties", "zero", "one_expert", "extreme")


def gate_inputs(style: str, num_tokens: int, num_experts: int, seed: int, dtype: torch.dtype):
    """x_SM and a gate weight wg_EM whose logits have the given shape: random, many exact ties (integer
    values), all-equal rows (every token argmaxes expert 0), one expert taking all tokens, or saturated
    softmax (gates of exactly 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 4, generator=g, dtype=dtype)
    w = torch.randn(num_experts, 4, generator=g, dtype=dtype)
    if style == "ties":
        x, w = x.round().clamp(-1, 1), w.round().clamp(-1, 1)
    elif style == "zero":
        w = torch.zeros_like(w)
    elif style == "one_expert":
        x[:, 0], w = 1.0, w * 0.1
        w[int(torch.randint(num_experts, (1,), generator=g)), 0] = 8.0
    elif style == "extreme":
        w = w * 60
    return x, w


def used_mask(kind: str, num_tokens: int, seed: int):
    if kind == "none":
        return None
    if kind == "zeros":
        return torch.zeros(num_tokens, dtype=torch.long)
    mask = torch.rand(num_tokens, generator=torch.Generator().manual_seed(seed + 1)) < 0.6
    return mask if kind == "bool" else mask.long()


def run(fn, x, w, seed, loss_of):
    """fn(logits) from ``seed``; returns its output, the gate weight's gradient of loss_of(output), and the
    generator's next draw (so equal draws means the same random numbers were consumed)."""
    wp = w.clone().requires_grad_()
    logits = x @ wp.t()
    torch.manual_seed(seed)
    out = fn(logits)
    after = torch.rand(3)
    loss_of(out).backward()
    return out, wp.grad, after


def sparse_loss(out):
    gates_KS = out[5]
    coef = torch.linspace(-1.0, 2.0, gates_KS.numel(), dtype=gates_KS.dtype).view_as(gates_KS)
    return out[0] * 3 + (gates_KS * coef).sum()


def dense_loss(out):
    combine = out[1]
    return out[0] * 3 + (combine * torch.linspace(-1.0, 2.0, combine.numel(), dtype=combine.dtype).view_as(combine)).sum()


def assert_same(ds_run, fast_run, dense: bool):
    (a, ga, ra), (b, gb, rb) = ds_run, fast_run
    assert torch.equal(ra, rb), "different random draws"
    assert torch.equal(a[0], b[0]) and a[0].dtype == b[0].dtype, "l_aux"
    if dense:
        assert a[1].shape == b[1].shape and torch.equal(a[1], b[1]) and a[1].dtype == b[1].dtype, "combine_weights"
        assert torch.equal(a[2], b[2]), "dispatch_mask"
        assert torch.equal(a[3], b[3]) and a[3].dtype == b[3].dtype, "exp_counts"
    else:
        assert int(a[1]) == int(b[1]) and a[2] == b[2], "capacity / E"
        assert torch.equal(a[3], b[3]), "experts (-1: dropped)"
        assert torch.equal(a[4], b[4]), "locations"
        assert torch.equal(a[5], b[5]) and a[5].dtype == b[5].dtype, "gates"
        assert torch.equal(a[6], b[6]) and a[6].dtype == b[6].dtype, "exp_counts"
    assert torch.equal(ga, gb), "gate weight gradient"


@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(1, 48), num_experts=st.integers(1, 9), style=st.sampled_from(STYLES),
       drop=st.booleans(), rts=st.booleans(), factor=st.sampled_from([0.01, 0.3, 1.0, 2.5]),
       min_capacity=st.sampled_from([0, 1, 4]), used=st.sampled_from(["none", "long", "bool", "zeros"]),
       rsample=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 10_000))
def test_top1_matches_deepspeed(num_tokens, num_experts, style, drop, rts, factor, min_capacity, used, rsample,
                                dtype, seed):
    min_capacity = min(min_capacity, num_tokens)             # DeepSpeed asserts S >= min_capacity
    x, w = gate_inputs(style, num_tokens, num_experts, seed, dtype)
    used_token = used_mask(used, num_tokens, seed)
    policy = "RSample" if rsample else None
    fast = lambda lg: top1_routing(lg, factor, min_capacity, used_token_S=used_token, noisy_gate_policy=policy,
                                   drop_tokens=drop, use_rts=rts)
    for sparse in (True, False):
        if not sparse and not drop and used_token is not None and not bool(used_token.any()):
            continue                                         # capacity 0: DeepSpeed's dense one_hot raises
        ds = lambda lg: sm.top1gating(lg, factor, min_capacity, used_token, policy, drop, rts, None, sparse)
        ours = (lambda lg: sparse_format(fast(lg), num_experts)) if sparse else \
            (lambda lg: dense_format(fast(lg), num_experts))
        loss = sparse_loss if sparse else dense_loss
        assert_same(run(ds, x, w, seed, loss), run(ours, x, w, seed, loss), dense=not sparse)


def _promoting_einsum(rule, a, b):
    dtype = torch.promote_types(a.dtype, b.dtype)
    return torch.einsum(rule, a.to(dtype), b.to(dtype))


@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(1, 48), num_experts=st.integers(1, 9), style=st.sampled_from(STYLES),
       drop=st.booleans(), sampling=st.booleans(), factor=st.sampled_from([0.01, 0.3, 1.0, 2.5]),
       min_capacity=st.sampled_from([0, 1, 4, 60]), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 10_000))
def test_top2_matches_deepspeed(num_tokens, num_experts, style, drop, sampling, factor, min_capacity, dtype, seed):
    x, w = gate_inputs(style, num_tokens, num_experts, seed, dtype)
    fast = lambda lg: top2_routing(lg, factor, min_capacity, drop_tokens=drop, top2_2nd_expert_sampling=sampling)
    with pytest.MonkeyPatch.context() as mp:
        if dtype == torch.float64:
            mp.setattr(sm, "einsum", _promoting_einsum)
        for sparse in (True, False):
            ds = lambda lg: sm.top2gating(lg, factor, min_capacity, drop, None, sampling, sparse)
            ours = (lambda lg: sparse_format(fast(lg), num_experts)) if sparse else \
                (lambda lg: dense_format(fast(lg), num_experts))
            loss = sparse_loss if sparse else dense_loss
            assert_same(run(ds, x, w, seed, loss), run(ours, x, w, seed, loss), dense=not sparse)


def test_stock_top2_rejects_fp64_logits_which_is_why_the_fp64_check_promotes():
    with pytest.raises(RuntimeError, match="expected scalar type"):
        sm.top2gating(torch.randn(8, 4, dtype=torch.float64), 1.0, 0, True, None, False, True)
    r = top2_routing(torch.randn(8, 4, dtype=torch.float64), 1.0, 0, top2_2nd_expert_sampling=False)
    assert r.weight_SK.dtype == torch.float64 and r.expert_SK.shape == (8, 2)


def quantized_uniform(shape, device):
    """U draws with many exact ties and zeros, to force topk's tie order into play."""
    return (torch.rand(shape, device=device) * 4).floor() / 4


def tied_uniform(shape, device):
    """U draws with many exact ties but no zero."""
    return (torch.rand(shape, device=device) * 4).floor() / 4 + 0.125


@settings(max_examples=120, deadline=None)
@given(num_tokens=st.integers(2, 40), num_experts=st.integers(1, 6), factor=st.sampled_from([0.2, 0.5, 1.0]),
       used=st.sampled_from(["none", "long"]), drop=st.booleans(), zeros=st.booleans(), seed=st.integers(0, 10_000))
def test_top1_rts_ties_and_zero_draws_follow_topk(num_tokens, num_experts, factor, used, drop, zeros, seed):
    """Tied U at an expert's capacity boundary, and U = 0 (tied with the rows of other experts): the fast gate
    hands the pick to the same topk on the same (S, E) tensor, so even topk's tie order is reproduced."""
    draw = quantized_uniform if zeros else tied_uniform
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sm.exp_selection_uniform_map, torch.device("cpu"), lambda shape: draw(shape, "cpu"))
        _check_quantized_rts(num_tokens, num_experts, factor, used, drop, seed, draw)


def _check_quantized_rts(num_tokens, num_experts, factor, used, drop, seed, draw):
    x, w = gate_inputs("normal", num_tokens, num_experts, seed, torch.float32)
    used_token = used_mask(used, num_tokens, seed)
    ds = lambda lg: sm.top1gating(lg, factor, 0, used_token, None, drop, True, None, True)
    ours = lambda lg: sparse_format(top1_routing(lg, factor, 0, used_token_S=used_token, drop_tokens=drop,
                                                 uniform=draw), num_experts)
    assert_same(run(ds, x, w, seed, sparse_loss), run(ours, x, w, seed, sparse_loss), dense=False)


def test_the_topk_fallback_runs_only_where_topk_tie_order_decides(monkeypatch):
    calls, picks = [], []
    original, rts = fastgate._topk_kept, fastgate._rts_kept
    monkeypatch.setattr(fastgate, "_topk_kept", lambda *a: calls.append(a) or original(*a))
    monkeypatch.setattr(fastgate, "_rts_kept", lambda *a: picks.append(rts(*a)) or picks[-1])
    logits = torch.randn(4096, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    r = top1_routing(logits, 0.5, 0)                                    # experts over capacity, distinct U
    assert r.dropped > 0 and not calls and picks[-1] is not None
    top1_routing(logits, 0.5, 0, use_rts=False)                         # over capacity without RTS: topk's order
    assert len(calls) == 1
    top1_routing(logits, 0.5, 0, uniform=tied_uniform)                  # tied U at the boundary: topk's order
    assert len(calls) == 2 and picks[-1] is None
    top1_routing(logits, 4.0, 0, uniform=quantized_uniform)             # a drawn 0: topk's order
    assert len(calls) == 3 and len(picks) == 2
    top1_routing(logits, 4.0, 0, use_rts=False)                         # nothing over capacity
    assert len(calls) == 3


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.integers(0, 5), min_size=1, max_size=60))
def test_rank_within_key_counts_earlier_equal_keys(keys):
    rank, count = rank_within_key(torch.tensor(keys), 6)
    assert rank.tolist() == [keys[:i].count(k) for i, k in enumerate(keys)]
    assert count.tolist() == [keys.count(k) for k in range(6)]


def test_topk_routing_refuses_k_above_two():
    with pytest.raises(ValueError, match="k \\(3\\) must be 1 or 2"):
        topk_routing(torch.randn(4, 4), 3, 1.0, 0)
    assert topk_routing(torch.randn(4, 4), 2, 1.0, 0).expert_SK.shape == (4, 2)


@pytest.mark.parametrize("used", ["float", "twos"])
def test_top1_refuses_a_used_token_that_is_not_a_mask(used):
    token = torch.ones(6) if used == "float" else torch.full((6,), 2)
    with pytest.raises(ValueError, match="used_token"):
        top1_routing(torch.randn(6, 3), 1.0, 0, used_token_S=token)


# ---- the plugin's DeepSpeed path: TopKGate through gate_router ---------------------------------------------

def gate_run(gate, x, used_token, fast, seed=1):
    gate.zero_grad()
    torch.manual_seed(seed)
    r = layer.gate_router(gate, used_token, x, fast)
    after = torch.rand(3)
    (r.aux_loss * 2 + (r.weight_SK ** 3).sum()).backward()
    return r, gate.wg.weight.grad.clone(), after


def assert_same_routing(a, b):
    (ra, ga, na), (rb, gb, nb) = a, b
    kept = ra.slot_SK >= 0
    assert torch.equal(ra.slot_SK, rb.slot_SK) and torch.equal(ra.expert_SK[kept], rb.expert_SK[kept])
    assert torch.equal(ra.weight_SK, rb.weight_SK) and ra.capacity == rb.capacity
    assert torch.equal(ra.aux_loss, rb.aux_loss) and torch.equal(ra.exp_counts_E, rb.exp_counts_E)
    assert torch.equal(ga, gb) and torch.equal(na, nb)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("policy", [None, "Jitter", "RSample"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("drop,rts,sampling", [(True, True, True), (True, False, False), (False, True, False)])
def test_gate_router_reproduces_topkgate(k, policy, training, drop, rts, sampling):
    torch.manual_seed(0)
    gate = sm.TopKGate(8, 6, k=k, capacity_factor=0.6, eval_capacity_factor=1.4, min_capacity=2,
                       noisy_gate_policy=policy, drop_tokens=drop, use_rts=rts, top2_2nd_expert_sampling=sampling)
    gate.train(training)
    x = torch.randn(40, 8, dtype=torch.float64)                       # TopKGate casts to fp32 itself
    used_token = (torch.rand(40) < 0.7).long() if k == 1 else None
    assert layer.fast_gate_refusal(gate, used_token) is None
    assert_same_routing(gate_run(gate, x, used_token, fast=False), gate_run(gate, x, used_token, fast=True))


def test_dropless_capacity_is_padded_to_the_tensor_parallel_degree(monkeypatch):
    """Without expert tensor parallelism DeepSpeed rounds the dropless capacity up to a multiple of the mpu's
    tensor-parallel degree (single process: no EP all-reduce); the fast gate's host hook does the same."""
    groups = importlib.import_module("deepspeed.utils.groups")
    mpu = type("Mpu", (), {"get_tensor_model_parallel_world_size": staticmethod(lambda: 4)})()
    monkeypatch.setattr(groups, "mpu", mpu)
    for k in (1, 2):
        gate = sm.TopKGate(8, 5, k=k, drop_tokens=False, min_capacity=0)
        x = torch.randn(37, 8)
        a, b = gate_run(gate, x, None, fast=False), gate_run(gate, x, None, fast=True)
        assert_same_routing(a, b)
        assert b[0].capacity % 4 == 0


def test_gate_settings_it_does_not_reproduce_fall_back_with_one_log_line(caplog):
    noted = set()                                                      # the swapped layer's
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    k3 = sm.TopKGate(8, 6, k=3)
    float_used = sm.TopKGate(8, 6, k=1)
    hooked = sm.TopKGate(8, 6, k=2)
    hooked.register_forward_hook(lambda *a: None)
    cases = [(k3, None, "k \\(3\\) > 2"), (float_used, torch.ones(16), "used_token is torch.float32"),
             (hooked, None, "forward hooks")]
    with caplog.at_level(logging.INFO, logger="moe_plugins.deepspeed"):
        for gate, used_token, reason in cases:
            assert layer.fast_gate_refusal(gate, used_token) is not None
            for _ in range(2):                                         # logged once per reason
                torch.manual_seed(3)
                r = layer.gate_router(gate, used_token, x, noted=noted)
                torch.manual_seed(3)
                stock = layer.routing_from_gate(gate(x, used_token, True, False))
                assert torch.equal(r.slot_SK, stock.slot_SK) and torch.equal(r.weight_SK, stock.weight_SK)
    lines = [rec.getMessage() for rec in caplog.records if "DeepSpeed's own gate function" in rec.getMessage()]
    assert len(lines) == 3
    for (_, _, reason), line in zip(cases, lines):
        assert re.search(reason, line)
