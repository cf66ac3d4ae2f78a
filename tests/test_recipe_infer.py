"""``python -m moe_plugins.recipes.infer`` (issue #24) on a checkpoint the DeepSpeed recipe trains for two steps
on one rank: 4 gloo ranks with the plugin's baseline at EP 4 and the synthetic skew, and 2 stock ranks with the
balanced (ideal) gate; the report's numbers must be measurements (tests/infer_checks.py) and the knobs visible in
the routing. Bad flags are refused before anything starts."""

from __future__ import annotations

import numpy as np
import pytest

from moe_plugins.recipes import infer
from tests.infer_checks import CONFIG, SEQ, check_measured, run_infer


def test_plugin_baseline_with_skew_on_four_ranks(recipe_checkpoint, tmp_path):
    report, stdout = run_infer(recipe_checkpoint, tmp_path / "out", 4, "--skew", "40")
    check_measured(report, 4)
    assert report["meta"]["ep"] == 4 and report["meta"]["capacity_factor"] == "dropless"
    assert [s["schedule"] for s in report["meta"]["plugin"]] == ["baseline", "baseline"]
    assert {layer["exchange_source"] for layer in report["layers"]} == {"plugin ledger (all_to_all ops)"}
    assert report["lina"] is None
    for j, layer in enumerate(report["layers"]):          # layer j favours expert j mod 4
        assert int(np.argmax(layer["tokens_per_expert"])) == j % 4 and layer["busiest_share"] > 0.9
    assert (tmp_path / "out" / "latency_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "latency per batch (3 batches, slowest rank): p50" in stdout


def test_stock_with_the_balanced_gate_on_two_ranks(recipe_checkpoint, tmp_path):
    even, _ = run_infer(recipe_checkpoint, tmp_path / "even", 2, "--no-plugins", "--gate", "balanced")
    check_measured(even, 2)
    assert even["meta"]["plugin"] is None and even["meta"]["gate"] == "balanced"
    for layer in even["layers"]:
        assert layer["tokens_per_expert"] == [3 * 2 * 2 * SEQ // 4] * 4 and layer["busiest_share"] == 0.25
        assert layer["exchange_source"] == "DeepSpeed MOELayer all-to-all timers"


def test_bad_flags_are_named_before_anything_starts(tmp_path):
    bad_config = tmp_path / "bad.json"
    bad_config.write_text("[1, 2]")
    args = infer.parse_args(["--ckpt-dir", str(tmp_path / "none"), "--ds-config", str(bad_config), "--batches", "0",
                             "--capacity-factor", "-1", "--skew", "2", "--gate", "balanced"])
    text = "; ".join(infer.arg_problems(args))
    for part in ("--batches (0) must be an integer >= 1", "--capacity-factor (-1.0) must be 0 (dropless)",
                 "--skew (2.0) has no effect with --gate balanced", f"--ckpt-dir ({str(tmp_path / 'none')!r}) is "
                 "not a folder", f"--ds-config ({str(bad_config)!r}) must hold a JSON object, not list"):
        assert part in text
    (tmp_path / "empty").mkdir()
    args = infer.parse_args(["--ckpt-dir", str(tmp_path / "empty"), "--ds-config", str(tmp_path / "missing.json")])
    text = "; ".join(infer.arg_problems(args))
    assert "has no `latest` file" in text and "--ds-config" in text and "cannot be read" in text
    with pytest.raises(SystemExit, match="moe_plugins.recipes.infer: --ckpt-dir"):
        infer.main(["--ckpt-dir", str(tmp_path / "none"), "--ds-config", str(CONFIG)])
    assert infer.ep_problem(3, 4, 4) == ("--ep (3) must divide the world size (4) and the experts per layer (4); "
                                         "allowed: [1, 2, 4]")
    assert infer.ep_problem(2, 4, 4) is None
