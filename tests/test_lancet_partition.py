"""Lancet's batch partitions in the MoE layer (moe_plugins/lancet/partition.py): pure pieces, then on 4 gloo ranks
in fp64 the core layer called whole against the same layer cut into 2 and 4 partitions of samples: outputs, input
and parameter gradients <= 1e-12, the same aux loss, counts and dropped routes (top-1 and top-2, balanced and a
skewed gate with drops, and dropless), each partition's exchanges issued on the pipeline lane."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_plugins.core.gating import apply_capacity, assign_topk
from moe_plugins.lancet.partition import part_plans, partition_bounds, partitions_problem, routing_rows
from moe_plugins.tools.verify import VerifySpec
from tests.workers.lancet_partition import whole_and_parts

WORLD = 4
EXACT = 1e-12
SPEC = VerifySpec(
    world=WORLD, ranks_per_node=2, ep=4, experts=8, tokens=32, hidden=8, ffn=12)


def test_partition_bounds_cover_whole_samples():
    assert partition_bounds(8, 4, 3) == [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert partition_bounds(5, 1, 2) == [(0, 10)]
    with pytest.raises(ValueError, match=r"partitions \(3\) must divide the batch \(8 samples per rank\).*"
                                         r"\[1, 2, 4, 8\]"):
        partition_bounds(8, 3)
    assert partitions_problem(4, 0) == "moe_plugins.lancet.partitions (0) must be an integer >= 1"
    assert partitions_problem(4, True) is not None and partitions_problem(4, 2) is None


def test_partition_routes_keep_the_whole_batch_slots():
    torch.manual_seed(0)
    logits = torch.randn(12, 4) + torch.tensor([3.0, 0, 0, 0])            # skewed: expert 0 overflows
    whole = apply_capacity(assign_topk(logits, 2), 4)
    first, second = routing_rows(whole, 0, 6), routing_rows(whole, 6, 12)
    assert torch.equal(torch.cat([first.slot_SK, second.slot_SK]), whole.slot_SK)
    assert int(whole.dropped) > 0 and int(first.dropped) + int(second.dropped) == int(whole.dropped)
    # gating the second half alone would have kept other routes: the split must not re-gate
    alone = apply_capacity(assign_topk(logits[6:], 2), 4)
    assert not torch.equal(alone.slot_SK, second.slot_SK)


def test_part_plans_split_per_member_and_partition():
    mine_EP = [[1, 2], [0, 3], [4, 0], [5, 1]]          # 4 experts, 2 partitions, 2 members of 2 experts
    recv_SLP = [[[1, 2], [0, 3]], [[7, 0], [1, 1]]]       # source s, local expert l, partition p
    plans = part_plans(mine_EP, recv_SLP, 2)
    assert [p.send for p in plans] == [(1, 9), (5, 1)]
    assert [p.recv_PL for p in plans] == [((1, 0), (7, 1)), ((2, 3), (0, 1))]
    assert [p.recv for p in plans] == [(1, 8), (5, 1)]


CASES = [(replace(SPEC, k=k, skew=skew, capacity_factor=1.0 if skew else 2.0, seed=3 + k), parts, True)
         for k in (1, 2) for skew in (0.0, 12.0) for parts in (2, 4)]
CASES += [(replace(SPEC, k=2, drop=False, skew=12.0, seed=9), 4, True),     # dropless, skewed
          (replace(SPEC, k=2, skew=12.0, capacity_factor=1.0, seed=4), 2, False)]   # no pipeline lane: inline


def _err(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def test_partitioned_layer_equals_the_whole_call(world):
    results = world(WORLD).run(whole_and_parts, CASES, timeout_s=300)
    dropped = 0
    for i, (spec, parts, lane) in enumerate(CASES):
        for r in (rank[i] for rank in results):
            w, p = r["whole"], r["parts"]
            for key in ("y", "grad_x", "aux"):
                assert _err(w[key], p[key]) <= EXACT, (spec, parts, key)
            assert all(_err(a, b) <= EXACT for a, b in zip(w["grads"], p["grads"])), (spec, parts)
            assert w["dropped"] == p["dropped"] and torch.equal(w["counts"], p["counts"])
            dropped += w["dropped"]
            forward = [(op, on) for op, on, phase in r["exchanges"] if phase == "forward"]
            uneven = [on for op, on in forward if op == "all_to_all"][1:]          # after the counts' exchange
            assert len(uneven) == 2 * parts, forward                        # one dispatch and one combine each
            assert set(uneven) == {"pipeline" if lane else "main"}, forward
            # backward: one reverse exchange per forward one, issued when autograd reaches the landing and waited
            # for at the anchor, after the other partitions' work: on the lane, both partitions' combine
            # gradients fly at once (the backward pipelines them); inline, each is done before the next starts
            assert r["backward"] == ["pipeline" if lane else "main"] * (2 * parts), r["backward"]
            assert r["in_flight"] == 0 and r["peak"] == (parts if lane else 0), (r["peak"], parts, lane)
    assert dropped > 0
