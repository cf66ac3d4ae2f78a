"""``python -m moe_plugins.recipes.infer`` with Lina's inference schedule (issue #24): a checkpoint the recipe
trains for two steps, its popularity table from ``moe-plugins lina-profile``, then 4 gloo ranks with estimation
and 2 without (phase 2 only), on text after the profiled part. The report takes each layer's exchange times from
Lina's ``inference_stats`` and states its estimation accuracy and phase-2 re-plans, which must add up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.infer_checks import BATCHES, ROOT, TRAIN_CHARS, check_measured, run_infer

PROFILE_CHARS = 12_000


@pytest.fixture(scope="module")
def setup(tmp_path_factory, recipe_checkpoint):
    tmp, ckpt = tmp_path_factory.mktemp("infer-lina"), recipe_checkpoint
    table = tmp / "table.json"
    cli = [sys.executable, "-m", "moe_plugins.tools.cli", "lina-profile", "--ckpt-dir", str(ckpt), "--skip-chars",
           str(TRAIN_CHARS), "--chars", str(PROFILE_CHARS), "--batch-size", "4", "--out", str(table)]
    done = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp, ckpt, table


def lina_config(folder, table, estimation):
    path = folder / f"lina-{estimation}.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
                                "moe_plugins": {"schedule": "baseline", "lina": {"inference": {
                                    "table": str(table), "start_layer": 1, "max_experts_per_device": 4,
                                    "estimation": estimation}}}}))
    return path


def test_lina_inference_with_and_without_estimation(setup, tmp_path):
    folder, ckpt, table = setup
    skip = TRAIN_CHARS + PROFILE_CHARS                  # after the profiled text
    report, stdout = run_infer(ckpt, tmp_path / "est", 4, config=lina_config(folder, table, True), skip_chars=skip)
    check_measured(report, 4)
    assert {layer["exchange_source"] for layer in report["layers"]} == {"lina inference_stats"}
    lina = report["lina"]
    assert lina["layer_batches"] == 2 * BATCHES                    # both swapped layers, every timed batch
    assert lina["estimate_total"] == BATCHES                       # layer 1 only (start_layer 1)
    assert lina["estimate_accurate"] + lina["phase2_replans"] == BATCHES   # phase 2 acts exactly when wrong
    assert lina["accuracy"] == pytest.approx(lina["estimate_accurate"] / BATCHES)
    assert [s["batches"] for s in lina["per_layer"]] == [BATCHES, BATCHES]
    assert "Lina: estimation accuracy" in stdout

    report, _ = run_infer(ckpt, tmp_path / "noest", 2, config=lina_config(folder, table, False), skip_chars=skip)
    check_measured(report, 2)
    lina = report["lina"]
    assert lina["estimate_total"] == 0 and lina["accuracy"] is None
    assert lina["phase2_replans"] == BATCHES                       # without estimation layer 1 plans every batch
