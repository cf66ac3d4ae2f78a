"""The DeepSpeed recipes end to end on 4 gloo ranks: plugin on equals plugin off, and a run killed with
SIGKILL resumes from its last checkpoint and reproduces the same losses."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "gpt2_moe_tiny.json"


def torchrun(args, out, **popen):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "moe_plugins.recipes.train_deepspeed", "--ds-config", str(CONFIG), "--max-chars", "120000",
           "--out", str(out), *args]
    log = open(Path(out).parent / f"{Path(out).name}.log", "a")      # a file: a full pipe would stall the job
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)


def losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(out) / "steps.jsonl").read_text().splitlines())}


def kill_tree(proc):
    """SIGKILL torchrun and every worker: torch elastic starts workers in sessions of their own, so killing
    torchrun's process group alone would leave them training."""
    procs = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    for p in procs:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    proc.wait()


def finish(proc, timeout=600):
    proc.wait(timeout=timeout)
    assert proc.returncode == 0, f"training failed; see {proc.args[proc.args.index('--out') + 1]}.log"


@pytest.mark.parametrize("model", ["gpt2-moe", pytest.param("bert-moe", marks=pytest.mark.full(
    covered_by="test_lancet_blocks_deepspeed.py::test_partitions_on_bert_equal_stock (BERT-MoE through "
               "DeepSpeed, stock-equal losses), test_recipes_megatron.py::test_plugin_on_equals_off[bert-moe-*]"))])
def test_plugin_on_equals_off(tmp_path, model):
    steps = ["--model", model, "--steps", "20"]
    finish(torchrun(steps, tmp_path / "on"))
    finish(torchrun(steps + ["--no-plugins"], tmp_path / "off"))
    on, off = losses(tmp_path / "on"), losses(tmp_path / "off")
    assert sorted(on) == list(range(20)) and sorted(off) == list(range(20))
    for step in range(20):
        assert abs(on[step] - off[step]) <= 1e-5 * abs(off[step]), (step, on[step], off[step])
    report = json.loads((tmp_path / "on" / "report.json").read_text())
    assert [layer["schedule"] for layer in report["plugin"]] == ["baseline", "baseline"]
    assert (tmp_path / "on" / "report.png").stat().st_size > 0
    assert report["summary"]["last10_mean"] < report["summary"]["first10_mean"]


def test_kill_and_resume_reproduces_losses(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    args = ["--model", "gpt2-moe", "--steps", "16", "--ckpt-dir", str(ckpt), "--save-every", "4"]
    proc = torchrun(args, out)
    deadline = time.time() + 600
    # wait until the step-8 checkpoint is complete and two more steps have run, then kill -9 the whole job
    while time.time() < deadline and proc.poll() is None:
        done = losses(out) if (out / "steps.jsonl").exists() else {}
        if (ckpt / "latest").exists() and (ckpt / "latest").read_text().strip() == "step8" and 9 in done:
            break
        time.sleep(0.5)
    assert proc.poll() is None, "the run ended before it could be killed"
    kill_tree(proc)
    before = losses(out)
    assert 8 in before and 9 in before and 15 not in before
    latest = (ckpt / "latest").read_text().strip()
    start = int(latest[len("step"):])
    finish(torchrun(args, out))               # same command: resumes from ckpt/latest
    after = [json.loads(l) for l in (out / "steps.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in after[len(before):]}
    assert sorted(resumed) == list(range(start, 16))
    overlap = [s for s in before if s >= start]
    assert overlap, "no step ran both before the kill and after the resume"
    for step in overlap:
        assert resumed[step] == pytest.approx(before[step], rel=1e-6, abs=0), step


@pytest.mark.full(covered_by="test_lina_packing_deepspeed.py::test_packed_training_equals_stock_deepspeed "
                             "(deepspeed.initialize at ZeRO 0/1/2, 20 steps), "
                             "test_recipes_megatron.py::test_lina_packing_in_the_recipe_equals_unpacked_and_resumes_unpacked")
def test_lina_packing_in_the_recipe_equals_the_plugin_off(tmp_path):
    """The shipped tiny config (ZeRO 1) with ``"lina": {"packing": 2}`` at ``--ep 4``: the GPT-2-MoE's 4 experts
    per layer run 2 per rank (EP 2), and the 12 losses are those of the run without the plugin."""
    cfg = json.loads(CONFIG.read_text())
    cfg["moe_plugins"]["lina"] = {"packing": 2, "micro_op_mb": 1}
    packed = tmp_path / "packed.json"
    packed.write_text(json.dumps(cfg))
    steps = ["--steps", "12", "--ep", "4", "--ds-config", str(packed)]
    finish(torchrun(steps, tmp_path / "on"))
    finish(torchrun(steps + ["--no-plugins"], tmp_path / "off"))
    on, off = losses(tmp_path / "on"), losses(tmp_path / "off")
    assert sorted(on) == sorted(off) == list(range(12))
    assert all(abs(on[s] - off[s]) <= 1e-5 * abs(off[s]) for s in off), (on, off)
    report = json.loads((tmp_path / "on" / "report.json").read_text())
    assert [(r["ep"], r["lina_packing"], r["experts_per_rank"]) for r in report["plugin"]] == [(4, 2, 2)] * 2
    assert "Lina packing 2 (2 experts per rank)" in (tmp_path / "on.log").read_text()
