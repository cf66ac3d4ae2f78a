"""The inference latency bench's report (issue #24): the bench format (``groups[].rows[name]`` with p50/p95/p99,
skew, accuracy), the targets, the format check, the rows' ds_configs; and the committed run, when there is one,
is well formed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moe_plugins.tools.bench.lina_infer_rank import ROWS, row_ds_config, row_problems
from moe_plugins.tools.bench.lina_infer_report import make_group, markdown, report_problems, targets

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "benchmarks" / "results" / "lina-infer-2x2.json"


def row(times, busiest=0.4, lina=None):
    a = np.asarray(times, dtype=float)
    return {"p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)),
            "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()), "n": len(times),
            "latency_ms": list(times), "layers": [{"layer": "l0", "exchange_p95_ms": 1.0, "layer_p95_ms": 2.0,
                                                   "busiest_share": busiest}],
            "skew": {"busiest_share": busiest, "busiest_share_batch_mean": busiest + 0.05, "even_share": 0.25},
            "lina": lina, "output_max_abs_diff_vs_deepspeed": 0.0}


LINA_STATS = {"accuracy": 0.6, "phase2_rate": 0.4, "estimate_accurate": 6, "estimate_total": 10}


def rows_for(ds, lina, ideal):
    return {"lina-infer": row(lina, lina=LINA_STATS), "deepspeed": row(ds), "ideal": row(ideal, busiest=0.25),
            "baseline": row(ds), "lina-infer-noest": row(lina, lina={**LINA_STATS, "accuracy": None})}


def test_group_has_the_bench_format_ratios_and_targets():
    g = make_group("real", "200mbit", rows_for(ds=[10, 10, 10, 30], lina=[9, 9, 9, 15], ideal=[8, 8, 8, 13]))
    assert list(g["rows"]) == list(ROWS)                 # the rows in the bench's order, whatever came first
    ds, lina = g["rows"]["deepspeed"], g["rows"]["lina-infer"]
    assert lina["p95_vs_deepspeed"] == pytest.approx(lina["p95_ms"] / ds["p95_ms"])
    assert g["skew"]["busiest_share"] == 0.4 and g["skew"]["per_layer"] == [0.4]    # the model's routing
    assert (g["accuracy"], g["phase2_rate"]) == (0.6, 0.4)
    met = {t["name"].split(" (")[0]: (t["met"], t["value"]) for t in g["targets"]}
    assert met["lina-infer p95 speed-up over deepspeed"] == (True, pytest.approx(ds["p95_ms"] / lina["p95_ms"]))
    assert met["lina-infer p95 over ideal p95"][0] is True
    assert met["lina-infer p50 over deepspeed p50"] == (True, pytest.approx(0.9))
    report = {"meta": {"title": "t", "header_lines": ["x"]}, "groups": [g]}
    assert report_problems(json.loads(json.dumps(report))) == []
    text = markdown(report)
    assert "## real, 200mbit" in text and "| lina-infer | 9.00 |" in text and "- met: lina-infer p95" in text


def test_missed_targets_are_reported_as_missed():
    t = {x["name"].split(" (")[0]: x for x in targets(rows_for(ds=[10] * 4, lina=[11] * 4, ideal=[5] * 4))}
    assert not t["lina-infer p95 speed-up over deepspeed"]["met"]
    assert not t["lina-infer p95 over ideal p95"]["met"] and t["lina-infer p95 over ideal p95"]["value"] == 2.2
    assert not t["lina-infer p50 over deepspeed p50"]["met"]
    assert "**MISSED**" in markdown({"meta": {}, "groups": [make_group("real", "1gbit", rows_for(
        ds=[10] * 4, lina=[11] * 4, ideal=[5] * 4))]})
    assert targets({"deepspeed": row([1, 2])}) == []             # no lina row: nothing to judge


def test_format_check_names_every_problem():
    g = make_group("real", "1gbit", rows_for(ds=[10, 12], lina=[9, 9], ideal=[8, 8]))
    del g["rows"]["deepspeed"]
    g["rows"]["baseline"]["p95_ms"] = float("nan")
    g["rows"]["ideal"]["p50_ms"] = 100.0
    g["rows"]["lina-infer"]["lina"] = None
    g["rows"]["lina-infer-noest"]["latency_ms"] = [1.0]
    g["rows"]["tutel"] = row([1, 2])
    del g["skew"]
    text = "; ".join(report_problems({"meta": {}, "groups": [g]}))
    for part in ("groups[0].skew is missing", "groups[0].rows has no 'deepspeed' row",
                 "rows['baseline']: p95_ms must be finite numbers", "rows['ideal']: needs 0 < p50_ms <= p95_ms",
                 "rows['lina-infer']: lina (Lina's own figures) must be an object",
                 "rows['lina-infer-noest']: latency_ms must hold n (2)", "rows['tutel']: unknown row"):
        assert part in text
    assert report_problems({"groups": []}) == ["the report must be an object with a non-empty list 'groups'"]


def test_rows_and_their_configs():
    assert "moe_plugins" not in row_ds_config("deepspeed", 8) and "moe_plugins" not in row_ds_config("ideal", 8)
    assert row_ds_config("baseline", 8)["moe_plugins"] == {"schedule": "baseline"}
    lina = row_ds_config("lina-infer", 8, {"table": "/t.json", "start_layer": 1})["moe_plugins"]["lina"]["inference"]
    assert lina == {"table": "/t.json", "start_layer": 1, "max_experts_per_device": 4, "estimation": True}
    noest = row_ds_config("lina-infer-noest", 8, {"table": "/t.json", "start_layer": 1})
    assert noest["moe_plugins"]["lina"]["inference"]["estimation"] is False
    with pytest.raises(ValueError, match="row 'lina-infer' needs the popularity table"):
        row_ds_config("lina-infer", 8)
    assert row_problems(["baseline", "baseline", "tutel"]) == [
        "row 'tutel' is unknown; allowed: deepspeed, ideal, baseline, lina-infer, lina-infer-noest",
        "row 'baseline' is listed twice", "rows must include 'deepspeed' (the reference of the targets and the "
        "output check)"]


@pytest.mark.skipif(not COMMITTED.exists(), reason="no committed lina-infer run yet")
def test_the_committed_run_is_well_formed():
    report = json.loads(COMMITTED.read_text())
    assert report_problems(report) == []
    assert {g["rate"] for g in report["groups"]} >= {"200mbit", "1gbit"}
    for g in report["groups"]:
        assert g["skew"]["busiest_share"] is not None
        for r in g["rows"].values():
            assert r["p50_ms"] == pytest.approx(float(np.percentile(r["latency_ms"], 50)))
