"""The ragged exchange's pure pieces (core/ragged.py) against the padded path, and its refusals (one process).

The 4-rank equivalence (ragged vs padded vs the fp64 reference) is tests/test_ragged_exchange.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_plugins.core.dispatch import combine, dispatch
from moe_plugins.core.gating import route
from moe_plugins.core.plugin_config import PluginConfig, plugin_config_problems
from moe_plugins.core.ragged import (chunk_plan, combine_rows, expert_rows, grouped_rows, offsets, route_order,
                                     split_sizes)
from moe_plugins.core.schedule import chunk_bounds
from moe_plugins.core.schedule import Schedule, exchange_problems, with_exchange
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify import VerifySpec, spec_problems


def test_split_sizes_and_offsets():
    assert split_sizes([3, 0, 2, 5, 1, 1], 3) == [3, 7, 2]
    assert split_sizes([4, 2], 1) == [6]
    assert offsets([3, 0, 2]) == [0, 3, 3]
    assert offsets([]) == []
    with pytest.raises(ValueError, match="5 experts"):
        split_sizes([1, 2, 3, 4, 5], 2)


def test_expert_rows_groups_per_local_expert_source_by_source():
    # two sources, two local experts: source 0 sends 2 rows for expert 0 and 1 for expert 1, source 1 sends 0
    # and 3; the buffer is [s0e0, s0e0, s0e1, s1e1, s1e1, s1e1] (Q = 6)
    gather, back, n = expert_rows([[2, 1], [0, 3]])
    assert n == 4
    assert gather == [0, 1, 6, 6, 2, 3, 4, 5]
    assert back == [0, 1, 4, 5, 6, 7]
    gather, back, n = expert_rows([[2, 1], [0, 3]], multiple=3)
    assert n == 6 and gather[:2] == [0, 1] and gather[6:10] == [2, 3, 4, 5] and back == [0, 1, 6, 7, 8, 9]
    gather, back, n = expert_rows([[0, 0], [0, 0]], multiple=2)      # nothing received: one padded row per expert
    assert (gather, back, n) == ([0, 0, 0, 0], [], 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=3), min_size=1, max_size=4),
       st.integers(1, 4))
def test_grouped_rows_is_expert_rows_without_the_padding(recv_PL, multiple):
    """Megatron's experts take the rows grouped per local expert with tokens_per_expert: the same rows, in the
    same order, as the padded (E_l, n) layout less its padding slots."""
    gather, _, n = expert_rows(recv_PL, multiple)
    order, counts = grouped_rows(recv_PL)
    assert counts == [sum(src[e] for src in recv_PL) for e in range(3)]
    assert order == [gather[e * n + j] for e in range(3) for j in range(counts[e])]
    assert sorted(order) == list(range(sum(counts)))
    assert grouped_rows([[2, 1], [0, 3]]) == ([0, 1, 2, 3, 4, 5], [2, 4])
    assert grouped_rows([[1, 1], [1, 1]]) == ([0, 2, 1, 3], [2, 2])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=3), min_size=1, max_size=4),
       st.integers(1, 4))
def test_expert_rows_matches_a_per_expert_regroup(recv_PL, multiple):
    """Property: gathering with ``gather`` puts each local expert's rows, source by source, first in its row of
    the (E_l, n) layout, padding after; ``back`` inverts it; n is the busiest expert's rows rounded up."""
    total = sum(map(sum, recv_PL))
    buffer_Q = torch.arange(total, dtype=torch.float64) + 1.0
    gather, back, n = expert_rows(recv_PL, multiple)
    grouped = torch.cat([buffer_Q, torch.zeros(1, dtype=torch.float64)])[torch.tensor(gather, dtype=torch.long)]
    grouped = grouped.view(3, n)
    starts = offsets([c for src in recv_PL for c in src])
    for expert in range(3):
        want = [buffer_Q[starts[p * 3 + expert] + j].item() for p, src in enumerate(recv_PL)
                for j in range(src[expert])]
        assert grouped[expert, :len(want)].tolist() == want
        assert not grouped[expert, len(want):].any()
    assert n % multiple == 0 and n >= max(1, max(sum(src[e] for src in recv_PL) for e in range(3)))
    assert torch.equal(grouped.reshape(-1)[torch.tensor(back, dtype=torch.long)], buffer_Q)


def _padded(x_NSM, routings, experts):
    """The padded (E, N, C, M) dispatch of every block and the mask of its occupied slots."""
    slots, blocks = max(r.capacity for r in routings), len(routings)
    d_ENCM = torch.stack([dispatch(x_NSM[i], r, experts, slots) for i, r in enumerate(routings)], 1)
    occupied_ENC = torch.zeros(experts, blocks, slots, dtype=torch.bool)
    for i, r in enumerate(routings):
        kept = r.slot_SK >= 0
        occupied_ENC[r.expert_SK[kept], i, r.slot_SK[kept]] = True
    return d_ENCM, occupied_ENC


def _routings(seed: int, blocks: int, tokens: int, experts: int, k: int, drop: bool, skew: float):
    gen = torch.Generator().manual_seed(seed)
    wg_EM = torch.randn(experts, 6, generator=gen, dtype=torch.float64)
    wg_EM[0] += skew
    x_NSM = torch.randn(blocks, tokens, 6, generator=gen, dtype=torch.float64) + (skew > 0)
    routings = [route(x_NSM[i], wg_EM, k=k, capacity_factor=1.0, min_capacity=0, drop_tokens=drop) for i in
                range(blocks)]
    return x_NSM, routings


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.integers(1, 3), tokens=st.integers(1, 12),
       experts=st.sampled_from([2, 4, 6]), k=st.integers(1, 2), drop=st.booleans(),
       skew=st.sampled_from([0.0, 0.0, 20.0]))
def test_route_order_sends_exactly_the_padded_buffers_occupied_slots(seed, blocks, tokens, experts, k, drop, skew):
    """Property: the ragged rows are the padded (E, N, C, M) buffer's occupied slots in (expert, block, slot)
    order, bitwise; the counts are the occupied slots per expert; and combining the rows gives the padded
    combine, bitwise, dropped routes included."""
    k = min(k, experts)
    x_NSM, routings = _routings(seed, blocks, tokens, experts, k, drop, skew)
    d_ENCM, occupied_ENC = _padded(x_NSM, routings, experts)
    slots = d_ENCM.shape[2]
    order = route_order(routings, experts)
    kept = int(order.counts_EN.sum())
    rows_RM = x_NSM.reshape(-1, 6)[order.token_X[:kept]]
    assert torch.equal(rows_RM, d_ENCM[occupied_ENC])
    assert order.counts_EN.tolist() == occupied_ENC.sum(2).tolist()
    assert kept == sum(int((r.slot_SK >= 0).sum()) for r in routings)
    y_ENCM = torch.randn(experts, blocks, slots, 6, dtype=torch.float64)
    y_RM = y_ENCM[occupied_ENC]
    for i, r in enumerate(routings):
        assert torch.equal(combine_rows(y_RM, order.pos_NSK[i], r), combine(y_ENCM[:, i], r))
        dropped = r.slot_SK < 0
        assert bool((order.pos_NSK[i][dropped] == kept).all())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.integers(1, 3), tokens=st.integers(1, 12), k=st.integers(1, 2),
       drop=st.booleans(), skew=st.sampled_from([0.0, 20.0]), degree=st.integers(2, 5))
def test_chunk_plans_cut_the_padded_capacity_chunks(seed, blocks, tokens, k, drop, skew, degree):
    """Property: the plan of capacity chunk [a, b) sends exactly the padded buffer's occupied slots in [a, b)
    (the rows of d_ENCM[:, :, a:b] in order), its split sizes are their count per EP member (2 members of 2
    experts each), and the chunks together send every row once."""
    experts, members = 4, 2
    x_NSM, routings = _routings(seed, blocks, tokens, experts, k, drop, skew)
    d_ENCM, occupied_ENC = _padded(x_NSM, routings, experts)
    slots = d_ENCM.shape[2]
    order = route_order(routings, experts)
    assert torch.equal(order.top_EN, order.counts_EN)                # kept slots are 0..n-1
    mine = order.counts_EN.tolist()
    rows_RM = x_NSM.reshape(-1, 6)[order.token_X[:sum(map(sum, mine))]]
    recv = [[mine[p * 2 + l] for l in range(2)] for p in range(members)]     # as if every member sent these
    whole = chunk_plan(mine, recv, members)
    assert whole.rows is None and sum(whole.send) == rows_RM.shape[0]
    seen = []
    for a, b in chunk_bounds(slots, degree):
        plan = chunk_plan(mine, recv, members, a, b)
        got = rows_RM[torch.tensor(plan.rows, dtype=torch.long)] if plan.rows else rows_RM[:0]
        assert torch.equal(got, d_ENCM[:, :, a:b][occupied_ENC[:, :, a:b]])
        per_member = occupied_ENC[:, :, a:b].sum((1, 2)).view(members, 2).sum(1).tolist()
        assert list(plan.send) == per_member == list(plan.recv)
        assert [sum(c) for c in plan.recv_PL] == list(plan.recv)
        seen += plan.rows
    assert sorted(seen) == list(range(rows_RM.shape[0]))


def test_route_order_with_an_expert_without_tokens_and_all_dropped():
    x_NSM, routings = _routings(3, 1, 8, 4, 1, True, 50.0)       # every token picks expert 0
    order = route_order(routings, 4)
    assert order.counts_EN.reshape(-1).tolist() == [routings[0].capacity, 0, 0, 0]
    assert int(routings[0].dropped) == 8 - routings[0].capacity


# ---- refusals --------------------------------------------------------------------------------------------

def test_a_schedule_without_the_other_exchange_refuses_it_by_name():
    cls = default_registry().schedule_class("hecate")           # Hecate sends only the kept rows
    assert exchange_problems(cls, "padded") == [
        "exchange ('padded') is not supported by schedule 'hecate', which runs the ragged exchange only"]
    with pytest.raises(ValueError, match="schedule 'hecate'"):
        with_exchange(cls, "padded")
    assert with_exchange(cls, "ragged") is cls


def test_baseline_ragged_variant_and_degree_refusal():
    registry = default_registry()
    base = registry.schedule_class("baseline")
    ragged = with_exchange(base, "ragged")
    assert ragged.exchange_mode == "ragged" and ragged.name == "baseline" and issubclass(ragged, base)
    assert registry.schedule_class(ragged) is ragged          # a registered schedule's variant
    assert with_exchange(ragged, "padded") is base
    assert exchange_problems(base, "ragged", 3) == exchange_problems(base, "ragged", "2") == []
    assert exchange_problems(base, "ragged", "auto") == exchange_problems(base, "ragged", "tune") == []

    class Unpriced(ragged):      # a ragged form that cuts chunks but agrees no rows: no degree word
        row_load = Schedule.row_load

        @classmethod
        def exchange_variant(cls, exchange):
            return cls if exchange == "ragged" else None

    (problem,) = exchange_problems(Unpriced, "ragged", "auto")
    assert "schedule 'baseline' and pipeline_degree ('auto') is not supported" in problem and "row_load" in problem
    assert exchange_problems(base, "sparse") == ["exchange ('sparse') must be one of 'padded', 'ragged'"]


def test_every_ragged_form_takes_every_degree():
    registry = default_registry()
    ragged = with_exchange(registry.schedule_class("baseline-tp"), "ragged")
    assert ragged.exchange_mode == "ragged" and ragged.name == "baseline-tp"
    for name in ("baseline", "baseline-tp", "parm-s1", "parm-s2", "parm-s2-saa", "parm-auto", "parm-tune", "hecate"):
        problems = [exchange_problems(registry.schedule_class(name), "ragged", r) for r in (1, 2, "3", "auto", "tune")]
        assert problems == [[]] * 5, (name, problems)


def test_config_field_is_validated_at_the_boundary():
    assert PluginConfig.from_dict({"exchange": "ragged"}).exchange == "ragged"
    assert PluginConfig().exchange == "padded"
    problems = plugin_config_problems({"exchange": "raged", "esp": 0})
    assert any(p.startswith("moe_plugins.exchange ('raged') must be 'padded' or 'ragged' (did you mean 'ragged'?)")
               for p in problems), problems
    assert any(p.startswith("moe_plugins.esp (0)") for p in problems)
    with pytest.raises(ValueError, match=r"moe_plugins.exchange \(3\) must be 'padded' or 'ragged'"):
        PluginConfig.from_dict({"exchange": 3})


def test_verify_spec_takes_the_ragged_exchange_at_any_degree():
    for schedule, degree in (("parm-s2-saa", 2), ("parm-s2", "tune"), ("parm-auto", 3)):
        spec = VerifySpec(world=4, ranks_per_node=2, mp=2, ep=2, exchange="ragged", schedule=schedule,
                          pipeline_degree=degree)
        assert not [p for p in spec_problems(spec) if "exchange" in p], (schedule, spec_problems(spec))
    assert spec_problems(VerifySpec(world=4, ranks_per_node=2, ep=4, exchange="ragged")) == []
    assert spec_problems(VerifySpec(world=4, ranks_per_node=2, ep=4, exchange="ragged", pipeline_degree=3)) == []
