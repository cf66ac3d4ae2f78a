"""Parm's cost model (moe_plugins/parm/cost.py): sizes, per-op volumes, t_B / t_D1 / t_D2, Algorithm 1."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_plugins.core.costmodel import CostProfile, LinearModel, Measurement, ProfileKey
from moe_plugins.parm.cost import (DEFAULT_COSTS, NEAR_TIE, PAPER_AG_MP, AlphaBeta, ParmCosts, ParmShape, break_even_T,
                                   choose_schedule, op_volumes, s1_gate_ops, s1_slots, schedule_ops, shape_problems,
                                   sizes, t_baseline, t_baseline_tp, t_s1, t_s2)

SHAPE = ParmShape(B=4, L=512, M=1024, H=4096, E=8, k=2, f=1.2, mp=2, ep=2, esp=2)
COSTS = ParmCosts(a2a_ep_esp=AlphaBeta(alpha=1e-4, beta=2e-9), ag_mp=AlphaBeta(alpha=5e-5, beta=1e-9),
                  saa=AlphaBeta(alpha=1.5e-4, beta=2.5e-9), ag_esp=AlphaBeta(alpha=5e-5, beta=1e-9),
                  ar_esp=AlphaBeta(alpha=8e-5, beta=2e-9), a2a_ep=AlphaBeta(alpha=1e-4, beta=2e-9))


def test_sizes_follow_section_iv_not_algorithm_1_line_2():
    s = sizes(SHAPE)
    assert s.x == 4 * 512 * 1024
    assert s.T == pytest.approx(2 * 1.2 * 4 * 512 / 8)                    # k f B L / E: no factor M
    assert s.y == pytest.approx(8 * s.T * 1024 * 2)                        # E T M N_ESP
    assert sizes(ParmShape(**{**SHAPE.__dict__, "M": 2048})).T == s.T      # T does not grow with M


def test_schedule_ops_are_the_papers_collectives():
    s = sizes(SHAPE)
    assert op_volumes(schedule_ops("baseline", SHAPE)) == {
        "all_gather@esp": (1, s.x * 2), "all_to_all@ep": (2, 2 * s.y), "all_reduce@esp": (1, s.y)}
    y1 = 8 * s1_slots(SHAPE) * 1024 * 2                                    # E C_l M N_ESP
    assert op_volumes(schedule_ops("parm-s1", SHAPE)) == {"all_to_all@ep_esp": (2, 2 * y1), "all_gather@mp": (1, s.x)}
    assert op_volumes(schedule_ops("parm-s2", SHAPE)) == {"all_to_all@ep_esp": (2, s.y),
                                                          "all_gather@mp": (1, 8 * s.T * 1024)}
    etm = 8 * s.T * 1024                                                   # DeepSpeed's flow (esp = mp = 2)
    assert op_volumes(schedule_ops("baseline-tp", SHAPE)) == {"all_to_all@ep": (2, etm), "all_gather@esp": (1, etm),
                                                              "all_reduce@esp": (1, etm), "all_gather@mp": (1, etm)}
    unsharded = ParmShape(**{**SHAPE.__dict__, "esp": 1})
    assert op_volumes(schedule_ops("baseline-tp", unsharded)) == {"all_to_all@ep": (2, etm), "all_gather@mp": (1, etm)}
    with pytest.raises(ValueError, match=r"esp \(4\) must be 1 or mp \(2\)"):
        schedule_ops("baseline-tp", ParmShape(**{**SHAPE.__dict__, "esp": 4, "H": 4096}))


def test_baseline_tp_is_priced_only_where_it_can_run():
    s = sizes(SHAPE)
    etm = 8 * s.T * 1024
    want = 2 * COSTS.a2a_ep.time(etm / 2) + COSTS.ag_esp.time(etm) + COSTS.ar_esp.time(etm) + COSTS.ag_mp.time(etm)
    assert t_baseline_tp(SHAPE, COSTS) == pytest.approx(want, rel=1e-12)
    assert t_baseline_tp(ParmShape(**{**SHAPE.__dict__, "mp": 1}), COSTS) is None          # no MP: not a candidate
    assert t_baseline_tp(SHAPE, ParmCosts(a2a_ep_esp=COSTS.a2a_ep_esp, ag_mp=COSTS.ag_mp)) is None  # unpriced
    # a slow fused group and a cheap EP all-to-all: DeepSpeed's flow wins; the reverse: Parm's pick stays
    slow = ParmCosts(a2a_ep_esp=AlphaBeta(alpha=1.0, beta=1.0), ag_mp=COSTS.ag_mp, a2a_ep=COSTS.a2a_ep,
                     ag_esp=COSTS.ag_esp, ar_esp=COSTS.ar_esp)
    c = choose_schedule(SHAPE, slow)
    assert c.choice == "baseline-tp" and c.t_chosen == c.t_tp < min(c.t_s1, c.t_s2)
    assert choose_schedule(SHAPE, slow, tp=False).choice in ("parm-s1", "parm-s2")
    dear_ep = ParmCosts(**{**{n: getattr(COSTS, n) for n in ("a2a_ep_esp", "ag_mp", "saa", "ag_esp", "ar_esp")},
                           "a2a_ep": AlphaBeta(alpha=1.0, beta=1.0)})
    assert choose_schedule(SHAPE, dear_ep).choice in ("parm-s1", "parm-s2")


def test_s1_gate_ops_are_o_of_e_and_outside_the_model():
    assert op_volumes(s1_gate_ops(SHAPE, "forward")) == {"all_gather@mp": (1, 2 * 2 * 8), "all_reduce@mp": (1, 8)}
    assert op_volumes(s1_gate_ops(SHAPE, "backward")) == {"all_reduce@mp": (1, 8 * 1024)}
    assert s1_gate_ops(ParmShape(**{**SHAPE.__dict__, "mp": 1}), "forward") == []
    with pytest.raises(ValueError, match=r"phase \('both'\) must be 'forward' or 'backward'"):
        s1_gate_ops(SHAPE, "both")
    y1 = 8 * s1_slots(SHAPE) * 1024 * 2
    assert t_s1(SHAPE, COSTS) == pytest.approx(2 * (1e-4 + 2e-9 * y1) + 5e-5 + 1e-9 * sizes(SHAPE).x)


def test_size_one_groups_issue_nothing():
    flat = ParmShape(B=2, L=8, M=4, H=8, E=4, k=1, f=1.0, mp=1, ep=1, esp=1)
    for name in ("baseline", "parm-s1", "parm-s2"):
        assert schedule_ops(name, flat) == []
        assert t_baseline(flat, COSTS) == 0.0 and t_s1(flat, COSTS) == 0.0 and t_s2(flat, COSTS) == 0.0
    no_mp = ParmShape(**{**SHAPE.__dict__, "mp": 1})
    # nothing to split: the same collectives, S1's all-to-all no larger (kept routes, not the capacity)
    assert op_volumes(schedule_ops("parm-s1", no_mp)).keys() == op_volumes(schedule_ops("parm-s2", no_mp)).keys()
    assert t_s1(no_mp, COSTS) < t_s2(no_mp, COSTS, saa=False)
    at_f1 = ParmShape(**{**no_mp.__dict__, "f": 1.0})
    assert t_s1(at_f1, COSTS) == pytest.approx(t_s2(at_f1, COSTS, saa=False), rel=1e-12)
    assert choose_schedule(no_mp, COSTS).s2_form == "sequential"


def test_no_mp_runs_s2_without_the_host_read_of_c_l():
    """N_MP = 1: S1 is priced cheaper (balanced routing's C_l) but would read C_l on the host every call;
    S2 runs (GPU check, benchmarks/results/gpu-h200.md: parm-auto picked S1 on one GPU, one sync a step)."""
    no_mp = ParmShape(**{**SHAPE.__dict__, "mp": 1})
    assert t_s1(no_mp, COSTS) < t_s2(no_mp, COSTS, saa=False)
    assert choose_schedule(no_mp, COSTS, tp=False).choice == "parm-s2"
    alone = ParmShape(B=1, L=8192, M=768, H=3072, E=16, k=2, f=1.0, mp=1, ep=1, esp=1)
    assert choose_schedule(alone, COSTS, tp=False).choice == "parm-s2"


def test_times_by_hand():
    s = sizes(SHAPE)
    a2a, a2a_s1 = 1e-4 + 2e-9 * s.y / 2, 1e-4 + 2e-9 * 8 * 256 * 1024 * 2     # C_l = 2 d = 256 (f = 1.2)
    assert t_s1(SHAPE, COSTS) == pytest.approx(2 * a2a_s1 + 5e-5 + 1e-9 * s.x)                    # Eq. 11
    assert t_s2(SHAPE, COSTS, saa=False) == pytest.approx(2 * a2a + 5e-5 + 1e-9 * 8 * s.T * 1024)  # Eq. 7
    assert t_s2(SHAPE, COSTS) == pytest.approx(a2a + 1.5e-4 + 2.5e-9 * s.y / 2)                   # Eq. 14
    assert t_baseline(SHAPE, COSTS) == pytest.approx(5e-5 + 1e-9 * 2 * s.x + 8e-5 + 2e-9 * s.y
                                                     + 2 * (1e-4 + 2e-9 * s.y))                   # Eq. 1
    assert t_baseline(SHAPE, ParmCosts(a2a_ep_esp=COSTS.a2a_ep_esp, ag_mp=COSTS.ag_mp)) is None


@pytest.mark.parametrize("k", [1, 2, 3])
def test_s1_slots_follow_gshard_positions_over_the_token_blocks(k):
    """C_l by brute force: balanced routing, positions in GShard order (route rank, then token) over the
    MP group's blocks; block p's kept routes per expert, the largest over blocks."""
    B, L, E, mp = 1, 64, 4, 2
    d = B * L // (E * mp)
    for f in (0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0):
        shape = ParmShape(B=B, L=L, M=8, H=8, E=E, k=k, f=f, mp=mp, ep=2, esp=1)
        T = int(sizes(shape).T)
        kept = [0] * mp
        for r in range(k):
            for p in range(mp):
                start = (r * mp + p) * d
                kept[p] += max(0, min(T, start + d) - start)
        assert s1_slots(shape) == pytest.approx(max(kept)), f
    f1 = ParmShape(B=B, L=L, M=8, H=8, E=E, k=min(k, 2), f=1.0, mp=mp, ep=2, esp=1)
    assert s1_slots(f1) == pytest.approx(sizes(f1).T / mp)               # the paper's T / N_MP


def test_algorithm_1_ties_go_to_s1_and_the_choice_is_the_argmin():
    same = ParmCosts(a2a_ep_esp=COSTS.a2a_ep_esp, ag_mp=COSTS.ag_mp)
    tie = ParmShape(B=1, L=64, M=16, H=16, E=4, k=1, f=1.0, mp=2, ep=2, esp=1)   # E T M == B L M
    c = choose_schedule(tie, same)
    assert c.t_s1 == c.t_s2 and c.choice == "parm-s1"


def test_paper_limits_in_t():
    """§IV-B: with N_ESP = 1 and T -> 0, S2 wins (t_D2 -> 0, t_D1 -> AG_MP(BLM)); as T grows S1 wins when
    the overlapped collective costs more per element than the all-to-all alone."""
    shape = ParmShape(**{**SHAPE.__dict__, "esp": 1})
    assert choose_schedule(shape, COSTS, T=1e-3, tp=False).choice == "parm-s2"
    assert choose_schedule(shape, COSTS, T=1e6, tp=False).choice == "parm-s1"
    t0 = break_even_T(shape, COSTS)
    assert t0 is not None and t0 > 0
    assert t_s1(shape, COSTS, t0) == pytest.approx(t_s2(shape, COSTS, t0), rel=1e-9)
    assert choose_schedule(shape, COSTS, T=0.9 * t0, tp=False).choice == "parm-s2"
    assert choose_schedule(shape, COSTS, T=1.1 * t0, tp=False).choice == "parm-s1"


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4096), st.sampled_from([256, 1024]), st.integers(1, 2),
       st.floats(0.5, 2.5), st.sampled_from([(1, 2, 2), (2, 2, 2), (2, 4, 1), (4, 2, 2), (2, 1, 4)]),
       st.floats(1e-6, 1e-3), st.floats(1e-10, 1e-8), st.floats(1e-10, 1e-8))
def test_choice_is_argmin_and_eq_6_holds(B, L, M, k, f, degrees, alpha, beta_a2a, beta_ag):
    mp, ep, esp = degrees
    shape = ParmShape(B=B, L=L, M=M, H=1024, E=8, k=k, f=f, mp=mp, ep=ep, esp=esp)
    # a network where the fused all-to-all is no slower per element than the EP all-to-all (Eq. 3-5)
    link = AlphaBeta(alpha=alpha, beta=beta_a2a)
    costs = ParmCosts(a2a_ep_esp=link, ag_mp=AlphaBeta(alpha=alpha, beta=beta_ag), a2a_ep=link,
                      ag_esp=AlphaBeta(alpha=alpha, beta=beta_ag), ar_esp=AlphaBeta(alpha=alpha, beta=2 * beta_ag))
    c = choose_schedule(shape, costs, saa=False, tp=False)
    assert c.t_tp is None
    if mp == 1:                         # no TP to pause: S2, never S1's per-call host read of C_l
        assert c.choice == "parm-s2"
    elif abs(c.t_s1 - c.t_s2) > NEAR_TIE * min(c.t_s1, c.t_s2):
        assert c.choice == ("parm-s1" if c.t_s1 < c.t_s2 else "parm-s2")
    else:                               # a near-tie: the schedule sending fewer all-to-all elements (S1 if equal)
        sent = {s: op_volumes(schedule_ops(s, shape)).get("all_to_all@ep_esp", (0, 0.0))[1]
                for s in ("parm-s1", "parm-s2")}
        assert c.choice == ("parm-s1" if sent["parm-s1"] <= sent["parm-s2"] else "parm-s2")
    if ep > 1 and esp > 1:
        # Eq. 6: with N_MP = 1 both schedules beat the baseline by at least the ESP all-gather
        flat = ParmShape(**{**shape.__dict__, "mp": 1})
        assert t_baseline(flat, costs) - t_s1(flat, costs) >= costs.ag_esp.time(sizes(flat).x * esp) - 1e-15
    # DeepSpeed's flow as a third candidate: it replaces Algorithm 1's pick exactly when priced no dearer
    # than (1 + NEAR_TIE) times it, and only where it can run (mp > 1, esp 1 or mp)
    with_tp = choose_schedule(shape, costs, saa=False)
    runs = mp > 1 and esp in (1, mp)
    assert (with_tp.t_tp is not None) == runs
    if runs:
        assert with_tp.t_tp == pytest.approx(t_baseline_tp(shape, costs), rel=1e-12)
        wins = with_tp.t_tp <= (1 + NEAR_TIE) * c.t_chosen
        assert with_tp.choice == ("baseline-tp" if wins else c.choice) and with_tp.t_chosen <= (1 + NEAR_TIE) * c.t_chosen
    else:
        assert with_tp.choice == c.choice


def test_shape_problems_are_reported_together():
    bad = ParmShape(B=0, L=8, M=4, H=10, E=6, k=1, f=-1.0, mp=1, ep=4, esp=4)
    text = "; ".join(shape_problems(bad))
    assert "B (0) must be a positive integer" in text and "f (-1.0) must be a finite number > 0" in text
    text = "; ".join(shape_problems(ParmShape(B=1, L=8, M=4, H=10, E=6, k=7, ep=4, esp=4)))
    for part in ("k (7) must not exceed E (6)", "E (6) must be divisible by ep (4)",
                 "H (10) must be divisible by esp (4)"):
        assert part in text
    with pytest.raises(ValueError, match=r"invalid Parm shape: B \(0\)"):
        sizes(bad)


def test_costs_are_checked():
    bad = ParmCosts(a2a_ep_esp=AlphaBeta(alpha=-1.0, beta=1e-9), ag_mp=AlphaBeta(alpha=0.0, beta=math.inf))
    with pytest.raises(ValueError, match=r"a2a_ep_esp.alpha \(-1.0\).*ag_mp.beta \(inf\)"):
        bad.check()
    assert DEFAULT_COSTS.check() is DEFAULT_COSTS
    assert PAPER_AG_MP["testbed-b"] == AlphaBeta(alpha=1.09e-4, beta=7.14e-10)


def profile(models):
    key = ProfileKey(world=4, ranks_per_node=2, mp=2, ep=2, esp=2, backend="gloo", device="cpu")
    return CostProfile(key=key, dtype="float32", models={k: LinearModel(alpha=a, beta=b, unit="byte")
                                                         for k, (a, b) in models.items()})


def test_costs_from_a_profile_convert_bytes_to_elements():
    p = profile({"all_to_all@ep_esp": (1e-4, 1e-10), "all_gather@mp": (2e-5, 5e-11), "saa@ep_esp+mp": (3e-4, 2e-10)})
    c = ParmCosts.from_profile(p, element_bytes=4)
    assert c.a2a_ep_esp == AlphaBeta(alpha=1e-4, beta=4e-10) and c.ag_mp == AlphaBeta(alpha=2e-5, beta=2e-10)
    assert c.saa == AlphaBeta(alpha=3e-4, beta=8e-10) and c.a2a_ep is None
    with pytest.raises(ValueError, match=r"no model for 'all_gather@mp', which Parm's choice needs"):
        ParmCosts.from_profile(profile({"all_to_all@ep_esp": (1e-4, 1e-10)}), element_bytes=4)


def measured_profile(points):
    """A profile whose three Algorithm 1 terms carry lines and per-size measurements (x bytes -> seconds)."""
    p = profile({"all_to_all@ep_esp": (1e-4, 1e-10), "all_gather@mp": (2e-5, 5e-11), "saa@ep_esp+mp": (3e-4, 2e-10)})
    measured = {k: Measurement(x=tuple(x for x, _ in pts), seconds=tuple(t for _, t in pts))
                for k, pts in points.items()}
    return CostProfile(key=p.key, dtype=p.dtype, models=p.models, measurements=measured)


def test_curve_pricing_reads_the_measured_times():
    """A kinked all-to-all (cheap up to 4 KiB, then 10x dearer per byte) is priced from its points, in
    elements; the terms without measurements keep their lines; ``linear`` ignores the points."""
    kinked = [(1024.0, 1e-4), (4096.0, 2e-4), (8192.0, 2.2e-3)]
    p = measured_profile({"all_to_all@ep_esp": kinked})
    c = ParmCosts.from_profile(p, element_bytes=4)
    assert [name for name, _ in c.curves] == ["a2a_ep_esp"]
    assert c.time("a2a_ep_esp", 1024) == pytest.approx(2e-4)                      # 4096 bytes: a point
    assert c.time("a2a_ep_esp", 1536) == pytest.approx(1.2e-3)                    # halfway to 8192 bytes
    assert c.time("a2a_ep_esp", 4096) == pytest.approx(2.2e-3 + 4e-10 * 2048)     # past the last: the line's slope
    assert c.time("ag_mp", 1000) == c.ag_mp.time(1000)
    flat = ParmCosts.from_profile(p, element_bytes=4, pricing="linear")
    assert flat.curves == () and flat.time("a2a_ep_esp", 1536) == flat.a2a_ep_esp.time(1536)
    with pytest.raises(ValueError, match=r"pricing \('cubic'\) must be one of curve, linear"):
        ParmCosts.from_profile(p, element_bytes=4, pricing="cubic")


def test_curve_drawn_from_the_lines_changes_nothing():
    """Measurements that lie on the lines give the lines' times, choice and break-even T (the curve's
    break-even is found numerically)."""
    shape = ParmShape(**{**SHAPE.__dict__, "esp": 1})
    lines, xs = COSTS, [2.0 ** j for j in range(10, 34)]
    keys = {"a2a_ep_esp": "all_to_all@ep_esp", "ag_mp": "all_gather@mp", "saa": "saa@ep_esp+mp"}
    per_byte = {keys[n]: (getattr(lines, n).alpha, getattr(lines, n).beta / 4) for n in keys}   # fp32
    p = profile(per_byte)
    p = CostProfile(key=p.key, dtype=p.dtype, models=p.models,
                    measurements={k: Measurement(x=tuple(xs), seconds=tuple(a + b * x for x in xs))
                                  for k, (a, b) in per_byte.items()})
    curved = ParmCosts.from_profile(p, element_bytes=4)
    assert len(curved.curves) == 3
    for T in (1.0, 37.0, 512.0, 4096.0):
        assert t_s1(shape, curved, T) == pytest.approx(t_s1(shape, lines, T), rel=1e-9)
        assert t_s2(shape, curved, T) == pytest.approx(t_s2(shape, lines, T), rel=1e-9)
    assert break_even_T(shape, curved) == pytest.approx(break_even_T(shape, lines), rel=1e-6)


def test_observed_s1_buffer_prices_s1():
    """c_l replaces balanced routing's C_l in S1's all-to-all (y1 = E C_l M N_ESP) and can flip the choice."""
    shape = ParmShape(B=1, L=512, M=256, H=512, E=8, k=2, f=1.0, mp=2, ep=2, esp=2)
    costs = ParmCosts(a2a_ep_esp=AlphaBeta(alpha=0.0, beta=1e-9), ag_mp=AlphaBeta(alpha=0.0, beta=0.0),
                      saa=AlphaBeta(alpha=1e-9, beta=1e-9))
    assert s1_slots(shape) == 64
    a2a = op_volumes(schedule_ops("parm-s1", shape, c_l=80))["all_to_all@ep_esp"]
    assert a2a == (2, 2 * 8 * 80 * 256 * 2)
    balanced, seen = choose_schedule(shape, costs), choose_schedule(shape, costs, c_l=80)
    assert (balanced.choice, balanced.s1_slots, balanced.s1_source) == ("parm-s1", 64, "balanced")
    assert (seen.choice, seen.s1_slots, seen.s1_source) == ("parm-s2", 80, "observed")
    with pytest.raises(ValueError, match=r"c_l \(-1\) must be a finite number >= 0"):
        schedule_ops("parm-s1", shape, c_l=-1)


def test_s2_runs_with_saa_only_where_the_model_says_it_pays():
    """S2's form is the cheaper of Eq. 14 (SAA) and Eq. 7 (sequential); --no-saa / saa=False forbids SAA."""
    shape = ParmShape(B=1, L=512, M=256, H=512, E=8, k=2, f=0.25, mp=2, ep=2, esp=2)
    link, gather = AlphaBeta(alpha=1e-3, beta=1e-9), AlphaBeta(alpha=1e-3, beta=1e-10)
    for saa_alpha, form in ((1e-4, "saa"), (5e-3, "sequential")):
        costs = ParmCosts(a2a_ep_esp=link, ag_mp=gather, saa=AlphaBeta(alpha=saa_alpha, beta=1e-9))
        c = choose_schedule(shape, costs)
        assert c.s2_form == form and c.choice == "parm-s2"
        assert c.t_s2 == min(t_s2(shape, costs, saa=True), t_s2(shape, costs, saa=False))
    assert choose_schedule(shape, costs, saa=False).s2_form == "sequential"


def test_near_ties_go_to_fewer_all_to_all_elements():
    """A flat measured all-to-all (noise pooled 256 KiB and 512 KiB into one level) prices S1, which sends
    twice S2's elements at f = 0.25, the same as S2: the tie goes to S2. Outside the 2% band, price decides.
    At N_MP = 1 S2 runs whatever the prices (test_no_mp_runs_s2_without_the_host_read_of_c_l)."""
    shape = ParmShape(B=1, L=512, M=256, H=512, E=8, k=2, f=0.25, mp=2, ep=2, esp=2)
    flat, gather = AlphaBeta(alpha=4.5e-3, beta=0.0), AlphaBeta(alpha=3.5e-3, beta=0.0)
    tie = choose_schedule(shape, ParmCosts(a2a_ep_esp=flat, ag_mp=gather))
    assert tie.t_s1 == tie.t_s2 and tie.choice == "parm-s2"
    near = choose_schedule(shape, ParmCosts(a2a_ep_esp=flat, ag_mp=AlphaBeta(alpha=3.5e-3, beta=1e-9)))
    assert abs(near.t_s1 - near.t_s2) <= NEAR_TIE * min(near.t_s1, near.t_s2) and near.choice == "parm-s2"
    # outside the band the price decides, even for the schedule sending more: at f = 2 an observed C_l of 140
    # (balanced 64, S2's T / N_MP 128) has S1 send more, but S2 gathers 4x the elements over a dear MP link
    f2 = ParmShape(**{**shape.__dict__, "f": 2.0})
    costs = ParmCosts(a2a_ep_esp=AlphaBeta(alpha=1e-3, beta=1e-9), ag_mp=AlphaBeta(alpha=0.0, beta=1e-8))
    apart = choose_schedule(f2, costs, c_l=140)
    assert apart.t_s1 < (1 - NEAR_TIE) * apart.t_s2 and apart.choice == "parm-s1"
    flat_mp1 = ParmShape(**{**shape.__dict__, "mp": 1})
    assert choose_schedule(flat_mp1, ParmCosts(a2a_ep_esp=flat, ag_mp=gather)).choice == "parm-s2"
