"""PipeMoE: the Eq. 9-12 recurrence, Theorem 1's optimal degree, and the pipelined runner on 4 gloo ranks."""

import itertools
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from moe_plugins.core.costmodel import PAPER_TESTBED, ExchangeCurve, PipeCosts
from moe_plugins.pipemoe.model import (TIE_TOLERANCE, choose_degree, f1, f3, f4, fewest_chunks_near, moe_time,
                                      objective_time, optimal_degree, optimal_training_degree, pipeline_time,
                                      plan_workload, searched_degree, training_time)
from moe_plugins.pipemoe.degree import AutoDegree
from moe_plugins.pipemoe.flag import degree_from_flag
from moe_plugins.tools.verify import VerifySpec
from tests.workers.pipemoe import auto_layer, live_stages_after, overlap_probe, verify_many

WORLD = 4

# A CPU/gloo-like profile (slow link, start-up costs in the milliseconds) next to the paper's GPU testbed.
CPU_LIKE = PipeCosts(alpha_a=1.5e-3, beta_a=2.5e-9, alpha_e=4e-4, beta_e=3e-11)
# gloo's exchange as measured on the emulated link (benchmarks/results/duplex-link.md): at the rate up to
# 1 MiB, then twice as slow per byte (the two directions take turns); a line fitted across both misprices both.
_SIZES = tuple(float(4096 << i) for i in range(12))
GLOO_KINK = PipeCosts(alpha_a=0.0, beta_a=5e-8, alpha_e=4e-4, beta_e=3e-11, exchange_curve=ExchangeCurve(
    x=_SIZES, seconds=tuple(5e-4 + 4e-8 * x * (1 if x <= 1 << 20 else 2) - (4e-8 * (1 << 20) if x > 1 << 20 else 0)
                            for x in _SIZES), beta_tail=8e-8))


# ---- the recurrence ----------------------------------------------------------------------------------------

def test_recurrence_by_hand():
    # D: [0,2] [2,4]; E_1 [2,5], E_2 [5,8]; literal Eq. 11: C_1 [5,7], C_2 [8,10]
    assert pipeline_time([2, 2], [3, 3], [2, 2], shared_link=False) == 10
    # one link: C_1 also waits for D_2 (ends at 4) -> same here; with a slow link it matters:
    assert pipeline_time([4, 4], [1, 1], [4, 4], shared_link=False) == 13     # C_1 at 5 while D_2 runs
    assert pipeline_time([4, 4], [1, 1], [4, 4], shared_link=True) == 16      # = 2 r t_d (Eq. 25)
    assert pipeline_time([1], [5], [1]) == 7                                    # r = 1: 2 t_d + t_e (Eq. 19)


def test_r1_is_eq19_not_algorithm1_line5():
    c, n_d, n_e = CPU_LIKE, 3e6, 4e9
    d, e = c.alpha_a + c.beta_a * n_d, c.alpha_e + c.beta_e * n_e
    assert moe_time(c, n_d, n_e, 1) == pytest.approx(2 * d + e) == pytest.approx(f1(c, n_d, n_e))
    assert not math.isclose(moe_time(c, n_d, n_e, 1), 2 * e + d)


@pytest.mark.parametrize("costs", [PAPER_TESTBED, CPU_LIKE], ids=["paper", "cpu"])
def test_closed_forms_equal_the_shared_link_recurrence(costs):
    for n_d, n_e in itertools.product((1e4, 1e6, 1e8), (1e7, 1e9, 1e11)):
        for r in range(2, 65):
            want = max(f3(costs, n_d, n_e, r), f4(costs, n_d, n_e, r))
            assert moe_time(costs, n_d, n_e, r) == pytest.approx(want, rel=1e-12)


# ---- Theorem 1 ---------------------------------------------------------------------------------------------

def _shapes():
    """64 layers from tiny (start-up bound) to compute-heavy (H = 32768), fp16 and fp32 exchanges."""
    for B, L, M, H, P, eb in itertools.product((1, 8), (128, 2048), (512, 4096), (1024, 32768), (4, 16), (2, 4)):
        yield plan_workload(B=B, L=L, M=M, H=H, E=P * 2, k=2, f=1.0, P=P, element_bytes=eb)


@pytest.mark.parametrize("costs", [PAPER_TESTBED, CPU_LIKE,
                                   PipeCosts(alpha_a=2e-4, beta_a=1e-10, alpha_e=0.0, beta_e=2e-13),
                                   PipeCosts(alpha_a=0.0, beta_a=4e-10, alpha_e=5e-5, beta_e=5e-14), GLOO_KINK,
                                   replace(CPU_LIKE, pipeline_step=4e-3), replace(GLOO_KINK, pipeline_step=15e-3)],
                         ids=["paper", "cpu", "alpha_e=0", "alpha_a=0", "measured-curve", "cpu+step",
                              "measured-curve+step"])
@pytest.mark.parametrize("objective", ["forward", "training"])
def test_chosen_degree_minimises_the_recurrence(costs, objective):
    def time_of(w, r):
        return objective_time(costs, w.n_d, w.n_e, r, objective)
    chosen = set()
    for w in _shapes():
        choice = choose_degree(costs, w.n_d, w.n_e, objective=objective, r_max=64, tie_tolerance=0.0)
        best = min(time_of(w, r) for r in range(1, 65))
        assert time_of(w, choice.degree) <= best * (1 + 1e-12), (w, choice)
        assert choice.predicted_time_s == pytest.approx(time_of(w, choice.degree), rel=1e-12)
        chosen.add(choice.degree)
        # what auto uses: the fewest chunks within 1% of that minimum
        tied = choose_degree(costs, w.n_d, w.n_e, objective=objective, r_max=64)
        assert tied.degree == min(r for r in range(1, 65) if time_of(w, r) <= best * (1 + TIE_TOLERANCE)), w
        assert tied.predicted_time_s == pytest.approx(time_of(w, tied.degree), rel=1e-12)
        assert tied.degree <= choice.degree and any(c.r == tied.degree for c in tied.candidates)
    assert len(chosen) >= 5, chosen          # the grid really moves the optimum


@pytest.mark.parametrize("objective", ["forward", "training"])
def test_a_curve_drawn_from_the_line_plans_like_theorem_1(objective):
    """The searched degree (every r timed) and Theorem 1 (closed forms + SLSQP) must agree when the curve is
    the line itself: the same minimum time on every shape."""
    c = CPU_LIKE
    line = PipeCosts(alpha_a=c.alpha_a, beta_a=c.beta_a, alpha_e=c.alpha_e, beta_e=c.beta_e,
                     exchange_curve=ExchangeCurve(x=_SIZES, seconds=tuple(c.alpha_a + c.beta_a * x for x in _SIZES),
                                                  beta_tail=c.beta_a))
    for w in _shapes():
        theorem = (optimal_degree(c, w.n_d, w.n_e) if objective == "forward"
                   else optimal_training_degree(c, w.n_d, w.n_e))
        searched = searched_degree(line, w.n_d, w.n_e, objective=objective)
        # interpolation below the smallest size holds the smallest size's time (>= the line's there)
        if w.n_d / theorem.degree >= _SIZES[0]:
            assert searched.predicted_time_s == pytest.approx(theorem.predicted_time_s, rel=1e-9), w
        assert len(searched.candidates) == 64 and searched.objective == objective


def test_a_kinked_curve_moves_the_degree_where_the_line_would_not():
    """An exchange past the kink costs twice per byte: cutting it into chunks below the kink pays, and the
    searched degree does so, while the line through the same points plans fewer chunks."""
    n_d, n_e = 8.0 * (1 << 20), 2e9
    curved = choose_degree(GLOO_KINK, n_d, n_e)
    straight = choose_degree(PipeCosts(alpha_a=GLOO_KINK.alpha_a, beta_a=GLOO_KINK.beta_a,
                                       alpha_e=GLOO_KINK.alpha_e, beta_e=GLOO_KINK.beta_e), n_d, n_e)
    assert n_d / curved.degree <= 1 << 20 < n_d / straight.degree, (curved.degree, straight.degree)
    assert len(curved.candidates) == 64 and len(straight.candidates) < 64     # searched vs Theorem 1
    with pytest.raises(ValueError, match="Theorem 1 assumes t_d = alpha_a"):
        optimal_degree(GLOO_KINK, n_d, n_e)                 # the line's closed forms would ignore the curve
    with pytest.raises(ValueError, match="Theorem 1 assumes t_d = alpha_a"):
        optimal_training_degree(GLOO_KINK, n_d, n_e)


@pytest.mark.parametrize("objective, share", [("training", 1.0), ("forward", 1 / 3)])
def test_the_step_of_pipelining_is_charged_once_to_every_r_above_1(objective, share):
    """The runner's step (PipeCosts.pipeline_step) costs nothing at r = 1 (the sequential loop) and the same at
    every r >= 2; so it never moves the best r >= 2, and a large enough step makes r = 1 the choice."""
    w = plan_workload(B=1, L=2048, M=256, H=2048, E=8, k=2, f=1.0, P=2)
    stepped = replace(CPU_LIKE, pipeline_step=9e-3)
    for r in (1, 2, 5, 64):
        gap = objective_time(stepped, w.n_d, w.n_e, r, objective) - objective_time(CPU_LIKE, w.n_d, w.n_e, r, objective)
        assert gap == pytest.approx(0.0 if r == 1 else 9e-3 * share, abs=1e-15), r
    free = choose_degree(CPU_LIKE, w.n_d, w.n_e, objective=objective, tie_tolerance=0.0)
    assert free.degree > 1
    gain = objective_time(CPU_LIKE, w.n_d, w.n_e, 1, objective) - free.predicted_time_s
    big = choose_degree(replace(CPU_LIKE, pipeline_step=1.01 * gain / share), w.n_d, w.n_e, objective=objective,
                        tie_tolerance=0.0)
    small = choose_degree(replace(CPU_LIKE, pipeline_step=0.99 * gain / share), w.n_d, w.n_e, objective=objective,
                          tie_tolerance=0.0)
    assert big.degree == 1 and small.degree == free.degree


def test_fewest_chunks_near_breaks_near_ties_towards_fewer_chunks():
    times = [10.0, 6.0, 5.05, 5.02, 5.0, 5.3]
    assert fewest_chunks_near(times, 0.0) == 5
    assert fewest_chunks_near(times, 0.005) == 4
    assert fewest_chunks_near(times, 0.01) == 3
    assert fewest_chunks_near(times, 0.5) == 2
    with pytest.raises(ValueError, match=r"tie_tolerance \(1.5\) must be a number in \[0, 1\)"):
        choose_degree(CPU_LIKE, 1e6, 1e9, tie_tolerance=1.5)


def test_theorem_candidates_name_their_case():
    choice = optimal_degree(CPU_LIKE, 2e6, 3e9)
    cases = {c.case for c in choice.candidates}
    assert "r=1" in cases and cases & {"Q1 (f2)", "Q2 (f3)", "not Q2 (f4)"}
    assert choice.degree in {c.r for c in choice.candidates}


def test_plan_workload_and_errors():
    w = plan_workload(B=4, L=1024, M=2048, H=4096, E=16, k=2, f=1.0, P=8)
    assert w.capacity == 512
    assert w.n_d == 16 * 512 * 2048 * 4 and w.n_e == 16 * 512 * 2048 * 4096
    with pytest.raises(ValueError, match=r"E \(6\) must be divisible by P \(4\)"):
        plan_workload(B=1, L=8, M=8, H=8, E=6, k=1, f=1.0, P=4)
    with pytest.raises(ValueError, match=r"B \(0\) must be a positive integer.*f \(0\) must be > 0"):
        plan_workload(B=0, L=8, M=8, H=8, E=4, k=1, f=0, P=4)
    with pytest.raises(ValueError, match=r"alpha_a \(-1.0\) must be a finite number >= 0"):
        optimal_degree(PipeCosts(alpha_a=-1.0, beta_a=0, alpha_e=0, beta_e=0), 1, 1)


def test_degree_from_flag():
    assert degree_from_flag(3, None) == 3 and degree_from_flag("4", None) == 4
    with pytest.raises(ValueError, match="needs a cost profile"):
        degree_from_flag("auto", None)
    with pytest.raises(ValueError, match=r"pipeline_degree \('two'\) must be a positive integer, 'auto' or 'tune'"):
        degree_from_flag("two", None)
    with pytest.raises(ValueError, match=r"pipeline_degree \(0\)"):
        degree_from_flag(0, None)


# ---- the runner on 4 gloo ranks ------------------------------------------------------------------------------

def _check(reports):
    bad = [(r["spec"]["schedule"], r["spec"]["pipeline_degree"], r["spec"]["tokens"],
            {k: r[k] for k in ("max_err_out", "max_err_grad_in", "max_err_grad_w", "routing_equal")})
           for r in reports if not r["ok"]]
    assert not bad, bad


@pytest.mark.parametrize("schedule, layout", [("baseline", dict(mp=2, ep=2, esp=2)), ("baseline", dict(ep=4)),
                                              ("baseline-tp", dict(mp=2, ep=2, esp=2)),
                                              ("baseline-tp", dict(mp=2, ep=2)),
                                              ("parm-s2", dict(mp=2, ep=2, esp=2)),
                                              ("parm-s2-saa", dict(mp=2, ep=2, esp=2)),
                                              ("parm-s1", dict(mp=2, ep=2, esp=2))])
def test_pipelined_is_exact_fp64_with_drops(world, schedule, layout):
    specs = [VerifySpec(world=WORLD, ranks_per_node=2, k=2, skew=0.5, schedule=schedule, pipeline_degree=r,
                        tokens=16, **layout) for r in (2, 3, 4, 8)]
    # fewer capacity slots than chunks (C = 1 here), and a dropless run
    specs += [VerifySpec(world=WORLD, ranks_per_node=2, k=1, tokens=2, schedule=schedule, pipeline_degree=r,
                         **layout) for r in (3, 8)]
    specs.append(VerifySpec(world=WORLD, ranks_per_node=2, k=2, drop=False, schedule=schedule, pipeline_degree=3,
                            **layout))
    reports = world(WORLD).run(verify_many, specs)[0]
    _check(reports)
    assert sum(r["dropped_routes"] for r in reports[:4]) > 0
    if schedule.startswith("baseline"):
        for r, rep in zip((2, 3, 4, 8), reports):      # the exchanges really ran per chunk
            assert rep["ledger"]["moe"]["forward:all_to_all@ep"]["count"] == 2 * r
            assert rep["ledger"]["moe"]["backward:all_to_all@ep"]["count"] == 2 * r


@pytest.mark.parametrize("r", [2, 4])
def test_stages_overlap_forward_and_backward(world, r):
    """Each probe only passes if D(i+1) runs during E(i), C(r-2) during E(r-1), and in backward the
    combine-gradient of chunk j during the expert backward of chunk j+1; the sequential loop times out."""
    assert world(WORLD).run(overlap_probe, r, True, 60.0) == ["ok"] * WORLD
    seq = world(WORLD).run(overlap_probe, r, False, 1.0)
    assert all(s.startswith("timeout") for s in seq), seq


def test_a_step_leaves_no_stage_alive(world):
    """A stage's fenced input has a grad_fn whose ctx holds the stage: kept on the stage, that cycle runs
    through an autograd node, which Python's collector cannot see, and every step's chunks leaked
    (about 3 MB per step at S=512, M=128, r=4, until a long bench run was OOM-killed)."""
    spec = VerifySpec(world=WORLD, ranks_per_node=2, k=2, tokens=16, schedule="baseline", ep=4, pipeline_degree=4)
    for rank in world(WORLD).run(live_stages_after, spec, 3):
        assert rank == {"training": 0, "forward_unused": 0, "no_grad": 0}


@pytest.mark.parametrize("schedule, layout, group, n_d, n_e, r_max", [
    # d_ENCM = (E=4, N=1, C=8, M=8) fp64: 2048 bytes; 32 rows * M * H = 4096 macs; r <= C = 8
    ("baseline", dict(ep=4), "ep", 2048.0, 4096.0, 8),
    # d_EPcM = (4, 2, 4, 8): MP-split then dumped to 2 shards: 2048 bytes; 32 rows * M * H/2; r <= c = 4
    ("parm-s2", dict(mp=2, ep=2, esp=2), "ep_esp", 2048.0, 2048.0, 4),
])
def test_auto_degree_in_the_layer(world, schedule, layout, group, n_d, n_e, r_max):
    spec = VerifySpec(world=WORLD, ranks_per_node=2, k=2, tokens=16, schedule=schedule, **layout)
    costs = PipeCosts(alpha_a=2e-5, beta_a=4e-6, alpha_e=5e-5, beta_e=1e-6)
    res = world(WORLD).run(auto_layer, spec, {group: costs})
    train = choose_degree(costs, n_d, n_e, objective="training", r_max=r_max).degree
    infer = choose_degree(costs, n_d, n_e, objective="forward", r_max=r_max).degree
    assert train > 1 and infer > 1
    a2a = "all_to_all" if schedule == "baseline" else None
    for rank in res:
        if a2a:
            assert rank["auto"]["fwd_a2a"] == 2 * train and rank["one"]["fwd_a2a"] == 2
            assert rank["auto"]["eval_a2a"] == 2 * infer
        assert rank["auto"]["chunks"] == [train, infer]
        for key in ("y", "grad_x", "y_eval"):
            torch.testing.assert_close(rank["auto"][key], rank["one"][key], rtol=0, atol=1e-12)


def test_auto_degree_rejects_unknown_schedule_workload():
    auto = AutoDegree(costs={"ep": CPU_LIKE})
    with pytest.raises(ValueError, match="does not know the exchange of schedule 'nobody-knows'"):
        schedule = type("S", (), {"name": "nobody-knows", "config": None, "groups": None,
                                  "exchange": lambda self, d: None})()      # describes no exchange
        auto.workload(schedule, SimpleNamespace(d=torch.zeros(4, 2)))


def test_a_degree_word_settles_to_one_without_a_profile_where_nothing_is_exchanged():
    from moe_plugins.core.layout import ParallelLayout
    from moe_plugins.core.plugin_config import PluginConfig, profile_problems, settled_degree
    none_cached = lambda layout: None          # noqa: E731
    for word in ("auto", "tune"):
        plugin = PluginConfig(pipeline_degree=word)
        for world, ep, mp, settles in ((1, 1, 1, True), (4, 1, 1, True), (4, 2, 1, False), (4, 1, 2, False)):
            layout = ParallelLayout(world=world, ranks_per_node=world, mp=mp, ep=ep, esp=1)
            assert settled_degree(plugin, layout).pipeline_degree == (1 if settles else word)
            assert bool(profile_problems(plugin, layout, none_cached, profiled=False)) is not settles
    fixed = PluginConfig(pipeline_degree=3)
    assert settled_degree(fixed, ParallelLayout(world=1, ranks_per_node=1, mp=1, ep=1, esp=1)) is fixed


def test_auto_picks_one_when_the_exchange_moves_nothing():
    """#27: with nothing to hide (an exchange group of one rank: EP = ESP = 1, or no bytes) auto picks r = 1,
    even on costs that would pipeline a real exchange of the same size."""
    from moe_plugins.pipemoe.degree import nothing_to_overlap
    assert nothing_to_overlap(1, 4096.0) and nothing_to_overlap(4, 0.0) and not nothing_to_overlap(2, 4096.0)
    cheap_start = PipeCosts(alpha_a=1e-9, beta_a=4e-6, alpha_e=1e-9, beta_e=1e-6)
    for size, want_pipelined in ((1, False), (2, True)):
        groups = SimpleNamespace(ep=SimpleNamespace(size=size))
        schedule = type("Baseline", (), {"name": "baseline", "groups": groups,
                                         "config": SimpleNamespace(ffn=16),
                                         "exchange": lambda self, d: SimpleNamespace(group="ep", sent=1.0, rows=1),
                                         "row_load": lambda self, dispatched: None})()       # padded: d's shape
        groups.esp = SimpleNamespace(size=1)
        d = torch.zeros(4, 64, 8)
        r = AutoDegree(costs={"ep": cheap_start}).degree(schedule, SimpleNamespace(d=d, cap_dim=1), True)
        assert (r > 1) == want_pipelined, (size, r)
