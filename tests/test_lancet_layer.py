"""Lancet in the core MoE layer (moe_plugins/lancet/layer.py, the Recorder's ``while_in_flight`` hook in
moe_plugins/core/comm.py): on 4 gloo ranks in fp64, the baseline schedule at pipeline degree 1 and PipeMoE's 2,
top-1 and top-2 (balanced, and a skewed gate with drops): outputs, input, gate and expert gradients equal the
same layer without Lancet (<= 1e-12) and the single-process reference (``compare``); every parameter's
post-accumulate-grad hook fires once per backward; a second micro-step accumulates; the queue is empty after each
backward. From the recorded intervals, with rank 1 starting its exchanges late: the dW ran while the exchanges
were in flight (and not without a pipeline lane). Parm's schedules are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moe_plugins.lancet.overlap import hidden_fraction, overlap_fraction
from moe_plugins.tools.verify import VerifySpec, compare
from tests.workers.lancet_layer import callback_fails, one_call, overlap_run, refused

WORLD = 4
EXACT = 1e-12
SPEC = VerifySpec(world=WORLD, ranks_per_node=2, ep=4, experts=8, tokens=16, hidden=8, ffn=12)
CASES = [replace(SPEC, k=k, pipeline_degree=r, skew=skew, drop=True, capacity_factor=1.0 if skew else 2.0,
                 seed=11 + k + r)
         for r in (1, 2) for k in (1, 2) for skew in (0.0, 12.0)]
CASES.append(replace(SPEC, mp=1, ep=2, esp=2, k=2, skew=12.0, seed=5))       # ESP 2: the deferred GEMMs' partials


def _err(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def test_lancet_layer_is_exact_and_delivers_once(world):
    results = world(WORLD).run(one_call, CASES, timeout_s=300)
    drops = 0
    for i, spec in enumerate(CASES):
        ranks = [r[i] for r in results]
        for name in ("plain", "lancet"):
            report = compare(spec, [r[name] for r in ranks])
            assert report["routing_equal"], (spec, name)
            assert max(v for k, v in report.items() if k.startswith("max_err")) <= EXACT, (spec, name, report)
        drops += report["dropped_routes"]
        for r in ranks:
            p, q = r["plain"], r["lancet"]
            for key in ("y", "grad_x", "grad_wg", "y2", "grad_x2"):
                assert _err(p[key], q[key]) <= EXACT, (spec, key)
            for gp, gq in zip(p["grad_experts"], q["grad_experts"]):
                assert _err(gp, gq) <= EXACT, (spec, "grad_experts")
            for key, acc in r["accumulated"]["plain"].items():
                assert _err(acc, r["accumulated"]["lancet"][key]) <= EXACT, (spec, "accumulated", key)
            assert r["hooks"] == [dict.fromkeys(r["hooks"][0], 1), dict.fromkeys(r["hooks"][0], 2)], r["hooks"]
            assert r["queue_empty"] == [True, True] and r["outstanding"] == [0, 0]
            assert r["items_run"] == 2 * 2 * spec.pipeline_degree           # w1 and w2, per chunk, per micro-step
            if spec.pipeline_degree == 1:       # the dispatch-gradient exchange ran the layer's own dW
                assert r["overlap_calls"] == 2, r["overlap_calls"]
            else:                               # a chunk's stage in flight on the lane ran it (PipeMoE's _Fence)
                assert r["overlap_calls"] >= 2, r["overlap_calls"]
    assert drops > 0


@pytest.mark.parametrize("lane", [True, False], ids=["pipeline-lane", "inline"])
def test_dw_runs_while_the_exchange_is_in_flight(world, lane):
    delay = 0.25
    results = world(WORLD).run(overlap_run, replace(SPEC, k=2), delay, lane, timeout_s=300)
    for r in results:
        assert r["max_err"] <= EXACT and r["queue_empty"]
        tags = {tag for _, tag, *_ in r["spans"]}
        assert tags == {"dense", "experts.moe"}, tags
        if r["rank"] == 1:
            continue
        exchanges, issued = r["exchanges"], r["issued"]
        assert len(exchanges) == 2, exchanges                      # combine-gradient, dispatch-gradient
        combine, dispatch = sorted(issued)                         # from issue (queued on the lane) to end
        assert all(b - a >= 0.5 * delay * 1e9 for a, b in issued), issued  # the slow peer made them long
        spans = [(a, b) for _, _, a, b, _ in r["spans"]]
        dense = [(a, b) for _, tag, a, b, _ in r["spans"] if tag == "dense"]
        experts = [(a, b) for _, tag, a, b, _ in r["spans"] if tag != "dense"]
        if lane:
            # the later layer's dense dW behind the combine-gradient exchange, the own expert dW behind the dispatch's
            assert hidden_fraction([combine], dense) == 1.0, (combine, dense)
            assert hidden_fraction([dispatch], experts) == 1.0, (dispatch, experts)
            assert all(during for *_, during in r["spans"]), r["spans"]
            # (not asserted from the lane thread's start of the collective: on 2 shared cores that thread may get
            # the CPU only after the microseconds of dW have run)
            assert 0.0 < overlap_fraction(issued, spans) < 1.0
        else:
            assert hidden_fraction(exchanges, spans) == 0.0        # inline: nothing runs while it flies
            assert overlap_fraction(exchanges, spans) == 0.0


@pytest.mark.parametrize("schedule", ["parm-s2", "baseline-tp"])
def test_other_schedules_refused(world, schedule):
    spec = replace(SPEC, mp=2, ep=2, schedule=schedule)
    for message in world(WORLD).run(refused, spec):
        assert f"schedule ({schedule!r}) cannot run with Lancet: only 'baseline' in this version" in message


def test_a_failing_dw_surfaces_and_the_next_step_runs(world):
    for r in world(WORLD).run(callback_fails, SPEC, timeout_s=120):
        assert "dW failed" in r["message"]
        assert r["max_err"] <= EXACT and r["queue_empty"]
