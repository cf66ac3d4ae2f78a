"""`pip install ".[deepspeed]"` into a fresh venv is enough for moe_plugins.enable() + deepspeed.initialize
(the [deepspeed] extra must not rely on packages that only [all] brings, as scipy once did).

The venv is built once per run (pip's cache makes it take about a minute or two) and nothing else is in it:
no --system-site-packages. Set MOE_PLUGINS_SKIP_PACKAGING=1 to skip it locally; CI runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.environ.get("MOE_PLUGINS_SKIP_PACKAGING") == "1",
                                reason="MOE_PLUGINS_SKIP_PACKAGING=1")


@pytest.fixture(scope="module")
def deepspeed_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("pkg") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-compile"]     # no .pyc for all of torch's files up front: what the test imports compiles as it runs
    proc = subprocess.run(pip + ["-c", str(ROOT / "requirements.lock"), f"{ROOT}[deepspeed]"],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return venv


def test_deepspeed_extra_is_enough_for_enable_and_initialize(deepspeed_venv, tmp_path):
    python = deepspeed_venv / "bin" / "python"
    have = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('matplotlib') is None, "
                           "u.find_spec('transformers') is None, u.find_spec('moe_plugins').origin)"],
                          capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    assert have[:2] == ["True", "True"], have                       # only the [deepspeed] extra is there
    assert str(ROOT) not in have[2], have                           # the installed copy, not the checkout
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(MASTER_PORT=str(29500 + os.getpid() % 1000), DS_ACCELERATOR="cpu")
    proc = subprocess.run([str(python), str(ROOT / "tests" / "packaging" / "deepspeed_one_rank.py")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["swapped_layers"] == 1 and result["active_after"] is False
    assert result["loss"] == result["loss"]                          # a number, not NaN
