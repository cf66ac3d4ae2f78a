"""fp64 equivalence of every schedule with the single-process reference, on 4 gloo ranks (reused pool)."""

import pytest
import torch

from moe_plugins.core.layout import ParallelLayout, layout_problems
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify import VerifySpec, compare
from tests.workers.core import collect, verify_many

WORLD = 4


def valid_layouts(schedule):
    out = []
    for mp in (1, 2, 4):
        for ep, esp in ((1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)):
            if layout_problems(WORLD, 2, mp, ep, esp):
                continue
            if not default_registry().schedule_problems(schedule, ParallelLayout(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp)):
                out.append((mp, ep, esp))
    return out


def _check(reports):
    bad = [(r["spec"], {k: r[k] for k in ("max_err_out", "max_err_grad_in", "max_err_grad_w", "max_err_aux",
                                           "routing_equal")}) for r in reports if not r["ok"]]
    assert not bad, bad


@pytest.mark.parametrize("schedule", ["baseline", "baseline-tp"])
@pytest.mark.parametrize("drop", [True, False], ids=["drop", "dropless"])
def test_every_valid_layout_exact_fp64(world, schedule, drop):
    specs = [VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=k, drop=drop, schedule=schedule,
                        experts=4, tokens=12, capacity_factor=1.0, seed=7 + k)
             for mp, ep, esp in valid_layouts(schedule) for k in (1, 2)]
    assert len(specs) >= (36 if schedule == "baseline" else 16)
    reports = world(WORLD).run(verify_many, specs)[0]
    _check(reports)
    if drop:   # the drop runs really dropped tokens, so drop handling was exercised
        assert sum(r["dropped_routes"] for r in reports) > 0


@pytest.mark.parametrize("schedule", ["baseline", "baseline-tp"])
def test_edge_cases(world, schedule):
    specs = [
        # all tokens routed to expert 0: ranks holding other experts receive nothing, heavy dropping
        VerifySpec(world=WORLD, ranks_per_node=2, mp=2, ep=2, esp=2, k=2, skew=20.0, schedule=schedule),
        VerifySpec(world=WORLD, ranks_per_node=2, mp=1, ep=4, esp=1, k=1, skew=20.0, schedule=schedule),
        VerifySpec(world=WORLD, ranks_per_node=2, mp=1, ep=4, esp=1, k=1, skew=20.0, drop=False, schedule=schedule),
        # an input of one token
        VerifySpec(world=WORLD, ranks_per_node=2, mp=2, ep=2, esp=2, k=2, tokens=1, schedule=schedule),
        VerifySpec(world=WORLD, ranks_per_node=2, mp=1, ep=4, esp=1, k=1, tokens=1, drop=False, schedule=schedule),
        # capacity chunks: more chunks than slots, uneven chunks
        VerifySpec(world=WORLD, ranks_per_node=2, mp=2, ep=2, esp=2, k=2, pipeline_degree=3, schedule=schedule),
        VerifySpec(world=WORLD, ranks_per_node=2, mp=2, ep=2, esp=2, k=1, tokens=2, pipeline_degree=8,
                   schedule=schedule),
    ]
    reports = world(WORLD).run(verify_many, specs)[0]
    _check(reports)
    skewed = reports[1]
    assert skewed["dropped_routes"] > 0


def test_float32_within_tolerance(world):
    reports = world(WORLD).run(verify_many, [VerifySpec(world=WORLD, ranks_per_node=2, mp=2, ep=2, esp=2, k=2,
                                                        dtype="float32")])[0]
    _check(reports)


@pytest.mark.parametrize("field, index, tensor", [("y", 1, None), ("grad_x", 2, None), ("grad_wg", 3, None),
                                                   ("grad_experts", 0, 2), ("aux", 1, None)])
def test_compare_detects_a_wrong_result(world, field, index, tensor):
    """The checker is not vacuous: corrupt one rank's result slightly and it must report a mismatch."""
    spec = VerifySpec(world=WORLD, ranks_per_node=2, mp=2, ep=2, esp=2, k=2)
    ranks = world(WORLD).run(collect, spec)[0]
    assert compare(spec, ranks)["ok"]
    target = ranks[index][field] if tensor is None else ranks[index][field][tensor]
    target.view(-1)[0] += 1e-6
    assert not compare(spec, ranks)["ok"]


def test_compare_detects_wrong_drops(world):
    spec = VerifySpec(world=WORLD, ranks_per_node=2, mp=1, ep=4, esp=1, k=1)
    ranks = world(WORLD).run(collect, spec)[0]
    ranks[0]["dropped"] += 1
    report = compare(spec, ranks)
    assert not report["ok"] and not report["routing_equal"]


def test_duplicate_mp_replicas_without_normalisation_would_be_wrong(world):
    """Guards the 1/N_MP gradient normalisation of the baseline: the unnormalised sum over expert-DP replicas
    of an MP=2 run is twice the reference, and the normalised one equals it."""
    spec = VerifySpec(world=WORLD, ranks_per_node=2, mp=2, ep=2, esp=1, k=1)
    ranks = world(WORLD).run(collect, spec)[0]
    assert compare(spec, ranks)["ok"]
    for r in ranks:
        r["grad_experts"] = [g * 2 for g in r["grad_experts"]]
    assert compare(spec, ranks)["max_err_grad_w"] > 1e-6
