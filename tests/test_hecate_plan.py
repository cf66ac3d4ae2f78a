"""Hecate's plan (moe_plugins/hecate/plan.py), pure: hand-worked cases, hypothesis properties, and brute force
where the rule is an optimisation (slots by load: the smallest largest per-copy load; route split: the fewest
inter-node routes, then the smallest largest share). The all-reduce of the loads runs on 4 ranks in
tests/test_hecate_sparse.py (one pool)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import Group
from moe_plugins.hecate.plan import (Budget, LoadWindow, Placement, assign_slots, dispatch_counts, global_load,
                                     materialise_budget, overlap_degree, place_copies, plan_placement, rank_nodes,
                                     split_routes, stock_homes, top_experts)

import torch

NODES_4 = (0, 0, 1, 1)          # 2 nodes x 2 ranks


# ---- load window -------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1000), min_size=3, max_size=3), min_size=0, max_size=12),
       st.integers(1, 6))
def test_window_mean_is_the_mean_of_the_last_width_iterations(rows, width):
    window = LoadWindow(num_experts=3, width=width)
    for row in rows:
        window = window.push(row)
    assert len(window.loads_WE) == min(len(rows), width)
    expected = np.mean(np.array(rows[-width:]), axis=0) if rows else np.zeros(3)
    assert np.allclose(window.mean(), expected, rtol=0, atol=1e-12)


def test_window_is_immutable_and_defaults_to_five():
    empty = LoadWindow(num_experts=2)
    one = empty.push([4, 0])
    assert empty.loads_WE == () and one.loads_WE == ((4, 0),) and empty.width == 5
    w = empty
    for i in range(7):
        w = w.push([i, 10 * i])
    assert w.mean() == ((2 + 3 + 4 + 5 + 6) / 5, (20 + 30 + 40 + 50 + 60) / 5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=0), r"num_experts \(0\) must be an integer >= 1"),
    (dict(num_experts=2, width=0), r"width \(0\) must be an integer >= 1"),
    (dict(num_experts=2, width=1, loads_WE=((1, 2), (3, 4))), r"more than width \(1\)"),
    (dict(num_experts=2, loads_WE=((1, -2),)), r"loads_WE\[0\] \(\[1, -2\]\) must be 2 integers >= 0"),
])
def test_window_refuses_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoadWindow(**kwargs)


def test_window_push_refuses_a_wrong_length():
    with pytest.raises(ValueError, match=r"load_E \(\[1, 2, 3\]\) must be 2 integers >= 0"):
        LoadWindow(num_experts=2).push([1, 2, 3])


def test_global_load_on_a_group_of_one_reads_the_counts_and_records_nothing():
    from moe_plugins.core.ledger import CommLedger
    ledger = CommLedger()
    solo = Group(kind="ep", ranks=(0,), pg=None, rank=0, remote_peers=0)
    assert global_load(torch.tensor([3, 0, 5]), solo, Recorder(ledger=ledger, layer="h")) == (3, 0, 5)
    assert ledger.records == []
    with pytest.raises(ValueError, match=r"load_E must be 1-d"):
        global_load(torch.zeros(2, 2), solo, Recorder(ledger=ledger, layer="h"))


# ---- budget ------------------------------------------------------------------------------------------------

def test_overlap_degree_hand_worked():
    # 10 ms of attention at 1 GB/s moves 1e7 bytes: two 4 MiB experts (2.38), three 3 MB ones (3.33)
    assert overlap_degree(0.01, 1e9, 4 * 2**20) == 2
    assert overlap_degree(0.01, 1e9, 3_000_000) == 3
    assert overlap_degree(0.0, 1e9, 1) == 0


@pytest.mark.parametrize("args, match", [
    ((-1.0, 1e9, 10), r"non_moe_s \(-1.0\) must be a finite number of seconds >= 0"),
    ((0.1, 0, 10), r"bandwidth_bytes_per_s \(0\) must be a finite number > 0"),
    ((0.1, 1e9, 0), r"expert_bytes \(0\) must be an integer >= 1"),
])
def test_overlap_degree_refuses_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        overlap_degree(*args)


def test_budget_is_algorithm_1_line_1():
    assert materialise_budget(10, 3, 8) == Budget(t=8, m=3)          # t capped at E
    assert not materialise_budget(10, 3, 8).everywhere
    assert materialise_budget(2, 5, 8) == Budget(t=2, m=2)           # m capped at t: top-2 everywhere
    assert materialise_budget(2, 5, 8).everywhere
    assert materialise_budget(0, 4, 8) == Budget(t=0, m=0)
    with pytest.raises(ValueError, match=r"extra_experts \(-1\) must be an integer >= 0"):
        materialise_budget(3, -1, 8)


# ---- slots by load (an optimisation: brute force) ----------------------------------------------------------

def _worst(load, extra):
    return max((f / (1 + x) for f, x in zip(load, extra)), default=0.0)


def test_assign_slots_hand_worked():
    # 6/1 -> e0; 3 (e0: 6/2) ties 3 (e1) -> e0 (lower); then e1: 3/1 > 6/3 = 2 -> e1
    assert assign_slots([6, 3, 1], 3, [9, 9, 9]) == (2, 1, 0)
    # e0 capped at one extra copy: then e1 (3/1), then e1 again (3/2 = 1.5 > e2's 1)
    assert assign_slots([6, 3, 1], 3, [1, 9, 9]) == (1, 2, 0)
    assert assign_slots([6, 3], 5, [1, 1]) == (1, 1)                # caps run out first


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=4), st.integers(0, 6), st.data())
def test_assign_slots_minimises_the_largest_per_copy_load(load, slots, data):
    caps = data.draw(st.lists(st.integers(0, 3), min_size=len(load), max_size=len(load)))
    got = assign_slots(load, slots, caps)
    assert sum(got) == min(slots, sum(caps)) and all(0 <= g <= c for g, c in zip(got, caps))
    best = min(_worst(load, x) for x in itertools.product(*[range(c + 1) for c in caps]) if sum(x) <= slots)
    assert _worst(load, got) == pytest.approx(best, abs=1e-12)


# ---- placement -------------------------------------------------------------------------------------------

def test_rank_nodes_and_stock_homes():
    assert rank_nodes(4, 2) == NODES_4 and rank_nodes(6, 3) == (0, 0, 0, 1, 1, 1)
    assert stock_homes(8, 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    with pytest.raises(ValueError, match=r"world \(4\) must be divisible by ranks_per_node \(3\)"):
        rank_nodes(4, 3)
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be a positive multiple of num_ranks \(4\)"):
        stock_homes(6, 4)


def test_place_copies_goes_to_other_nodes_first():
    free = [1, 1, 1, 1]
    # expert held on rank 0 (node 0): the first copy goes to node 1 (no copy there; ranks 2 and 3 equal: the
    # lower); then each node holds one and has one free slot: the lower node, rank 1
    assert place_copies([0], 2, free, NODES_4) == ((1, 2), (1, 0, 0, 1))
    assert free == [1, 1, 1, 1]                                            # the caller's list is left alone
    # nodes tied in copies: the one with more free slots wins
    assert place_copies([0, 2], 1, [0, 1, 0, 3], NODES_4) == ((3,), (0, 1, 0, 2))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([(4, 2), (6, 3), (8, 2), (8, 4), (6, 2)]), st.integers(0, 7), st.data())
def test_place_copies_spreads_over_nodes_when_slots_allow(topology, count, data):
    ranks, rpn = topology
    nodes = rank_nodes(ranks, rpn)
    home = data.draw(st.integers(0, ranks - 1))
    added, _ = place_copies([home], count, [count + 1] * ranks, nodes)
    assert len(added) == min(count, ranks - 1) and home not in added
    per_node = [sum(nodes[r] == n for r in (home,) + added) for n in range(ranks // rpn)]
    assert max(per_node) - min(per_node) <= 1


def test_place_copies_drops_what_no_rank_can_hold():
    assert place_copies([1], 3, [1, 0, 0, 0], NODES_4) == ((0,), (0, 0, 0, 0))
    assert place_copies([1], 3, [5, 5, 5, 5], NODES_4) == ((0, 2, 3), (4, 5, 4, 4))
    with pytest.raises(ValueError, match=r"free_R \(\[1, 1\]\) must be 4 counts >= 0"):
        place_copies([1], 1, [1, 1], NODES_4)


def test_plan_hand_worked_both_branches():
    homes, load = stock_homes(8, 4), [100, 10, 50, 5, 5, 5, 30, 1]
    assert top_experts(load, 3) == (0, 2, 6)
    # t = 2 <= m: the top-2 experts (0 and 2) everywhere
    everywhere = plan_placement(load, homes, NODES_4, Budget(t=2, m=2))
    assert everywhere.copies_E == ((0, 1, 2, 3), (0,), (0, 1, 2, 3), (1,), (2,), (2,), (3,), (3,))
    # t = 3 > m = 1: 4 slots over experts 0, 2, 6 by load: 0 gets 3 (100, 50, 33.3 per copy), 2 gets 1.
    # expert 0 (home 0) -> ranks 2 (node 1), 1 (node 0's free), 3; expert 2 (home 1) -> rank 0, the only free one
    sparse = plan_placement(load, homes, NODES_4, Budget(t=3, m=1))
    assert sparse.copies_E == ((0, 1, 2, 3), (0,), (0, 1), (1,), (2,), (2,), (3,), (3,))
    assert sparse.experts_on(0) == (0, 1, 2) and sparse.experts_on(3) == (0, 6, 7)


@settings(max_examples=120, deadline=None)
@given(st.sampled_from([(4, 2), (4, 1), (4, 4), (6, 3), (8, 2)]), st.integers(1, 3), st.integers(0, 6),
       st.integers(0, 6), st.data())
def test_plan_properties(topology, per_rank, t, m, data):
    ranks, rpn = topology
    num_experts = ranks * per_rank
    load = data.draw(st.lists(st.integers(0, 100), min_size=num_experts, max_size=num_experts))
    homes, nodes = stock_homes(num_experts, ranks), rank_nodes(ranks, rpn)
    budget = materialise_budget(t, m, num_experts)
    plan = plan_placement(load, homes, nodes, budget)
    assert plan == plan_placement(load, homes, nodes, budget)                      # deterministic
    top = set(top_experts(load, budget.t))
    for e, copies in enumerate(plan.copies_E):
        assert homes[e] in copies                                                  # P' contains P
        assert len(copies) == 1 or e in top                                        # only the top-t are copied
    extra_R = [len(plan.experts_on(r)) - sum(h == r for h in homes) for r in range(ranks)]
    assert max(extra_R) <= budget.t
    if budget.everywhere:
        assert all(len(plan.copies_E[e]) == ranks for e in top)
    else:
        assert max(extra_R) <= budget.m


def test_plan_refuses_bad_homes_and_placements():
    with pytest.raises(ValueError, match=r"homes_E \(\[0, 7\]\) must be one rank in \[0, 4\)"):
        plan_placement([1, 1], [0, 7], NODES_4, Budget(t=1, m=1))
    with pytest.raises(ValueError, match=r"copies_E\[1\] \(\[2, 1\]\) must be distinct sorted ranks"):
        Placement(copies_E=((0,), (2, 1)), nodes_R=NODES_4)


# ---- dispatch (an optimisation: brute force) ----------------------------------------------------------------

def test_split_routes_hand_worked():
    assert split_routes(7, 2, (0, 2, 3), NODES_4) == ((2, 7),)              # own copy: all local
    assert split_routes(7, 3, (0, 1, 2), NODES_4) == ((2, 7),)              # the one copy on its node
    assert split_routes(7, 0, (1, 2, 3), NODES_4) == ((1, 7),)
    # no copy on node 1 for source 3: evenly over ranks 0 and 1; 7 = 3 + 4, the extra at copy 3 % 2 = 1
    assert split_routes(7, 3, (0, 1), NODES_4) == ((0, 3), (1, 4))
    assert split_routes(7, 2, (0, 1), NODES_4) == ((0, 4), (1, 3))          # source 2: extra at copy 0
    assert split_routes(0, 2, (), NODES_4) == ()
    with pytest.raises(ValueError, match=r"copies \(\[\]\) not empty when routes > 0"):
        split_routes(3, 0, (), NODES_4)


def _compositions(total, parts):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first,) + rest


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 9), st.integers(0, 3), st.sets(st.integers(0, 3), min_size=1))
def test_split_routes_is_the_best_split(routes, source, copy_set):
    copies = tuple(sorted(copy_set))
    got = dict(split_routes(routes, source, copies, NODES_4))
    shares = tuple(got.get(r, 0) for r in copies)
    assert sum(shares) == routes

    def cost(split):   # routes leaving the rank, then leaving the node, then the largest share
        off_rank = sum(n for r, n in zip(copies, split) if r != source)
        off_node = sum(n for r, n in zip(copies, split) if NODES_4[r] != NODES_4[source])
        return (off_node, off_rank, max(split))

    assert cost(shares) == min(cost(s) for s in _compositions(routes, len(copies)))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=4, max_size=4), st.data())
def test_dispatch_counts_conserve_routes_and_spread_remainders_over_sources(routes, data):
    copies = tuple(tuple(sorted(data.draw(st.sets(st.integers(0, 3), min_size=1)))) for _ in range(4))
    placement = Placement(copies_E=copies, nodes_R=NODES_4)
    for source in range(4):
        send_ER = dispatch_counts(routes, source, placement)
        for e, row in enumerate(send_ER):
            assert sum(row) == routes[e]
            assert all(n == 0 for r, n in enumerate(row) if r not in copies[e])
    # sources that split the same routes over the same copies put their remainders on different copies: the
    # two sources of node 1, whose routes to an expert held on ranks 0 and 1 only go evenly to both, together
    # send those copies routes that differ by at most one
    held_01 = Placement(copies_E=((0, 1),) * 4, nodes_R=NODES_4)
    together = np.add(dispatch_counts(routes, 2, held_01), dispatch_counts(routes, 3, held_01))
    assert np.all(np.abs(together[:, 0] - together[:, 1]) <= 1)
    with pytest.raises(ValueError, match=r"routes_E has 3 experts, the placement 4"):
        dispatch_counts(routes[:3], 0, placement)
