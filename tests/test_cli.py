"""The console script: bad input exits non-zero with one line naming the field and the values; a real run."""

import json
import subprocess
import sys

import pytest


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "moe_plugins.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--world", "6", "--ranks-per-node", "4"], "world (6) must be divisible by ranks_per_node (4)"),
    (["--world", "4", "--ep", "4", "--experts", "6"], "num_experts (6) must be divisible by ep (4)"),
    (["--world", "4", "--esp", "4", "--ffn", "10"], "ffn (10) must be divisible by esp (4)"),
    (["--world", "4", "--schedule", "fastest"], "schedule ('fastest') is unknown; allowed: baseline, baseline-tp"),
    (["--world", "4", "--mp", "2", "--esp", "4", "--schedule", "baseline-tp"], "needs esp (4) equal to 1 or to mp (2)"),
])
def test_bad_layout_is_one_line_error(args, message):
    proc = run_cli("verify", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("moe-plugins verify: error:")


def test_verify_json_end_to_end():
    proc = run_cli("verify", "--world", "4", "--mp", "2", "--ep", "2", "--esp", "2", "--k", "2", "--schedule",
                   "baseline", "--dtype", "float64", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    for key in ("max_err_out", "max_err_grad_in", "max_err_grad_w"):
        assert report[key] <= 1e-9
    assert "forward:all_to_all@ep" in report["ledger"]["moe"]
