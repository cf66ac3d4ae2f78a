"""Hecate's SparseAllGather / SparseReduceScatter (moe_plugins/hecate/sparse.py).

In one process: every rank's exchange plan simulated together (each rank's copies are the experts' full
parameters, and spRS is spAG's adjoint: <spAG(w), g> = <w, spRS(g)>), a group of one, bad input.
On 4 gloo ranks (2 nodes x 2) in fp64: the copies equal the planned experts' full parameters bitwise, each
owner's shard gradient equals the sum of all copies' gradients (integer-valued, so exact), the ledger records
one ``spag`` (forward) and one ``sprs`` (backward) per rank with the bytes of :func:`sparse_bytes`, and in the
paper's setting (owners among the copies) the bytes sum to the paper's Eq. 2 volume times the copies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import Group
from moe_plugins.core.ledger import CommLedger
from moe_plugins.hecate.plan import Budget, Placement, plan_placement, stock_homes
from moe_plugins.hecate.sparse import (ShardSpec, eq2_bytes, even_shards, sparse_all_gather, sparse_bytes,
                                       sparse_exchange, whole_shards)
from tests.workers.hecate_sparse import NODES, SparseCase, loads_summed, spag_and_sprs

RANKS = len(NODES)
F = 10                          # not a multiple of 4: uneven shards (3, 3, 2, 2)
HOMES = stock_homes(8, RANKS)


def _planned(load, budget):
    return plan_placement(load, HOMES, NODES, budget).copies_E


CASES = [
    SparseCase("plan-everywhere", _planned([9, 1, 7, 1, 1, 1, 1, 1], Budget(t=2, m=2)), F, seed=1),
    SparseCase("plan-sparse", _planned([90, 10, 50, 5, 5, 5, 30, 1], Budget(t=3, m=1)), F, seed=2),
    # some experts with no copy at all, one on every rank; then rank 3 copies nothing
    SparseCase("uneven", ((), (0, 1, 2, 3), (1,), (), (0, 2), (), (), (2,)), F, seed=3),
    SparseCase("idle-rank", ((), (0, 1, 2), (1,), (), (0, 2), (), (), (2,)), F, seed=7),
    SparseCase("nothing", ((),) * 8, F, seed=4),
    SparseCase("whole-plan", _planned([90, 10, 50, 5, 5, 5, 30, 1], Budget(t=3, m=1)), F, "whole", HOMES, seed=5),
    # owners outside their copies: expert 0 (home 0) only on rank 3, expert 5 (home 2) on ranks 0 and 1
    SparseCase("whole-away", ((3,), (0,), (1,), (1, 2), (2,), (0, 1), (3,), (3,)), 7, "whole", HOMES, seed=6),
]


def _reference_grad(case: SparseCase, rank: int) -> torch.Tensor:
    """The owned buffer's gradient, single process: every copy's gradient summed per expert, then cut."""
    placement, grad_EF = case.placement(), torch.zeros(len(case.copies_E), case.numel, dtype=torch.float64)
    for r in range(RANKS):
        for row, e in enumerate(placement.experts_on(r)):
            grad_EF[e] += case.grad_CF(r)[row]
    return case.shard_spec().shard(grad_EF, rank)


@pytest.fixture(scope="module")
def results(world):
    return world(RANKS).run(spag_and_sprs, CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_copies_and_owner_gradients_on_4_ranks(results, index):
    case = CASES[index]
    placement, full_EF = case.placement(), case.full_EF()
    made = 0
    for rank, per_case in enumerate(results):
        got = per_case[index]
        assert got["rank"] == rank
        experts = list(placement.experts_on(rank))
        assert got["copies"].shape == (len(experts), case.numel)
        assert torch.equal(got["copies"], full_EF[experts]), (case.name, rank)
        assert torch.equal(got["grad"], _reference_grad(case, rank)), (case.name, rank)
        made += len(experts)
    assert made == sum(len(c) for c in case.copies_E)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_ledger_bytes_are_the_volume(results, index):
    case = CASES[index]
    placement, shards = case.placement(), case.shard_spec()
    for rank, per_case in enumerate(results):
        records = per_case[index]["records"]
        assert [(op, phase, group) for op, phase, group, _, _ in records] == [("spag", "forward", "ep"),
                                                                              ("sprs", "backward", "ep")]
        expect = sparse_bytes(placement, shards, rank, elsize=8)
        (_, _, _, spag, spag_x), (_, _, _, sprs, sprs_x) = records
        assert (spag, spag_x) == (expect.sent, expect.sent_inter_node), (case.name, rank)
        assert (sprs, sprs_x) == (expect.received, expect.received_inter_node), (case.name, rank)


def test_a_rank_that_copies_nothing_receives_nothing(results):
    index = [c.name for c in CASES].index("idle-rank")
    case = CASES[index]
    assert case.placement().experts_on(3) == ()
    ex = sparse_exchange(case.placement(), case.shard_spec(), 3)
    assert ex.recv == (0, 0, 0, 0) and ex.copy_pieces == ()
    # it sends its shard (2 of each expert's 10 elements) once per copy: rank 0 copies experts 1 and 4, rank 1
    # experts 1 and 2, rank 2 experts 1, 4 and 7
    assert ex.send == (2 * 2, 2 * 2, 2 * 3, 0)
    _, _, _, sprs, _ = results[3][index]["records"][1]
    assert sprs == 0                                   # spRS sends back what spAG brought: nothing
    nothing = CASES[[c.name for c in CASES].index("nothing")]
    assert all(r[CASES.index(nothing)]["records"][0][3] == 0 for r in results)


def test_paper_setting_moves_eq2_times_the_copies(results):
    """Owners among their copies (the paper's P subset of P'): spAG + spRS move 2 (c - 1) B per expert, the ring
    AllReduce of Eq. 2 summed over its c members; with even shards, only experts copied on every rank do (the
    FSDP limit: all-gather + reduce-scatter = all-reduce)."""
    index = [c.name for c in CASES].index("whole-plan")
    case = CASES[index]
    expert_bytes = case.numel * 8
    total = sum(spag + sprs for per_case in results for (_, _, _, spag, _), (_, _, _, sprs, _) in
                [per_case[index]["records"]])
    copies = [len(c) for c in case.copies_E]
    assert any(c > 1 for c in copies)
    assert total == pytest.approx(sum(c * eq2_bytes([c], expert_bytes) for c in copies), abs=1e-9)
    everywhere = CASES[0]
    full = [e for e, c in enumerate(everywhere.copies_E) if len(c) == RANKS]
    assert full
    moved = sum(sparse_bytes(Placement(copies_E=tuple(c if e in full else () for e, c in
                                                      enumerate(everywhere.copies_E)), nodes_R=NODES),
                             everywhere.shard_spec(), r, 8).sent for r in range(RANKS))
    assert 2 * moved == pytest.approx(RANKS * eq2_bytes([RANKS] * len(full), everywhere.numel * 8), abs=1e-9)


def test_global_load_sums_over_the_group(world):
    per_rank = world(RANKS).run(loads_summed, 3)
    expected = tuple(sum(r * 10 + e for r in range(RANKS)) for e in range(3))
    for total, records in per_rank:
        assert total == expected
        assert records == [("all_reduce", 3 * 8)]


# ---- in one process ------------------------------------------------------------------------------------------

def _simulate(placement: Placement, shards: ShardSpec, owned_R, grads_R):
    """Every rank's spAG and spRS run together in one process from the exchange plans alone: (copies per rank,
    owned-buffer gradients per rank)."""
    plans = [sparse_exchange(placement, shards, r) for r in range(RANKS)]

    def take(buffers, pieces):
        return torch.cat([buffers[b][s:s + n] for b, s, n in pieces]) if pieces else torch.zeros(0, dtype=torch.float64)

    sends = [take([owned_R[r]], [(0, s, n) for s, n in plans[r].send_pieces]) for r in range(RANKS)]
    parts = [list(torch.split(sends[r], list(plans[r].send))) for r in range(RANKS)]
    recvs = [torch.cat([parts[s][r] for s in range(RANKS)]) for r in range(RANKS)]
    for r in range(RANKS):
        assert [parts[s][r].numel() for s in range(RANKS)] == list(plans[r].recv)
    copies = [take([recvs[r], owned_R[r]], plans[r].copy_pieces).view(-1, shards.numel) for r in range(RANKS)]
    owned_grads = []
    for r in range(RANKS):                     # the adjoint, written out: each copy's piece back to its owner
        g = torch.zeros_like(owned_R[r])
        for dst in range(RANKS):
            pieces = [p for p in plans[dst].copy_pieces]
            flat, at = grads_R[dst].reshape(-1), 0
            for e in placement.experts_on(dst):
                for src in range(RANKS):
                    n = shards.sizes_ER[e][src]
                    if src == r and n:
                        g[shards.own_start(e, r):shards.own_start(e, r) + n] += flat[at:at + n]
                    at += n
            assert at == sum(n for _, _, n in pieces)
        owned_grads.append(g)
    return copies, owned_grads


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.integers(0, RANKS - 1)), min_size=1, max_size=5), st.integers(1, 9),
       st.booleans(), st.data())
def test_exchange_plans_agree_across_ranks(copy_sets, numel, even, data):
    placement = Placement(copies_E=tuple(tuple(sorted(c)) for c in copy_sets), nodes_R=NODES)
    homes = data.draw(st.lists(st.integers(0, RANKS - 1), min_size=len(copy_sets), max_size=len(copy_sets)))
    shards = even_shards(numel, len(copy_sets), RANKS) if even else whole_shards(numel, homes, RANKS)
    full_EF = torch.randn(len(copy_sets), numel, dtype=torch.float64)
    owned = [shards.shard(full_EF, r) for r in range(RANKS)]
    grads = [torch.randn(len(placement.experts_on(r)), numel, dtype=torch.float64) for r in range(RANKS)]
    copies, owned_grads = _simulate(placement, shards, owned, grads)
    for r in range(RANKS):
        assert torch.equal(copies[r], full_EF[list(placement.experts_on(r))])
    # adjoint: <spAG(w), g> == <w, spRS(g)> summed over ranks
    lhs = sum(float((c * g).sum()) for c, g in zip(copies, grads))
    rhs = sum(float((w * g).sum()) for w, g in zip(owned, owned_grads))
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)


def test_a_group_of_one_copies_locally_and_records_nothing():
    ledger = CommLedger()
    solo = Group(kind="ep", ranks=(0,), pg=None, rank=0, remote_peers=0, nodes=(0,))
    placement = Placement(copies_E=((0,), (), (0,)), nodes_R=(0,))
    shards = even_shards(5, 3, 1)
    full_EF = torch.randn(3, 5, dtype=torch.float64)
    w = full_EF.reshape(-1).clone().requires_grad_(True)
    copies = sparse_all_gather(w, placement, shards, solo, Recorder(ledger=ledger, layer="h"))
    assert torch.equal(copies, full_EF[[0, 2]])
    g = torch.arange(10, dtype=torch.float64).view(2, 5)
    (copies * g).sum().backward()
    assert torch.equal(w.grad.view(3, 5), torch.stack([g[0], torch.zeros(5, dtype=torch.float64), g[1]]))
    assert ledger.records == []


def test_bad_input_is_refused_with_the_numbers():
    solo = Group(kind="ep", ranks=(0,), pg=None, rank=0, remote_peers=0, nodes=(0,))
    rec = Recorder(ledger=None, layer="h")
    with pytest.raises(ValueError, match=r"w_owned_O \(shape \(4,\)\) must be 1-d with this rank's 5 owned"):
        sparse_all_gather(torch.zeros(4), Placement(copies_E=((0,),), nodes_R=(0,)), even_shards(5, 1, 1), solo, rec)
    with pytest.raises(ValueError, match=r"placement has 2 ranks, the ep group 1"):
        sparse_all_gather(torch.zeros(5), Placement(copies_E=((0,),), nodes_R=(0, 0)), even_shards(5, 1, 1), solo,
                          rec)
    with pytest.raises(ValueError, match=r"sizes_ER\[0\] \(\[2, 2\]\) must be sizes >= 0 summing to numel \(5\)"):
        ShardSpec(numel=5, sizes_ER=((2, 2),))
    with pytest.raises(ValueError, match=r"placement has 3 experts, shards 2"):
        sparse_exchange(Placement(copies_E=((0,),) * 3, nodes_R=(0,)), even_shards(4, 2, 1), 0)
    with pytest.raises(ValueError, match=r"rank \(2\) must lie in \[0, 1\)"):
        sparse_bytes(Placement(copies_E=((0,),), nodes_R=(0,)), even_shards(4, 1, 1), 2, 8)
    with pytest.raises(ValueError, match=r"homes_E \(\[0, 4\]\) must be ranks in \[0, 4\)"):
        whole_shards(3, [0, 4], 4)
