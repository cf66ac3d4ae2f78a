"""PipeMoE's degree words ("auto", "tune") with the ragged exchange. A ragged call is priced by its busiest rank's
rows (``Schedule.row_load``: one max of three integers over the layer's EP&ESP and MP groups), so every rank
that runs the call's pieces picks the same degree although their rows differ; the rows are rounded up to a
quarter-octave grid (``grid_rows``) so that calls of about the same volume share a decision. fp64, 4 gloo ranks,
against the padded exchange and the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_plugins.core.costmodel import CostProfile, LinearModel, PipeCosts, cache_path
from moe_plugins.pipemoe.degree import AutoDegree, grid_rows
from moe_plugins.pipemoe.tune import TunedDegree, best_probe
from moe_plugins.tools.verify import VerifySpec, spec_problems
from tests.test_hecate_layer import CHUNKED, check_chunked_call
from tests.test_pipemoe_tune import climb
from tests.test_ragged_exchange import _check_pair
from tests.workers.hecate_layer import one_call as hecate_one_call
from tests.workers.pipemoe import tuned_layer
from tests.workers.ragged import padded_and_ragged

WORLD = 4
# start-up terms near 0 (pipelining pays), as tests/test_generated.py's "lean" profile
LEAN = {"all_to_all": (1e-9, 1e-8), "all_gather": (1e-9, 1e-9), "gemm": (1e-9, 1e-9)}
MODEL_KEYS = {"all_to_all@ep": "all_to_all", "all_to_all@ep_esp": "all_to_all", "saa@ep_esp+mp": "all_to_all",
              "all_gather@mp": "all_gather", "all_gather@esp": "all_gather", "all_reduce@esp": "all_gather",
              "gemm": "gemm"}
LEAN_COSTS = PipeCosts(alpha_a=1e-9, beta_a=1e-8, alpha_e=1e-9, beta_e=1e-9)
CASES = [("baseline", 1, 4, 1), ("baseline", 1, 2, 2), ("baseline", 2, 2, 1), ("parm-s1", 2, 2, 1),
         ("parm-s1", 2, 1, 2), ("baseline-tp", 2, 2, 2), ("baseline-tp", 2, 2, 1), ("parm-s2", 2, 2, 2),
         ("parm-s2-saa", 2, 1, 2), ("parm-auto", 2, 2, 1), ("parm-tune", 2, 2, 2)]


def _lean_profiles(root: Path) -> str:
    models = {key: LinearModel(alpha=LEAN[op][0], beta=LEAN[op][1], unit="mac" if op == "gemm" else "byte")
              for key, op in MODEL_KEYS.items()}
    for _, mp, ep, esp in CASES:
        key = VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp).profile_key()
        CostProfile(key=key, dtype="float64", models=models, source="synthetic lean").save(cache_path(root, key))
    return str(root)


@given(st.integers(0, 10 ** 7))
def test_grid_rows_rounds_up_by_at_most_a_quarter(rows):
    g = grid_rows(rows)
    assert rows <= g <= max(rows, 1.25 * rows) and grid_rows(g) == g and grid_rows(rows + 1) >= g


def test_grid_rows_points():
    assert [grid_rows(n) for n in (0, 1, 8, 9, 11, 16, 17, 33, 100)] == [0, 1, 8, 10, 12, 16, 20, 40, 112]


def test_every_ragged_form_takes_a_degree_word():
    """Every ragged form cuts capacity chunks and agrees its rows, so takes "auto" and "tune" (a form that agrees
    none is refused: tests/test_ragged.py)."""
    for schedule, mp, ep, esp in CASES:
        for word in ("auto", "tune"):
            spec = VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, schedule=schedule,
                              exchange="ragged", pipeline_degree=word, profile_dir="/nonexistent")
            assert not [p for p in spec_problems(spec) if "exchange" in p], (schedule, word, spec_problems(spec))


@pytest.mark.parametrize("share", ["ci", pytest.param("other", marks=pytest.mark.full(
    covered_by="[ci] (every layout under one of the two words, both cases; the words share their pricing)"))])
def test_auto_and_tune_with_the_ragged_exchange_equal_padded(world, tmp_path, share):
    """One call per spec, ragged and padded, each at the degree its word picks: outputs and gradients equal
    (<= 1e-12) and the reference's; every rank ran the same number of chunks (forward all-to-alls: the counts,
    then 2 per chunk) and agreed the load (one max over the groups); the lean profile pipelines somewhere. CI runs
    each layout under one word ("auto" and "tune" alternating), the full profile under the other too."""
    profiles = _lean_profiles(tmp_path)
    words = [("auto", "tune")[(i + (share == "other")) % 2] for i in range(len(CASES))]
    specs = [VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, schedule=schedule, k=k, drop=drop,
                        skew=skew, tokens=16, seed=11 + k, pipeline_degree=word, profile_dir=profiles)
             for (schedule, mp, ep, esp), word in zip(CASES, words)
             for k, drop, skew in ((1, True, 0.0), (2, False, 3.0))]
    pairs = world(WORLD).run(padded_and_ragged, specs)[0]
    chunks_run = []
    for spec, (padded, ragged) in zip(specs, pairs):
        _check_pair(spec, padded, ragged)
        group = "ep_esp" if "forward:all_to_all@ep_esp" in ragged[0]["ledger"]["moe"] else "ep"   # Parm's fused
        forward = {r["ledger"]["moe"][f"forward:all_to_all@{group}"]["count"] for r in ragged}
        assert len(forward) == 1 and (forward.pop() - 1) % 2 == 0, (spec, forward)
        chunks = (ragged[0]["ledger"]["moe"][f"forward:all_to_all@{group}"]["count"] - 1) // 2
        if spec.schedule == "baseline":   # the agreed load: one max per group (EP&ESP, MP) past the padded call's
            maxes = [sum(row["count"] for key, row in r["ledger"]["moe"].items() if "all_reduce_max" in key)
                     for r in padded + ragged]
            more = (spec.ep * spec.esp > 1) + (spec.mp > 1)
            assert maxes[WORLD:] == [n + more for n in maxes[:WORLD]], (spec, maxes)
        chunks_run.append(chunks)
    assert max(chunks_run) > 1, chunks_run


@pytest.mark.parametrize("k, drop", [(2, False)])
def test_tune_with_the_ragged_exchange_climbs_alike_on_every_rank(world, k, drop):
    """20 training calls of a ragged layer (dropless, k 2: each rank's rows differ) with "tune" next to r = 1:
    every call equal to r = 1's (fp64), every rank runs the same degree at every call and climbs alike (one
    search: the same input each call, so the same grid key), the pick is best_probe of the agreed times."""
    spec = VerifySpec(world=WORLD, ranks_per_node=2, k=k, drop=drop, tokens=16, schedule="baseline", ep=4,
                      exchange="ragged")
    costs = PipeCosts(alpha_a=2e-5, beta_a=4e-6, alpha_e=5e-5, beta_e=1e-6)
    res = world(WORLD).run(tuned_layer, spec, {"ep": costs}, 20)
    first = res[0]
    assert all(r["degrees"] == first["degrees"] and r["climbs"] == first["climbs"] for r in res)
    assert max(r["max_diff"] for r in res) <= 1e-12
    start, times, decided = first["climbs"][True]
    assert decided is not None and len(first["climbs"]) == 2          # one training key, one forward-only key
    order, replay = climb(start, first["r_max"][True], times.get)
    assert replay == times and decided == best_probe(times) == first["decisions"][True]
    assert first["degrees"][:3 * len(order)] == [r for r in order for _ in range(3)]
    assert set(first["degrees"][3 * len(order):]) == {decided}


@pytest.mark.parametrize("word", ["auto", "tune"])
def test_hecate_with_a_degree_word_equals_the_reference_and_the_ragged_baseline(world, word):
    """Hecate priced by its copies' split (every rank's rows to and from the copies, agreed): one call per
    case, the degree the word picks from a lean profile; outputs and gradients equal the ragged baseline's at
    degree 1 (<= 1e-9) and the reference; every rank ran the same chunks; some case pipelined."""
    policy = (TunedDegree if word == "tune" else AutoDegree)(costs={"ep": LEAN_COSTS})
    results = world(WORLD).run(hecate_one_call, CHUNKED, "auto", policy)
    chunks_run = [check_chunked_call(spec, [r[i] for r in results]) for i, spec in enumerate(CHUNKED)]
    assert max(chunks_run) > 1, chunks_run


def test_deepspeed_training_with_ragged_auto_equals_stock(world, tmp_path):
    """The DeepSpeed adapter with ``{"exchange": "ragged", "pipeline_degree": "auto"}`` (EP 4, top-2, ZeRO 2, a
    lean profile cached for the layout): 20 steps with the losses of stock DeepSpeed (1e-5)."""
    pytest.importorskip("deepspeed")
    from tests.workers import deepspeed as ds_jobs
    models = {key: LinearModel(alpha=LEAN[op][0], beta=LEAN[op][1], unit="mac" if op == "gemm" else "byte")
              for key, op in MODEL_KEYS.items()}
    key = VerifySpec(world=WORLD, ranks_per_node=4, ep=4).profile_key()      # the adapter's layout: one node
    CostProfile(key=key, dtype="float32", models=models, source="synthetic lean").save(cache_path(tmp_path, key))
    plugin = {"schedule": "baseline", "exchange": "ragged", "pipeline_degree": "auto"}
    results = world(WORLD).run(ds_jobs.train_with_cache, str(tmp_path), 2, plugin, 4, 2, 0, 20)
    for rank, res in enumerate(results):
        off, on = res["off"]["losses"], res["on"]["losses"]
        assert len(off) == len(on) == 20
        assert max(abs(a - b) / abs(a) for a, b in zip(off, on)) <= 1e-5, rank
    log = results[0]["on"]["log"]
    assert any("runs schedule 'baseline', ragged exchange, pipeline_degree auto" in line for line in log), log
