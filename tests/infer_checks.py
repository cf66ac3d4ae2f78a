"""Shared by the inference recipe's tests (tests/test_recipe_infer*.py): a checkpoint of the DeepSpeed recipe
(two steps on one rank), a torchrun of ``moe_plugins.recipes.infer`` and the checks that its report holds
measurements: every token counted once per layer, the percentiles those of the per-batch times, each layer's
exchange time inside its wall time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "gpt2_moe_tiny.json"
TRAIN_CHARS = 20_000
SEQ = 64
BATCHES, BATCH_SIZE = 3, 2


def train_checkpoint(folder: Path) -> Path:
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
             "-m", "moe_plugins.recipes.train_deepspeed", "--ds-config", str(CONFIG), "--max-chars", str(TRAIN_CHARS),
             "--ep", "1", "--steps", "2", "--ckpt-dir", str(folder / "ckpt"), "--save-every", "2",
             "--out", str(folder / "run")]
    done = subprocess.run(train, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder / "ckpt"


def run_infer(ckpt, out, ranks, *flags, config=CONFIG, skip_chars=TRAIN_CHARS):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "moe_plugins.recipes.infer", "--ckpt-dir", str(ckpt), "--ds-config", str(config),
           "--skip-chars", str(skip_chars), "--batches", str(BATCHES), "--batch-size", str(BATCH_SIZE),
           "--warmup", "1", "--out", str(out), "--no-progress", *flags]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((Path(out) / "report.json").read_text()), done.stdout


def check_measured(report, ranks):
    lat = np.asarray(report["latency_ms"])
    assert report["n"] == lat.size == BATCHES and (lat > 0).all()
    for key, q in (("p50_ms", 50), ("p95_ms", 95), ("p99_ms", 99)):
        assert report[key] == pytest.approx(float(np.percentile(lat, q)))
    assert report["p50_ms"] <= report["p95_ms"] <= report["p99_ms"] <= lat.max()
    assert len(report["layers"]) == 2
    for layer in report["layers"]:
        assert sum(layer["tokens_per_expert"]) == BATCHES * ranks * BATCH_SIZE * SEQ   # every token, once per layer
        assert 0 < layer["exchange_p95_ms"] <= layer["layer_p95_ms"]                  # the exchange is in the layer
        assert 0.25 <= layer["busiest_share"] <= 1
    assert report["skew"]["busiest_share"] == max(layer["busiest_share"] for layer in report["layers"])
