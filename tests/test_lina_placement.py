"""Lina inference, phase one and two placement (moe_plugins/lina/placement.py): pure properties with hypothesis,
the documented tie-breaks on hand-made loads, and bad input named."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_plugins.lina.placement import phase_two, plan_placement, split_tokens
from moe_plugins.lina.popularity import top_matches, top_set

LOAD = st.one_of(st.integers(0, 1000), st.floats(0, 1e4, allow_nan=False, allow_infinity=False))


@st.composite
def problems(draw):
    n_dev = draw(st.integers(1, 10))
    cap = draw(st.integers(1, 4))
    n_exp = draw(st.integers(1, min(12, n_dev * cap)))
    loads = draw(st.lists(LOAD, min_size=n_exp, max_size=n_exp))
    return loads, n_dev, cap


@settings(max_examples=400, deadline=None)
@given(problems())
def test_placement_covers_every_expert_within_the_device_limits(problem):
    loads, n_dev, cap = problem
    p = plan_placement(loads, n_dev, max_experts_per_device=cap)
    assert len(set(p.assignments)) == len(p.assignments)
    assert all(0 <= d < n_dev for _, d in p.assignments)
    assert all(r >= 1 for r in p.replica_counts)                    # every expert somewhere
    assert all(len(p.experts_on(d)) <= cap for d in range(n_dev))
    assert p == plan_placement(list(loads), n_dev, max_experts_per_device=cap)      # deterministic
    assert p == plan_placement(tuple(loads), n_dev, max_experts_per_device=cap)


@settings(max_examples=400, deadline=None)
@given(problems())
def test_replicas_are_proportional_to_the_share_within_rounding(problem):
    loads, n_dev, cap = problem
    p = plan_placement(loads, n_dev, max_experts_per_device=cap)
    total = sum(loads)
    for e, r in enumerate(p.replica_counts):
        s = n_dev * loads[e] / total if total > 0 else 0.0
        assert math.isclose(p.shares[e], s)
        assert r <= max(1, math.ceil(s - 1e-9)), (e, s, r)       # never more devices than the expert is worth
        if p.trimmed == 0:                                      # nothing had to make room for the packed ones
            assert r >= math.floor(s), (e, s, r)


@settings(max_examples=300, deadline=None)
@given(problems(), st.data())
def test_splits_spread_each_experts_tokens_evenly_and_sum_to_the_counts(problem, data):
    loads, n_dev, cap = problem
    p = plan_placement(loads, n_dev, max_experts_per_device=cap)
    sources = data.draw(st.integers(1, 5))
    counts = data.draw(st.lists(st.lists(st.integers(0, 40), min_size=len(loads), max_size=len(loads)),
                                min_size=sources, max_size=sources))
    s = split_tokens(p, counts)
    for r, row in enumerate(counts):
        assert sum(s.send_RD[r]) == sum(row)
        assert all(n > 0 for _, _, n in s.pieces[r])
        assert list(s.pieces[r]) == sorted(s.pieces[r])                     # send order: device, then expert
        for e in range(len(loads)):
            assert sum(n for _, x, n in s.pieces[r] if x == e) == row[e]
    for e in range(len(loads)):
        got = [s.recv_DE[d][e] for d in p.replicas(e)]
        assert sum(got) == sum(row[e] for row in counts)
        assert max(got) - min(got) <= 1
        assert all(s.recv_DE[d][e] == 0 for d in range(n_dev) if d not in p.replicas(e))
    assert s == split_tokens(p, counts)


def test_popular_expert_replicated_and_the_rest_first_fit_decreasing():
    p = plan_placement([10, 1, 1, 0], 4)                 # shares 3.33, .33, .33, 0
    assert p.replica_counts == (3, 1, 1, 1)
    assert p.assignments == ((0, 0), (0, 1), (0, 2), (1, 3), (2, 3), (3, 3))
    assert p.trimmed == 0


def test_overfull_packing_goes_to_the_least_loaded_device():
    p = plan_placement([1.0, 0.6, 0.7, 0.7], 3)          # three items of < 1 device on two devices
    assert p.assignments == ((0, 0), (1, 1), (2, 1), (3, 2))   # 0.7 | 0.7 | 0.6 joins the first (tie) of 0.7


def test_left_over_devices_become_replicas_of_the_busiest_per_replica():
    p = plan_placement([5, 5, 1, 1], 4)                  # shares 1.67, 1.67, .33, .33: 1 + 1 + one packed
    assert p.replica_counts == (2, 1, 1, 1)              # the left-over device: a tie, the lower id wins
    assert p.assignments == ((0, 0), (0, 3), (1, 1), (2, 2), (3, 2))


def test_room_for_the_packed_experts_is_taken_from_the_most_replicated():
    p = plan_placement([100] + [0] * 7, 8)               # expert 0 worth 8 devices; 7 others need 2 (4 each)
    assert p.replica_counts[0] == 6 and p.trimmed == 2
    assert sorted(len(p.experts_on(d)) for d in range(8)) == [1, 1, 1, 1, 1, 1, 3, 4]


def test_nothing_estimated_spreads_the_experts_over_every_device():
    p = plan_placement([0, 0, 0, 0, 0], 4)
    assert sorted(len(p.experts_on(d)) for d in range(4)) == [1, 1, 1, 2]


def test_splits_fill_replicas_in_rank_then_device_order():
    p = plan_placement([10, 1, 1, 0], 4)                 # expert 0 on devices 0, 1, 2
    s = split_tokens(p, [[4, 1, 0, 0], [3, 0, 1, 1]])    # expert 0: 7 tokens -> 3, 2, 2
    assert s.pieces[0] == ((0, 0, 3), (1, 0, 1), (3, 1, 1))
    assert s.pieces[1] == ((1, 0, 1), (2, 0, 2), (3, 2, 1), (3, 3, 1))
    assert s.send_RD == ((3, 1, 0, 1), (0, 1, 2, 2))


def test_phase_two_keeps_phase_one_when_the_top_set_holds():
    one = plan_placement([10, 8, 1, 1], 4)
    kept = phase_two(one, [50, 60, 3, 0])                # top-2 {0, 1} both ways
    assert not kept.reallocate and kept.placement is one and kept.actual_top == frozenset({0, 1})
    assert not phase_two(one, [0, 60, 0, 0]).reallocate   # one busy expert, in the estimate's top-2: kept
    assert phase_two(one, [0, 0, 60, 0]).reallocate       # one busy expert outside it: re-planned
    moved = phase_two(one, [50, 2, 60, 0])               # actual top-2 {0, 2}
    assert moved.reallocate and moved.placement == plan_placement([50, 2, 60, 0], 4)
    assert moved.estimated_top == frozenset({0, 1}) and moved.actual_top == frozenset({0, 2})


@settings(max_examples=200, deadline=None)
@given(problems(), st.data())
def test_phase_two_replans_exactly_when_the_top_sets_differ(problem, data):
    loads, n_dev, cap = problem
    one = plan_placement(loads, n_dev, max_experts_per_device=cap)
    actual = data.draw(st.lists(st.integers(0, 50), min_size=len(loads), max_size=len(loads)))
    top = data.draw(st.integers(1, 3))
    two = phase_two(one, actual, top=top)
    assert two.reallocate == (not top_matches(loads, actual, top))
    assert two.placement == (plan_placement(actual, n_dev, max_experts_per_device=cap) if two.reallocate else one)


@pytest.mark.parametrize("call,message", [
    (lambda: plan_placement([1] * 9, 2), "9 experts do not fit on num_devices (2) x max_experts_per_device (4)"),
    (lambda: plan_placement([1, -1], 2), "loads[1] = -1"),
    (lambda: plan_placement([1, float("nan")], 2), "loads[1] = nan"),
    (lambda: plan_placement([1, 2], 0), "num_devices (0) must be an integer >= 1"),
    (lambda: plan_placement([1, 2], 2, max_experts_per_device=0), "max_experts_per_device (0) must be"),
    (lambda: split_tokens(plan_placement([1, 2], 2), [[1, 2, 3]]), "counts[0] ([1, 2, 3]) must be 2 token counts"),
    (lambda: phase_two(plan_placement([1, 2], 2), [1]), "actual counts ([1]) must be 2 token counts"),
])
def test_bad_input_names_the_field_and_value(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_bad_loads_are_all_listed_at_once():
    with pytest.raises(ValueError) as info:
        plan_placement([-1, 2, float("inf")], 0, max_experts_per_device=0)
    text = str(info.value)
    for part in ("num_devices (0)", "max_experts_per_device (0)", "loads[0] = -1", "loads[2] = inf"):
        assert part in text
