"""Gating and dispatch: pure functions against naive per-token loops, plus hypothesis properties."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moe_plugins.core.dispatch import combine, dispatch
from moe_plugins.core.gating import apply_capacity, assign_topk, capacity, route


def naive_route(logits, k, cap):
    """GShard order written as plain loops: route j of all tokens after route j-1 of all tokens."""
    gates = torch.softmax(logits, 1)
    S, E = gates.shape
    experts = [sorted(range(E), key=lambda e: -float(gates[s, e]))[:k] for s in range(S)]
    fill = [0] * E
    slots = [[None] * k for _ in range(S)]
    for j in range(k):
        for s in range(S):
            e = experts[s][j]
            slots[s][j] = fill[e] if fill[e] < cap else -1
            fill[e] += 1
    weights = []
    for s in range(S):
        raw = [float(gates[s, experts[s][j]]) if slots[s][j] >= 0 else 0.0 for j in range(k)]
        if k > 1:
            total = max(sum(raw), torch.finfo(gates.dtype).eps)
            raw = [w / total for w in raw]
        weights.append(raw)
    first = torch.zeros(E, dtype=gates.dtype)
    for s in range(S):
        first[experts[s][0]] += 1
    aux = float((gates.mean(0) * first / S).sum() * E)
    return experts, slots, weights, fill, aux


@settings(max_examples=60, deadline=None)
@given(S=st.integers(1, 24), E=st.integers(1, 6), k=st.integers(1, 2), f=st.sampled_from([0.25, 0.5, 1.0, 2.0]),
       seed=st.integers(0, 10_000))
def test_routing_matches_naive_loops(S, E, k, f, seed):
    k = min(k, E)
    logits = torch.randn(S, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    cap = capacity(S, E, k, f, 0)
    r = apply_capacity(assign_topk(logits, k), cap)
    experts, slots, weights, counts, aux = naive_route(logits, k, cap)
    assert r.expert_SK.tolist() == experts
    assert r.slot_SK.tolist() == slots
    assert torch.allclose(r.weight_SK, torch.tensor(weights, dtype=torch.float64), atol=1e-15)
    assert r.exp_counts_E.tolist() == counts
    assert math.isclose(float(r.aux_loss), aux, rel_tol=1e-12)
    # properties: no slot used twice, every kept slot inside capacity, drops exactly the overflow
    kept = [(e, s) for es, ss in zip(experts, slots) for e, s in zip(es, ss) if s >= 0]
    assert len(set(kept)) == len(kept) and all(0 <= s < cap for _, s in kept)
    assert r.dropped == sum(max(0, c - cap) for c in counts)


def test_capacity_rule():
    assert capacity(16, 4, 1, 1.0, 0) == 4       # T = k f B L / E
    assert capacity(16, 4, 2, 1.0, 0) == 8
    assert capacity(10, 4, 1, 1.0, 0) == 3       # ceil
    assert capacity(4, 8, 1, 1.0, 4) == 4        # min_capacity
    with pytest.raises(ValueError, match=r"num_tokens \(0\)"):
        capacity(0, 4, 1, 1.0, 0)


def test_dropless_capacity_must_cover_counts():
    x = torch.randn(8, 4, dtype=torch.float64)
    wg = torch.randn(3, 4, dtype=torch.float64)
    r = route(x, wg, k=1, capacity_factor=1.0, min_capacity=0, drop_tokens=False)
    assert r.dropped == 0 and r.capacity == int(r.exp_counts_E.max())
    with pytest.raises(ValueError, match="below the largest expert count"):
        route(x, wg, k=1, capacity_factor=1.0, min_capacity=0, drop_tokens=False, dropless_capacity=0)


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 20), E=st.integers(1, 5), k=st.integers(1, 2), f=st.sampled_from([0.5, 1.0, 1.5]),
       extra=st.integers(0, 3), seed=st.integers(0, 10_000))
def test_dispatch_combine_equal_dense_einsum(S, E, k, f, extra, seed):
    """The index-based dispatch/combine equal GShard's dense one-hot einsums, also with padded slots."""
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, 3, generator=g, dtype=torch.float64)
    r = apply_capacity(assign_topk(torch.randn(S, E, generator=g, dtype=torch.float64), k), capacity(S, E, k, f, 0))
    slots = r.capacity + extra
    mask_SEC = torch.zeros(S, E, slots, dtype=torch.float64)
    comb_SEC = torch.zeros(S, E, slots, dtype=torch.float64)
    for s in range(S):
        for j in range(k):
            if r.slot_SK[s, j] >= 0:
                mask_SEC[s, r.expert_SK[s, j], r.slot_SK[s, j]] = 1
                comb_SEC[s, r.expert_SK[s, j], r.slot_SK[s, j]] = r.weight_SK[s, j]
    d = dispatch(x, r, E, slots)
    assert torch.equal(d, torch.einsum("sec,sm->ecm", mask_SEC, x))
    y = torch.randn(E, slots, 3, generator=g, dtype=torch.float64)
    assert torch.allclose(combine(y, r), torch.einsum("sec,ecm->sm", comb_SEC, y), atol=1e-14)
