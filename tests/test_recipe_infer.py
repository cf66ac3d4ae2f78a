"""``python -m moe_plugins.recipes.infer`` (issue #24) on a checkpoint the DeepSpeed recipe trains for two steps
on one rank: 4 gloo ranks with the plugin's baseline at EP 4, and 2 stock ranks with the balanced (ideal) gate
and with the synthetic skew. The report's numbers must be measurements: every token counted once, percentiles
those of the per-batch times, exchange times inside layer times, the knobs visible in the routing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_plugins.recipes import infer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "gpt2_moe_tiny.json"
TRAIN_CHARS = 20_000
SEQ = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("deepspeed")
    tmp = tmp_path_factory.mktemp("infer")
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
             "-m", "moe_plugins.recipes.train_deepspeed", "--ds-config", str(CONFIG), "--max-chars", str(TRAIN_CHARS),
             "--ep", "1", "--steps", "2", "--ckpt-dir", str(tmp / "ckpt"), "--save-every", "2", "--out", str(tmp / "run")]
    done = subprocess.run(train, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp / "ckpt"


def run_infer(ckpt, out, ranks, *flags, config=CONFIG):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "moe_plugins.recipes.infer", "--ckpt-dir", str(ckpt), "--ds-config", str(config),
           "--skip-chars", str(TRAIN_CHARS), "--batches", "3", "--batch-size", "2", "--warmup", "1",
           "--out", str(out), "--no-progress", *flags]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "report.json").read_text()), done.stdout


def check_measured(report, ranks):
    lat = np.asarray(report["latency_ms"])
    assert report["n"] == lat.size == 3 and (lat > 0).all()
    for key, q in (("p50_ms", 50), ("p95_ms", 95), ("p99_ms", 99)):
        assert report[key] == pytest.approx(float(np.percentile(lat, q)))
    assert report["p50_ms"] <= report["p95_ms"] <= report["p99_ms"] <= lat.max()
    assert len(report["layers"]) == 2
    for layer in report["layers"]:
        assert sum(layer["tokens_per_expert"]) == 3 * ranks * 2 * SEQ          # every token, once per layer
        assert 0 < layer["exchange_p95_ms"] <= layer["layer_p95_ms"]         # the exchange is part of the layer
        assert 0.25 <= layer["busiest_share"] <= 1
    assert report["skew"]["busiest_share"] == max(layer["busiest_share"] for layer in report["layers"])


def test_plugin_baseline_on_four_ranks(ckpt, tmp_path):
    report, stdout = run_infer(ckpt, tmp_path / "out", 4)
    check_measured(report, 4)
    assert report["meta"]["ep"] == 4 and report["meta"]["capacity_factor"] == "dropless"
    assert [s["schedule"] for s in report["meta"]["plugin"]] == ["baseline", "baseline"]
    assert {layer["exchange_source"] for layer in report["layers"]} == {"plugin ledger (all_to_all ops)"}
    assert report["lina"] is None
    assert (tmp_path / "out" / "latency_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "latency per batch (3 batches, slowest rank): p50" in stdout


def test_stock_balanced_gate_and_skew(ckpt, tmp_path):
    even, _ = run_infer(ckpt, tmp_path / "even", 2, "--no-plugins", "--gate", "balanced")
    check_measured(even, 2)
    assert even["meta"]["plugin"] is None
    for layer in even["layers"]:
        assert layer["tokens_per_expert"] == [3 * 2 * 2 * SEQ // 4] * 4 and layer["busiest_share"] == 0.25
        assert layer["exchange_source"] == "DeepSpeed MOELayer all-to-all timers"
    skewed, _ = run_infer(ckpt, tmp_path / "skew", 2, "--no-plugins", "--skew", "40")
    check_measured(skewed, 2)
    for j, layer in enumerate(skewed["layers"]):          # layer j favours expert j mod 4
        assert int(np.argmax(layer["tokens_per_expert"])) == j % 4 and layer["busiest_share"] > 0.9


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
