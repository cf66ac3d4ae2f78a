"""Lina's expert packing: the rule and the index maps (pure), then on gloo ranks: a model packed p = 2 (and back
to 1) mid-training matches the never-packed one in fp64 (outputs, gradients and Adam state by global expert
id, losses within 1e-12), checkpoints convert between packings, ``"auto"`` decides the same on every rank at
a step boundary, and a packing that does not divide ep is refused naming the field."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moe_plugins.core.experts import init_full_weights, shard_weights
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.lina.packing import (EXPERT_KEYS, MicroOpTimes, convert_state_dicts, decide_packing,
                                      expert_block, is_check_step, move_plan, next_packing, packed_layout,
                                      packing_layout_problems, regroup_problems)
from tests.workers.lina_packing import auto_decisions, bad_packing, mismatched_move, packed_training


# ---- the rule -----------------------------------------------------------------------------------------

def test_checks_from_step_ten_every_four():
    assert [s for s in range(1, 31) if is_check_step(s)] == [10, 14, 18, 22, 26, 30]
    with pytest.raises(ValueError, match=r"every \(0\)"):
        is_check_step(3, 2, 0)


@given(packing=st.sampled_from([1, 2, 4, 8]), base_ep=st.sampled_from([1, 2, 4, 8, 16]),
       expert=st.floats(0, 1, allow_nan=False), a2a=st.floats(0, 1, allow_nan=False),
       cap=st.none() | st.integers(1, 16))
def test_packing_doubles_only_while_the_expert_micro_op_is_shorter(packing, base_ep, expert, a2a, cap):
    times = MicroOpTimes(expert_s=3 * expert, expert_n=3, a2a_s=6 * a2a, a2a_n=6)
    new = decide_packing(packing, times, base_ep, cap)
    limit = base_ep if cap is None else min(base_ep, cap)
    if expert < a2a and 2 * packing <= limit and base_ep % (2 * packing) == 0:
        assert new == 2 * packing
    else:
        assert new == packing
    assert decide_packing(packing, MicroOpTimes(a2a_s=1.0, a2a_n=1), base_ep, cap) == packing   # nothing timed


def test_next_packing_stops_at_the_cap_and_at_ep():
    assert next_packing(1, 4) == 2 and next_packing(2, 4) == 4 and next_packing(4, 4) is None
    assert next_packing(1, 4, max_packing=1) is None and next_packing(1, 6) == 2 and next_packing(2, 6) is None


def test_a_packing_that_does_not_divide_ep_is_refused_naming_the_field():
    layout = ParallelLayout(world=8, ranks_per_node=4, ep=4, esp=2)
    assert packing_layout_problems(3, layout, 8) == [
        "moe_plugins.lina.packing (3) must divide ep (4), the devices that the 8 experts (2 local per device) "
        "are spread over"]
    assert packing_layout_problems(0, layout, 8)[0].startswith("moe_plugins.lina.packing (0) must be an integer")
    assert packing_layout_problems(4, layout, 8) == packing_layout_problems("auto", layout, 8) == []
    with pytest.raises(ValueError, match=r"packing \(3\) must be a positive integer dividing ep \(4\)"):
        packed_layout(layout, 3)
    assert regroup_problems(layout, ParallelLayout(world=8, ranks_per_node=4, ep=2, esp=4), 8) == [
        "esp (2 -> 4) must stay the same when packing"]


# ---- the index maps -----------------------------------------------------------------------------------

layouts = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]),
                    st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]))


@given(layouts)
def test_a_fine_ep_member_sits_at_j_mod_ep_in_either_layout(params):
    edp, ep, esp, mp_, p = params
    if ep % p:
        return
    world = edp * ep * esp
    if world % mp_:
        return
    fine = ParallelLayout(world=world, ranks_per_node=world, mp=mp_, ep=ep, esp=esp)
    coarse = packed_layout(fine, p)
    for rank in range(world):
        j = fine.coords(rank)["ep"]              # index in its fine EP group
        assert fine.group_of("ep", rank)[j] == rank
        assert coarse.coords(rank)["ep"] == j % coarse.ep
        assert coarse.coords(rank)["esp"] == fine.coords(rank)["esp"]


@given(e_l=st.sampled_from([1, 2, 3]), ep=st.sampled_from([1, 2, 4, 8]), p=st.sampled_from([1, 2, 4, 8]),
       pack=st.booleans())
def test_move_plan_gives_every_member_its_block_once_from_holders(e_l, ep, p, pack):
    if ep % p:
        return
    num_experts = e_l * ep
    ep_from, ep_to = (ep, ep // p) if pack else (ep // p, ep)
    plan = move_plan(num_experts, ep_from, ep_to)
    assert plan.size == ep
    for j in range(plan.size):
        held = set(expert_block(num_experts, ep_from, j % ep_from))
        for i in range(plan.size):
            assert set(plan.sends[j][i]) <= held, "a member sends an expert it does not hold"
        got = plan.received(j)
        assert sorted(got) == list(expert_block(num_experts, ep_to, j % ep_to)), "wrong or duplicated experts"
        assert set(plan.sends[j][j]) == held & set(got), "a member sends itself what it already holds"
        # only what it lacks arrives from others
        assert sum(len(plan.sends[i][j]) for i in range(plan.size) if i != j) == len(set(got) - held)


@settings(max_examples=30, deadline=None)
@given(layouts, st.booleans())
def test_checkpoint_conversion_reshards_by_global_expert_id(params, pack):
    edp, ep, esp, mp_, p = params
    world = edp * ep * esp
    if ep % p or world % mp_:
        return
    fine = ParallelLayout(world=world, ranks_per_node=world, mp=mp_, ep=ep, esp=esp)
    src, dst = (fine, packed_layout(fine, p)) if pack else (packed_layout(fine, p), fine)
    full = init_full_weights(ep * 2, 3, 4 * esp, torch.Generator().manual_seed(1))

    def states(layout):
        out = {}
        for r in range(world):
            c = layout.coords(r)
            shard = shard_weights(full, c["ep"], layout.ep, c["esp"], layout.esp)
            out[r] = {f"moe.1.{k}": getattr(shard, k) for k in EXPERT_KEYS}
            out[r]["moe.1.wg_EM"] = torch.full((2,), float(r))
        return out
    saved, wanted = states(src), states(dst)
    for r in range(world):
        got = convert_state_dicts(saved, src, dst, r)
        assert set(got) == set(wanted[r])
        for k, v in wanted[r].items():
            assert torch.equal(got[k], v), (k, r)


def test_checkpoint_conversion_refuses_another_world():
    a = ParallelLayout(world=4, ranks_per_node=2, ep=4)
    with pytest.raises(ValueError, match=r"world/mp \(4/1 -> 2/1\) must stay the same"):
        convert_state_dicts({0: {}}, a, ParallelLayout(world=2, ranks_per_node=2, ep=2), 0)


# ---- gloo ranks ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ep,esp", [(4, 1), (2, 2)])
def test_packing_mid_training_matches_the_unpacked_run_by_global_expert_id(world, ep, esp):
    steps, pack_at, unpack_at = 7, 2, 5
    results = world(4).run(packed_training, 4, ep, esp, steps, pack_at, unpack_at, timeout_s=300)
    for res in results:
        assert res["ep"] == [ep] * pack_at + [ep // 2] * (unpack_at - pack_at) + [ep] * (steps - unpack_at)
        assert max(res["loss"]) <= 1e-12, res["loss"]
        assert max(res["y"]) <= 1e-12, res["y"]
        assert max(res["grad"]) <= 1e-12, res["grad"]
        # the move itself is a copy: weights and Adam's moments arrive bitwise, by global id
        assert res["moved"] == {"data": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, "step_state": 0.0}
        assert res["ckpt_2to1"] == 0.0 and res["ckpt_1to2"] == 0.0 and res["opt_2to1"] == 0.0
        # one all-to-all per regroup (pack and unpack) on the fine EP group
        assert res["regroup_records"] == ["regroup:all_to_all@ep"] * 2


def test_auto_agrees_on_summed_timings_at_a_step_boundary(world):
    # rank-local views disagree; the sums over ranks decide. Checks after steps 2, 4, 6 (start=2, every=2).
    slow_a2a, slow_expert = (1.0, 5.0), (5.0, 1.0)
    fake = [[slow_expert] * 4,                            # step 1
            [(0.1, 5.0)] + [slow_expert] * 3,             # step 2: rank 0 alone would pack (5.1 < 6); the sums
                                                          #   over ranks, expert 35.1 > a2a 12, keep 1
            [slow_a2a] * 4,                               # step 3
            [(10.0, 1.0)] + [slow_a2a] * 3,               # step 4: rank 0 alone would not (11 > 6); sums 17 < 36: 2
            [(1.0, 0.5)] * 4, [(1.0, 0.5)] * 4,           # steps 5-6 (a new window): expert slower: keep 2
            [slow_a2a] * 4, [slow_a2a] * 4]               # steps 7-8: pack 4 (ep 1)
    results = world(4).run(auto_decisions, 4, 8, fake, timeout_s=300)
    first = results[0]
    for res in results:
        assert res["returned"] == [None, None, None, 2, None, None, None, 4]
        assert res["ep"] == [4, 4, 4, 4, 2, 2, 2, 2]           # the regroup lands between steps, everywhere
        assert res["decisions"] == first["decisions"]
    assert [(s, a, b) for s, *_, a, b in first["decisions"]] == [(2, 1, 1), (4, 1, 2), (6, 2, 2), (8, 2, 4)]
    assert first["decisions"][0][1:5] == pytest.approx((35.1, 8, 12.0, 8))


def test_auto_with_measured_timings_agrees_and_counts_every_micro_op(world):
    results = world(4).run(auto_decisions, 4, 4, None, timeout_s=300)
    first = results[0]
    for res in results:
        assert res["decisions"] == first["decisions"] and res["returned"] == first["returned"]
    (step, expert_s, expert_n, a2a_s, a2a_n, was, now), *_ = first["decisions"]
    # window of 2 steps x 2 layers x 4 ranks: one expert and two exchange micro-ops per layer call
    assert (step, expert_n, a2a_n, was) == (2, 16, 32, 1) and expert_s > 0 and a2a_s > 0
    assert now == decide_packing(1, MicroOpTimes(expert_s, expert_n, a2a_s, a2a_n), 4)
    for res in results:
        assert all(loss == loss for loss in res["loss"])


@pytest.mark.parametrize("packing,message", [
    (3, "invalid packing: moe_plugins.lina.packing (3) must divide ep (4)"),
    (2, ""), ("auto", "")])
def test_the_controller_refuses_a_packing_that_does_not_divide_ep(world, packing, message):
    for got in world(4).run(bad_packing, 4, packing, timeout_s=120):
        assert got.startswith(message) if message else got == ""


def test_a_regroup_with_different_tensors_per_rank_is_refused_everywhere_before_moving(world):
    for got in world(4).run(mismatched_move, 4, timeout_s=120):
        assert got.startswith("[4, 4, 1] expert tensors to move differ across EP group [0, 1, 2, 3]"), got
