"""pipeline_degree="tune": the climb over measured degrees (pure), and the tuner in a layer on 4 gloo ranks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_plugins.core.costmodel import PipeCosts
from moe_plugins.pipemoe.model import choose_degree
from moe_plugins.pipemoe.flag import degree_from_flag
from moe_plugins.pipemoe.tune import TunedDegree, best_probe, ladder, next_probe
from moe_plugins.tools.verify import VerifySpec
from tests.workers.pipemoe import tuned_layer

WORLD = 4


def climb(start, r_max, time_of):
    """Run next_probe to the end against a time function; the degrees in the order measured."""
    times, order = {}, []
    while (r := next_probe(start, r_max, times)) is not None:
        assert r not in times, f"{r} measured twice"
        times[r] = time_of(r)
        order.append(r)
    return order, times


def test_ladders():
    assert ladder(3, 64, up=True) == [3, 6, 12, 24, 48]
    assert ladder(3, 64, up=False) == [3, 1]
    assert ladder(8, 8, up=True) == [8]
    assert ladder(1, 64, up=False) == [1]


def test_climb_goes_up_while_it_pays_then_refines():
    order, times = climb(2, 64, {1: 9, 2: 8, 4: 6, 6: 5.5, 8: 5, 12: 4.9, 16: 7}.get)
    assert order == [2, 4, 8, 16, 6, 12]           # never tries 1 (going up helped); midpoints beside 8
    assert best_probe(times) == 12


def test_climb_goes_down_when_up_does_not_pay():
    order, times = climb(4, 64, {1: 5, 2: 6, 4: 7, 8: 9}.get)
    assert order == [4, 8, 2, 1] and best_probe(times) == 1      # 1 and 2 are adjacent: nothing between


def test_refinement_finds_an_optimum_the_ladder_skips():
    order, times = climb(3, 64, {1: 9, 2: 5, 3: 6, 4: 7, 6: 8}.get)
    assert order == [3, 6, 1, 2, 4] and best_probe(times) == 2


def test_climb_at_the_edges():
    assert climb(1, 1, lambda r: 1.0)[0] == [1]
    assert climb(8, 8, {8: 3, 4: 2, 2: 4, 3: 5, 6: 2.5}.get)[0] == [8, 4, 2, 3, 6]


def test_best_probe_breaks_ties_towards_fewer_chunks():
    assert best_probe({2: 1.000, 4: 0.995, 8: 1.2}) == 2          # within 1%
    assert best_probe({2: 1.000, 4: 0.98, 8: 1.2}) == 4
    assert best_probe({4: 1.0, 8: 1.0}, tie_tolerance=0.0) == 4


@settings(max_examples=200, deadline=None)
@given(a=st.floats(1e-4, 1.0), b=st.floats(0.0, 10.0), c=st.floats(0.0, 1.0),
       start=st.integers(1, 64), r_max=st.integers(1, 64))
def test_climb_finds_the_best_rung_of_a_convex_time(a, b, c, start, r_max):
    """T(r) = a r + b / r + c is convex, so on the rungs start * 2^k the climb reaches their minimum, and the
    midpoints can only improve on it."""
    start = min(start, r_max)
    time_of = lambda r: a * r + b / r + c
    _, times = climb(start, r_max, time_of)
    rungs = set(ladder(start, r_max, up=True)) | set(ladder(start, r_max, up=False))
    best = min(time_of(r) for r in rungs)
    assert min(times[r] for r in rungs if r in times) == best
    assert time_of(best_probe(times, tie_tolerance=0.0)) <= best


def test_tune_flag_and_bad_settings():
    from moe_plugins.core.costmodel import CostProfile, LinearModel, ProfileKey
    key = ProfileKey(world=4, ranks_per_node=2, mp=1, ep=4, esp=1, backend="gloo", device="cpu")
    lin = lambda u: LinearModel(alpha=1e-4, beta=1e-9, unit=u)
    profile = CostProfile(key=key, dtype="float32", models={"gemm": lin("mac"), "all_to_all@ep": lin("byte")})
    tuned = degree_from_flag(" Tune ", profile)
    assert isinstance(tuned, TunedDegree) and set(tuned.costs) == {"ep"}
    with pytest.raises(ValueError, match=r"pipeline_degree \('tune'\) needs a cost profile"):
        degree_from_flag("tune", None)
    with pytest.raises(ValueError, match=r"warmup_calls \(-1\) must be an integer >= 0; timed_calls \(0\)"):
        TunedDegree(costs=tuned.costs, warmup_calls=-1, timed_calls=0)


def test_tuned_layer_is_exact_and_ranks_climb_alike(world):
    """Every call's output and input gradient equal r = 1's (fp64, with drops); all ranks run the same degree
    at every call; the first probe is the model's pick, the climb follows next_probe on the agreed times, and
    the pick is best_probe of them. no_grad calls tune their own key (forward only)."""
    spec = VerifySpec(world=WORLD, ranks_per_node=2, k=2, tokens=16, schedule="baseline", ep=4)
    costs = PipeCosts(alpha_a=2e-5, beta_a=4e-6, alpha_e=5e-5, beta_e=1e-6)
    res = world(WORLD).run(tuned_layer, spec, {"ep": costs}, 20)
    start = choose_degree(costs, 2048.0, 4096.0, objective="training", r_max=8).degree   # as test_pipemoe
    assert start > 1
    first = res[0]
    assert all(r["degrees"] == first["degrees"] and r["climbs"] == first["climbs"] for r in res)
    assert max(r["max_diff"] for r in res) <= 1e-12
    s, times, decided = first["climbs"][True]
    assert s == start and decided is not None
    order, replay = climb(start, 8, times.get)
    assert replay == times and decided == best_probe(times) == first["decisions"][True]
    # each probe: 1 untimed + 2 timed calls, in the climb's order (refinement included); then the pick
    assert first["degrees"][:3 * len(order)] == [r for r in order for _ in range(3)]
    assert set(first["degrees"][3 * len(order):]) == {decided}
    assert first["eval_degrees"][0] == first["climbs"][False][0]
    assert any("tune (baseline, training" in n and f"chose r={decided}" in n for n in first["notes"])
