"""Parm's schedules on real gloo ranks: exact against the reference for every layout of world 4, inside the
chunked and pipelined runners, SAA against the sequential collectives, and ledger volumes against §IV-V.
Pure helpers (slot compaction, block order, the auto choice) are tested without processes."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_plugins.core.comm import Recorder
from moe_plugins.core.config import MoEConfig
from moe_plugins.core.gating import (apply_capacity, assign_topk, block_candidates, capacity, gate_logits, route,
                                route_block)
from moe_plugins.core.groups import Group, MoEProcessGroups
from moe_plugins.core.layout import GROUP_KINDS, ParallelLayout
from moe_plugins.parm.cost import AlphaBeta, ParmCosts, ParmShape, op_volumes, s1_gate_ops, schedule_ops
from moe_plugins.parm.saa import block_order
from moe_plugins.core.schedule import LayerParams
from moe_plugins.parm.auto import ParmAutoSchedule
from moe_plugins.parm.schedules import block_counts, expert_partials, local_slots
from moe_plugins.tools.verify import VerifySpec, make_problem
from tests.workers import parm as jobs

LAYOUTS = [(mp, ep, esp) for mp in (1, 2) for ep, esp in ((1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4))]
ERRORS = ("max_err_out", "max_err_grad_in", "max_err_grad_w", "max_err_aux")


def matrix(schedule, layouts, **kw):
    return [VerifySpec(world=4, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=k, drop=drop, schedule=schedule,
                       dtype="float64", **kw)
            for mp, ep, esp in layouts for k in (1, 2) for drop in (True, False)]


def assert_exact(specs, reports):
    bad = [(s.schedule, s.mp, s.ep, s.esp, s.k, s.drop, s.pipeline_degree, {e: r[e] for e in ERRORS})
           for s, r in zip(specs, reports) if not (r["ok"] and all(r[e] <= 1e-9 for e in ERRORS))]
    assert not bad, bad


# ---- exactness -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["parm-s1", "parm-s2"])
def test_every_layout_matches_reference(world, schedule):
    specs = matrix(schedule, LAYOUTS)
    reports = world(4).run(jobs.verify_many, specs)[0]
    assert_exact(specs, reports)
    assert any(r["dropped_routes"] > 0 for s, r in zip(specs, reports) if s.drop)     # drops were exercised


def test_saa_matches_reference(world):
    specs = matrix("parm-s2-saa", [lay for lay in LAYOUTS if lay[0] == 2])
    assert_exact(specs, world(4).run(jobs.verify_many, specs)[0])


def forcing(choice: str) -> ParmCosts:
    """Costs that make Algorithm 1 pick ``choice`` for any shape with mp > 1."""
    cheap, dear = AlphaBeta(alpha=0.0, beta=1e-12), AlphaBeta(alpha=1.0, beta=1.0)
    if choice == "parm-s1":   # free all-to-alls: S1 gathers x, S2 E T M = k f x >= x (ties go to S1)
        return ParmCosts(a2a_ep_esp=AlphaBeta(alpha=0.0, beta=0.0), ag_mp=cheap, saa=dear)
    if choice == "baseline-tp":   # a dear fused group, DeepSpeed's EP all-to-all and ESP collectives cheap
        return ParmCosts(a2a_ep_esp=dear, ag_mp=cheap, saa=dear, a2a_ep=cheap, ag_esp=cheap, ar_esp=cheap)
    return ParmCosts(a2a_ep_esp=cheap, ag_mp=dear, saa=cheap)


@pytest.mark.parametrize("choice", ["parm-s1", "parm-s2", "baseline-tp"])
def test_auto_is_exact_on_either_branch(world, choice):
    specs = matrix("parm-auto-test", [(2, 2, 2), (2, 4, 1), (2, 1, 2)])
    reports = world(4).run(jobs.verify_auto_with_costs, "parm-auto-test", forcing(choice), specs)[0]
    assert_exact(specs, reports)
    # the ledger tells which branch ran: only S1's split gate all-reduces the gate weight's gradient over MP,
    # and only DeepSpeed's flow sends through the EP group (Parm through the fused EP&ESP group)
    assert {"backward:all_reduce@mp" in r["ledger"]["moe"] for r in reports} == {choice == "parm-s1"}
    ep_ledgers = [r for s, r in zip(specs, reports) if s.ep > 1]
    assert {"forward:all_to_all@ep" in r["ledger"]["moe"] for r in ep_ledgers} == {choice == "baseline-tp"}


def test_auto_default_costs_matches_reference(world):
    specs = matrix("parm-auto", [(2, 2, 2), (1, 2, 2)])
    assert_exact(specs, world(4).run(jobs.verify_many, specs)[0])


def test_pipelined_runner(world):
    """PipeMoE's runner (twin schedules on a lane): 3 chunks, and 8 chunks of a 4-token block (empty chunks)."""
    specs = [VerifySpec(world=4, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=2, drop=drop, schedule=s,
                        pipeline_degree=r, tokens=tokens, dtype="float64")
             for s in ("parm-s1", "parm-s2-saa") for mp, ep, esp in ((2, 2, 2), (2, 4, 1))
             for drop, r, tokens in ((True, 3, 16), (False, 8, 4))]
    assert_exact(specs, world(4).run(jobs.verify_many, specs)[0])


@pytest.mark.parametrize("schedule", ["parm-s1", "parm-s2", "parm-s2-saa"])
def test_chunked_runner_equals_unchunked(world, schedule):
    for layout in ((2, 2, 2), (2, 4, 1)):
        assert max(world(4).run(jobs.chunked_equals_whole, layout, schedule, [2, 3, 7])) <= 1e-12


@pytest.mark.parametrize("drop", [True, False])
def test_s1_fallback_for_opaque_gates_equals_the_split_gate(world, drop):
    """Hosts whose gate cannot be split (LayerParams.block_router None) run S1 with the whole-block gate;
    both forms give the same results (13 tokens: padded blocks)."""
    for layout in ((2, 2, 1), (2, 1, 2)):
        assert max(world(4).run(jobs.fallback_equals_block_router, layout, drop)) <= 1e-12


def test_edge_cases(world):
    """All tokens on one expert (drops, experts and ranks with nothing), one token, and an odd token count
    split over MP = 2 (padded)."""
    specs = [VerifySpec(world=4, ranks_per_node=2, mp=2, ep=ep, esp=esp, k=k, schedule=s, dtype="float64", **kw)
             for s in ("parm-s1", "parm-s2-saa") for ep, esp in ((2, 2), (4, 1)) for k in (1, 2)
             for kw in ({"skew": 6.0}, {"tokens": 1}, {"tokens": 3, "drop": False})]
    reports = world(4).run(jobs.verify_many, specs)[0]
    assert_exact(specs, reports)
    assert any(r["dropped_routes"] > 10 for s, r in zip(specs, reports) if s.skew)


@pytest.mark.parametrize("layout", [(2, 2, 1), (2, 4, 1), (2, 2, 2), (2, 1, 2), (1, 4, 1)])
def test_saa_equals_sequential_collectives(world, layout):
    assert max(world(4).run(jobs.saa_matches_sequential, layout)) <= 1e-12


# ---- ledger volumes (§IV-V) ------------------------------------------------------------------------------

def by_phase(summary, phase):
    return {key.split(":", 1)[1]: (row["count"], row["numel"]) for key, row in summary.items()
            if key.startswith(phase + ":") and "all_reduce_max" not in key}


@pytest.mark.parametrize("layout", [(2, 2, 2), (2, 4, 1), (2, 1, 2), (2, 2, 1)])
@pytest.mark.parametrize("k", [1, 2])
def test_ledger_matches_t_d1_t_d2(world, layout, k):
    """Balanced routing, so T = k f S / E exactly and S1's token blocks need C / N_MP slots each: every op
    of S1 and S2 has the size of t_D1 / t_D2, and S1's all-to-all volume is 1/N_MP of the baseline's."""
    mp, ep, esp = layout
    names = ["baseline", "parm-s1", "parm-s2", "parm-s2-saa"]
    ledgers = world(4).run(jobs.balanced_ledgers, layout, k, names)[0]
    shape = ParmShape(B=1, L=16, M=8, H=16, E=4, k=k, f=1.0, mp=mp, ep=ep, esp=esp)
    want = {s: {key: (c, int(v)) for key, (c, v) in op_volumes(schedule_ops(s, shape)).items()}
            for s in ("baseline", "parm-s1", "parm-s2")}
    for phase in ("forward", "backward"):
        assert by_phase(ledgers["baseline"], phase) == want["baseline"]
        assert by_phase(ledgers["parm-s2"], phase) == want["parm-s2"]
        assert by_phase(ledgers["parm-s2-saa"], phase) == want["parm-s2"]
    # S1 also reconciles its split gate with O(E) collectives on MP (route counts, gate sums; the gate
    # weight's gradient in backward): nothing token-sized beyond t_D1's all-gather of the input
    for phase in ("forward", "backward"):
        s1_ops = schedule_ops("parm-s1", shape) + s1_gate_ops(shape, phase)
        assert by_phase(ledgers["parm-s1"], phase) == {key: (c, int(v)) for key, (c, v) in op_volumes(s1_ops).items()}
    if ep > 1:
        base_a2a = ledgers["baseline"]["forward:all_to_all@ep"]["numel"]
        assert ledgers["parm-s1"]["forward:all_to_all@ep_esp"]["numel"] * mp == base_a2a


def test_ledger_s1_with_random_routing(world):
    """Unbalanced routing: S1's buffer holds C_l slots per expert, the largest kept count of any token block,
    recomputed here from the reference gate; it never exceeds the baseline's all-to-all volume."""
    spec = VerifySpec(world=4, ranks_per_node=2, mp=2, ep=2, esp=2, k=2, schedule="parm-s1", tokens=32)
    report = world(4).run(jobs.verify_many, [spec])[0][0]
    assert report["ok"]
    prob, cfg = make_problem(spec), spec.moe_config()
    c_l = 0
    for d in range(2):                           # the fused group is the whole world: every DP block
        routing = route(prob.x_DSM[d], prob.wg_EM, k=cfg.k, capacity_factor=cfg.capacity_factor,
                        min_capacity=cfg.min_capacity, drop_tokens=cfg.drop_tokens)
        for half in (slice(0, 16), slice(16, 32)):
            kept = routing.slot_SK[half] >= 0
            c_l = max(c_l, int(torch.bincount(routing.expert_SK[half][kept], minlength=4).max()))
        capacity = routing.capacity
    a2a = report["ledger"]["moe"]["forward:all_to_all@ep_esp"]
    assert a2a["count"] == 2 and a2a["numel"] == 2 * cfg.num_experts * c_l * spec.hidden * spec.esp
    assert c_l <= capacity
    assert report["ledger"]["moe"]["forward:all_reduce_max@ep_esp"]["numel"] == 1


@pytest.mark.parametrize("drop", [True, False])
def test_ledger_s1_gate_traffic_is_o_of_e(world, drop):
    """S1 gates only its own block: on the MP group it sends the output (forward) and the input gradient
    (backward), S' x M with S' = S padded to a multiple of N_MP, and otherwise only k E route counts, E gate
    sums and the E x M gate-weight gradient; no S x K combine weights."""
    spec = VerifySpec(world=4, ranks_per_node=2, mp=2, ep=2, esp=1, k=2, drop=drop, schedule="parm-s1",
                      tokens=31, dtype="float64")
    report = world(4).run(jobs.verify_many, [spec])[0][0]
    assert report["ok"] and report["max_err_grad_w"] <= 1e-9
    m, e, k, p, rows = spec.hidden, spec.experts, spec.k, spec.mp, 32
    mp_ops = {key: (row["count"], row["numel"]) for key, row in report["ledger"]["moe"].items()
              if key.endswith("@mp") and "all_reduce_max" not in key}
    assert mp_ops == {"forward:all_gather@mp": (2, rows * m + p * k * e), "forward:all_reduce@mp": (1, e),
                      "backward:all_gather@mp": (1, rows * m), "backward:all_reduce@mp": (1, e * m)}


# ---- pure helpers ----------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 2), st.floats(0.25, 2.0), st.integers(1, 4),
       st.integers(0, 2 ** 16))
def test_local_slots_compact_the_baseline_order(tokens, experts, k, f, blocks, seed):
    k = min(k, experts)
    gen = torch.Generator().manual_seed(seed)
    routing = route(torch.randn(tokens, 5, generator=gen), torch.randn(experts, 5, generator=gen), k=k,
                    capacity_factor=f, min_capacity=0, drop_tokens=True)
    rows = -(-tokens // blocks)
    counts = block_counts(torch.nn.functional.pad(routing.expert_SK, (0, 0, 0, rows * blocks - tokens)),
                          torch.nn.functional.pad(routing.slot_SK, (0, 0, 0, rows * blocks - tokens), value=-1),
                          experts, blocks, rows)
    for b in range(blocks):
        part = slice(b * rows, min((b + 1) * rows, tokens))
        e_sK, s_sK = routing.expert_SK[part], routing.slot_SK[part]
        local = local_slots(e_sK, s_sK, experts, routing.capacity)
        assert torch.equal(local < 0, s_sK < 0)
        for e in range(experts):
            mine = (e_sK == e) & (s_sK >= 0)
            order = torch.argsort(s_sK[mine])
            assert torch.equal(local[mine][order], torch.arange(int(mine.sum())))   # 0..n-1 in baseline order
            assert int(counts[b, e]) == int(mine.sum())


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 3), st.floats(0.25, 2.0), st.integers(1, 4),
       st.booleans(), st.integers(0, 3), st.integers(0, 2 ** 16))
def test_block_router_equals_the_whole_gate(tokens, experts, k, f, blocks, drop, min_cap, seed):
    """Each block gated alone, reconciled through its k x E route counts and E gate sums (the MP all-gather and
    all-reduce done here by concatenation and summation), routes exactly as the gate on all tokens: same
    experts, slots, drops, combine weights, exp_counts, aux loss and its gradient; padding rows route nowhere."""
    k = min(k, experts)
    gen = torch.Generator().manual_seed(seed)
    x_SM = torch.randn(tokens, 5, generator=gen, dtype=torch.float64)
    wg_EM = torch.randn(experts, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    if seed % 3 == 0:                                   # skewed: many drops, experts with nothing
        x_SM[:, 0] += 4.0
        with torch.no_grad():
            wg_EM[0, 0] += 2.0
    whole = assign_topk(gate_logits(x_SM, wg_EM), k)
    cap = (capacity(tokens, experts, k, f, min_cap) if drop else max(whole.max_count, 1))
    want = apply_capacity(whole, cap)
    g_want, = torch.autograd.grad(want.aux_loss + (want.weight_SK ** 2).sum(), wg_EM)

    rows = -(-tokens // blocks)
    x_PsM = torch.nn.functional.pad(x_SM, (0, 0, 0, rows * blocks - tokens)).view(blocks, rows, 5)
    cands = [block_candidates(gate_logits(x_PsM[p], wg_EM), k, torch.arange(p * rows, (p + 1) * rows) < tokens)
             for p in range(blocks)]
    counts_PKE = torch.stack([c.counts_KE for c in cands])                       # the fake all-gather
    gate_total_E = sum(c.gate_sum_E for c in cands)                              # the fake all-reduce
    got = [route_block(c, counts_PKE, p, gate_total_E, tokens, cap) for p, c in enumerate(cands)]
    expert = torch.cat([b.routing.expert_SK for b in got])[:tokens]
    slot = torch.cat([b.routing.slot_SK for b in got])
    weight = torch.cat([b.routing.weight_SK for b in got])
    assert torch.equal(expert, want.expert_SK) and torch.equal(slot[:tokens], want.slot_SK)
    assert bool((slot[tokens:] < 0).all()) and float(weight[tokens:].detach().abs().sum()) == 0.0
    assert torch.allclose(weight[:tokens], want.weight_SK, rtol=0, atol=1e-12)
    full_counts = block_counts(torch.nn.functional.pad(want.expert_SK, (0, 0, 0, rows * blocks - tokens)),
                               torch.nn.functional.pad(want.slot_SK, (0, 0, 0, rows * blocks - tokens), value=-1),
                               experts, blocks, rows)
    for b in got:
        assert torch.equal(b.kept_PE, full_counts) and b.dropped == want.dropped
        assert torch.equal(b.routing.exp_counts_E, want.exp_counts_E) and b.routing.capacity == cap
        assert abs(float(b.routing.aux_loss.detach()) - float(want.aux_loss.detach())) <= 1e-12
    # the gradient: aux counted once (the fake all-reduce's backward is the identity on each block's sum),
    # the gate weight's partial gradients summed over blocks (copy_to's backward)
    g_got, = torch.autograd.grad(got[0].routing.aux_loss + (weight ** 2).sum(), wg_EM)
    assert torch.allclose(g_got, g_want, rtol=0, atol=1e-10)


def test_block_router_rejects_foreign_counts():
    """Counts of another shape (here k = 1 against the block's k = 2) are refused; their values are not read
    (that would be a host synchronisation per step: tests/test_host_reads.py)."""
    cand = block_candidates(torch.zeros(3, 4, dtype=torch.float64), 2, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"counts_PKE\[1\] must be this block's own counts_KE"):
        route_block(cand, torch.zeros(2, 1, 4, dtype=torch.long), 1, cand.gate_sum_E, 3, 4)
    with pytest.raises(ValueError, match=r"block \(2\) must be in \[0, 2\)"):
        route_block(cand, torch.stack([cand.counts_KE] * 2), 2, cand.gate_sum_E, 6, 4)
    with pytest.raises(ValueError, match=r"valid_s has shape \(2,\); expected \(3,\)"):
        block_candidates(torch.zeros(3, 4), 1, torch.ones(2, dtype=torch.bool))


def fake_groups(layout: ParallelLayout, rank: int) -> MoEProcessGroups:
    """The groups a rank would have, without process groups (for pure logic only)."""
    made = {}
    for kind in GROUP_KINDS:
        ranks = layout.group_of(kind, rank)
        made[kind] = Group(kind=kind, ranks=ranks, pg=None, rank=ranks.index(rank),
                           remote_peers=layout.remote_peers(kind, rank))
    return MoEProcessGroups(layout=layout, global_rank=rank, **made)


@pytest.mark.parametrize("world_size, per_node", [(4, 2), (8, 2), (8, 4), (16, 4)])
def test_block_order_agrees_within_every_mp_group(world_size, per_node):
    divisors = [d for d in (1, 2, 4, 8) if world_size % d == 0]
    for mp in divisors:
        for ep in divisors:
            for esp in divisors:
                if world_size % (ep * esp):
                    continue
                layout = ParallelLayout(world=world_size, ranks_per_node=per_node, mp=mp, ep=ep, esp=esp)
                for group in layout.groups("mp"):
                    orders = {tuple(block_order(layout, fake_groups(layout, r).mp, esp)) for r in group}
                    assert len(orders) == 1 and sorted(next(iter(orders))) == list(range(ep))


def test_block_order_takes_local_blocks_first():
    layout = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=4, esp=1)
    assert block_order(layout, fake_groups(layout, 3).mp, 1) == [2, 3, 0, 1]


def test_expert_partials_needs_host_partials_when_sharded():
    layout = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=2, esp=2)
    params = LayerParams(router=lambda x: None, experts=lambda x: x)
    with pytest.raises(ValueError, match=r"esp \(2\) > 1 need the experts' partial sums"):
        expert_partials(params, fake_groups(layout, 0).esp)
    one = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=4, esp=1)
    assert expert_partials(params, fake_groups(one, 0).esp) is params.experts


def test_auto_choice_is_logged_once_and_follows_the_costs(caplog):
    layout = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=2, esp=2)
    cfg = MoEConfig(hidden=8, ffn=16, num_experts=4, k=2)
    for choice, runs_as in (("parm-s1", "parm-s1"), ("parm-s2", "parm-s2-saa")):
        cls = ParmAutoSchedule.with_costs(forcing(choice), "test")
        sched = cls(cfg, fake_groups(layout, 0), Recorder(None, "layer7"))
        with caplog.at_level(logging.INFO, logger="moe_plugins.parm.schedules"):
            caplog.clear()
            assert sched.choose(64).choice == choice and sched.choose(64).choice == choice
        assert len(caplog.records) == 1 and f"layer7: parm-auto chose {runs_as} for 64 tokens" in caplog.text
        assert cls.name == "parm-auto" and cls.costs is not ParmAutoSchedule.costs


def test_auto_prices_s1_with_the_buffer_it_observes(world):
    """Lines under which S1 wins by 1 ns on balanced routing (t_s1 = 2 b y / N_MP, t_s2 = the same + 1 ns);
    the routing is skewed so S1's real buffer is twice balanced: after the first agreement parm-auto prices
    S1 with the observed C_l, switches to S2, and every call stays exact (S1 and S2 compute the same)."""
    line = AlphaBeta(alpha=0.0, beta=1e-9)
    costs = ParmCosts(a2a_ep_esp=line, ag_mp=AlphaBeta(alpha=0.0, beta=0.0), saa=AlphaBeta(alpha=1e-9, beta=1e-9))
    for layout in ((2, 2, 1), (2, 1, 2)):
        got = world(4).run(jobs.auto_watches_s1_buffer, costs, layout)[0]
        calls = got["calls"]
        assert got["s1_c_l"] == 8 and got["agreed"] == 8, got          # balanced routing gives 4
        assert [c["ran"] for c in calls] == ["parm-s1", "parm-s2", "parm-s2", "parm-s2"], got
        assert calls[0]["source"] == "observed" and calls[-1]["priced_c_l"] == 8
        assert got["made"] == ["parm-s1", "parm-s2"]
        assert max(max(c["err_y"], c["err_grad"]) for c in calls) <= 1e-12, got


def test_auto_observes_nothing_when_told_not_to(world):
    """observe_every = 0 is the paper's Algorithm 1: balanced pricing for every call, no extra collective."""
    sched = ParmAutoSchedule.with_costs(forcing("parm-s1"), "test")
    layout = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=2, esp=1)
    quiet = type("ParmAutoSchedule", (sched,), {"observe_every": 0})(
        MoEConfig(hidden=8, ffn=16, num_experts=4, k=2), fake_groups(layout, 0), Recorder(None, "l"))
    quiet.observe(64, 99)
    assert quiet.watch == {} and quiet.choose(64).s1_source == "balanced"


def test_mp_block_slots_matches_block_counts():
    gen = torch.Generator().manual_seed(3)
    expert_SK = torch.randint(0, 4, (10, 2), generator=gen)
    slot_SK = torch.randint(-1, 3, (10, 2), generator=gen)
    from moe_plugins.core.gating import Routing
    from moe_plugins.parm.schedules import mp_block_slots
    routing = Routing(expert_SK=expert_SK, slot_SK=slot_SK, weight_SK=torch.ones(10, 2), capacity=3,
                      aux_loss=torch.zeros(()), exp_counts_E=torch.zeros(4))
    padded_e = torch.cat([expert_SK, torch.zeros(2, 2, dtype=torch.long)])
    padded_s = torch.cat([slot_SK, torch.full((2, 2), -1)])
    assert mp_block_slots(routing, 4, 4) == int(block_counts(padded_e, padded_s, 4, 4, 3).max())
