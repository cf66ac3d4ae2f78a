"""The Megatron-core recipe (issue 8): GPT-2-MoE and BERT-MoE through Megatron-core's MoE layers, parallel state,
DistributedDataParallel and optimizer on 4 gloo ranks (the ``world`` pool, CPU shims on). Plugin on equals
plugin off over 20 fp32 steps, and a resumed run reproduces the losses of the run it continues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_plugins.tools.pool import WorkerError

pytest.importorskip("megatron.core")

from moe_plugins.recipes import models  # noqa: E402
from moe_plugins.recipes.train_megatron import main, parse_args, run_problems  # noqa: E402
from tests.workers.recipes_megatron import train_job                     # noqa: E402

WORLD = 4
JOB_TIMEOUT_S = 900         # the first job imports Megatron and transformers on every rank of 2 busy cores
COMMON = ["--cpu-shims", "--size", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--max-chars", "60000"]
PLUGIN = ["--moe-plugins", '{"schedule": "baseline"}']


def train(world, argv):
    return world(WORLD).run(train_job, COMMON + argv, timeout_s=JOB_TIMEOUT_S)[0]


def losses(report):
    return {s["step"]: s["loss"] for s in report["steps"]}


# ---- checks at the boundary (no processes) -------------------------------------------------------------------

def test_bad_runs_list_every_problem():
    args = parse_args(["--tp", "3", "--ep", "3", "--etp", "2", "--save-every", "5", "--clip-grad", "1",
                       "--cpu-shims"])
    problems = "; ".join(run_problems(args, models.SIZES["tiny"], world=4, ranks_per_node=4, cuda=False))
    for message in ("--clip-grad (1.0) must be 0 with --cpu-shims", "world (4) must be divisible by mp (3)",
                    "world (4) must be divisible by ep*esp (3*2=6)", "heads of --size tiny (4) must be divisible by --tp (3)",
                    "experts of --size tiny (4) must be divisible by --ep (3)", "--save-every (5) needs --ckpt-dir"):
        assert message in problems


def test_no_gpu_needs_the_explicit_cpu_shims_flag(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device: Megatron-core has no CPU path; pass --cpu-shims"):
        main(["--ep", "1"])


def test_bad_plugin_section_is_refused_when_parsed():
    with pytest.raises(SystemExit):
        parse_args(["--moe-plugins", '{"schedule": "fastest"}'])


# ---- training on 4 gloo ranks ----------------------------------------------------------------------------------

# The plugin's expert buffers hold rows in capacity-slot order, Megatron's in its permutation order, so the
# experts' GEMMs sum in another order and the gradients differ in the last bits (the outputs do not). Adam
# turns that into parameter differences of ~1e-7 from the first step, and the tiny BERT's trajectory grows
# them: at lr 2e-3 on one 2-core machine the losses parted by 2e-5 at step 13 and 9e-5 at step 16; at lr 1e-3
# they stay within 1e-7. The BERT case runs at 1e-3 so that the 1e-5 check measures the plugin, not chaos.
@pytest.mark.parametrize("model, layout", [
    ("gpt2-moe", ["--tp", "2", "--ep", "2", "--etp", "1"]),                 # TP 2: the MoE layer runs sequence parallel
    ("bert-moe", ["--tp", "1", "--ep", "2", "--etp", "2", "--lr", "1e-3"]),  # expert-TP 2
])
def test_plugin_on_equals_off(world, tmp_path, model, layout):
    argv = ["--model", model, "--steps", "20", *layout]
    on = train(world, argv + PLUGIN + ["--out", str(tmp_path / "on")])
    off = train(world, argv + ["--out", str(tmp_path / "off")])
    a, b = losses(on), losses(off)
    assert sorted(a) == list(range(20)) and sorted(b) == list(range(20))
    for step in range(20):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(b[step]), (step, a[step], b[step])
    tp, ep, etp = (int(layout[i]) for i in (1, 3, 5))
    assert [(r["schedule"], r["mp"], r["ep"], r["esp"]) for r in on["plugin"]] == [("baseline", tp, ep, etp)] * 2
    assert [r["exchange"] for r in on["plugin"]] == ["ragged"] * 2     # Megatron's default where the section names none
    assert off["plugin"] is None
    assert on["summary"]["last10_mean"] < on["summary"]["first10_mean"]
    written = [json.loads(line) for line in (tmp_path / "on" / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == list(range(20))
    assert (tmp_path / "on" / "report.png").stat().st_size > 0


def test_resume_reproduces_losses(world, tmp_path):
    """A run checkpoints at steps 6 and 12; pointing ``latest`` back at step 6 stands for a run killed after that
    checkpoint. Resuming replays steps 6-11 with the losses of the first run; another layout is refused."""
    ckpt = tmp_path / "ckpt"

    def argv(ep, etp, *more):
        return ["--model", "gpt2-moe", "--steps", "12", "--ep", str(ep), "--etp", str(etp), "--ckpt-dir", str(ckpt),
                *PLUGIN, *more]
    first = losses(train(world, argv(2, 2, "--save-every", "6", "--out", str(tmp_path / "first"))))
    assert (ckpt / "latest").read_text().strip() == "step12"
    assert sorted(p.name for p in (ckpt / "step6").iterdir()) == [f"rank{r:05d}.pt" for r in range(WORLD)]
    (ckpt / "latest").write_text("step6\n")
    resumed = losses(train(world, argv(2, 2, "--resume", "--out", str(tmp_path / "resumed"))))
    assert sorted(resumed) == list(range(6, 12))
    for step in range(6, 12):
        assert resumed[step] == pytest.approx(first[step], rel=1e-6, abs=0), step
    with pytest.raises(WorkerError, match=r"saved by another run: ep \(2 in the checkpoint, 4 now\); etp \(2"):
        train(world, argv(4, 1, "--resume", "--out", str(tmp_path / "other")))


@pytest.mark.full(covered_by="test_lina_packing_in_the_recipe_equals_unpacked_and_resumes_unpacked (a lina section "
                             "through the recipe's flag, its micro-ops on Megatron's DDP), "
                             "tests/test_lina_megatron.py (Lina on against off, overlap_grad_reduce)")
def test_lina_in_the_recipe_equals_the_plugin_without_it(world, tmp_path):
    """The recipe's flag with a lina section: Megatron's DDP (overlap_grad_reduce, which lina turns on) reduces
    the dense and expert buckets as Lina's micro-ops; 12 fp32 steps match the plugin without lina on the same
    overlapped DDP within 1e-5 relative."""
    argv = ["--model", "gpt2-moe", "--steps", "12", "--tp", "1", "--ep", "2", "--etp", "1"]
    lina = train(world, argv + ["--moe-plugins", '{"schedule": "baseline", "lina": {"micro_op_mb": 0.25}}',
                                "--out", str(tmp_path / "lina")])
    plain = train(world, argv + PLUGIN + ["--overlap-grad-reduce", "--out", str(tmp_path / "plain")])
    a, b = losses(lina), losses(plain)
    assert sorted(a) == list(range(12)) == sorted(b)
    for step in range(12):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(b[step]), (step, a[step], b[step])
    assert lina["moe_plugins"]["lina"] == {"micro_op_mb": 0.25}
    assert [r["schedule"] for r in lina["plugin"]] == ["baseline"] * 2


def test_lina_packing_in_the_recipe_equals_unpacked_and_resumes_unpacked(world, tmp_path):
    """Lina's packing 2 at EP 4 (two experts per rank, expert-DP 2) through the recipe's flag: 8 fp32 steps match
    the unpacked Lina run within 1e-5 relative; its checkpoints (written with the experts unpacked) resume an
    unpacked run at step 4 with the packed run's losses."""
    ckpt = tmp_path / "ckpt"
    argv = ["--model", "gpt2-moe", "--steps", "8", "--tp", "1", "--ep", "4", "--etp", "1", "--ckpt-dir", str(ckpt)]

    def section(packing):
        return ["--moe-plugins", json.dumps({"schedule": "baseline", "lina": {"micro_op_mb": 0.25,
                                                                             "packing": packing}})]
    packed = train(world, argv + section(2) + ["--save-every", "4", "--out", str(tmp_path / "packed")])
    # packed at DDP build, then unpacked and packed again around each of the 2 saves
    assert packed["lina_packing"] == [{"packing": 2, "regroups": 1 + 2 * 2, "decisions": []}]
    assert [r["ep"] for r in packed["plugin"]] == [2, 2]                  # the layers run on ep 4 / 2
    unpacked = train(world, argv + section(1) + ["--out", str(tmp_path / "unpacked")])
    a, b = losses(packed), losses(unpacked)
    assert sorted(a) == list(range(8)) == sorted(b)
    for step in range(8):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(b[step]), (step, a[step], b[step])
    (ckpt / "latest").write_text("step4\n")
    resumed = losses(train(world, argv + section(1) + ["--resume", "--out", str(tmp_path / "resumed")]))
    assert sorted(resumed) == list(range(4, 8))
    for step in range(4, 8):
        assert resumed[step] == pytest.approx(a[step], rel=1e-5, abs=0), step


def on_equals_stock(world, tmp_path, layout, section: str):
    """12 fp32 steps of the recipe's GPT-2-MoE with the flag ``section`` and without the plugin, equal within 1e-5
    relative; returns the plugin run's report."""
    argv = ["--model", "gpt2-moe", "--steps", "12", *layout]
    on = train(world, argv + ["--moe-plugins", section, "--out", str(tmp_path / "on")])
    off = train(world, argv + ["--out", str(tmp_path / "stock")])
    a, b = losses(on), losses(off)
    assert sorted(a) == list(range(12)) == sorted(b)
    for step in range(12):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(b[step]), (step, a[step], b[step])
    return on


@pytest.mark.full(covered_by="test_hecate_resharding_in_the_recipe_equals_stock_megatron_and_resumes and "
                             "test_hecate_early_gather_in_the_recipe_equals_stock_megatron (an enabled hecate "
                             "section through the recipe's flag, equal to stock Megatron)")
def test_hecate_in_the_recipe_equals_stock_megatron(world, tmp_path):
    """The recipe's flag with an enabled hecate section (EP 4 on 2 emulated nodes: copies of the hot experts, spAG
    and spRS through Megatron's DDP) matches stock Megatron."""
    on = on_equals_stock(world, tmp_path, ["--tp", "1", "--ep", "4", "--etp", "1"],
                         '{"ranks_per_node": 2, "hecate": {"enabled": true}}')
    assert [(r["schedule"], r["exchange"]) for r in on["plugin"]] == [("hecate", "ragged")] * 2


def test_hecate_resharding_in_the_recipe_equals_stock_megatron_and_resumes(world, tmp_path):
    """Re-sharding every 2 steps (EP 4 on 2 emulated nodes): 12 steps equal stock Megatron's, Algorithm 2 run 6
    times, and resuming the per-rank checkpoint of step 6 replays steps 6-11 with the first run's losses. The
    recipe's routing here is mild and its experts small, so Algorithm 1 copies every loaded expert and the homes
    stay stock's (reported: ``hecate_reshard``); checkpoints written and read with the experts away from their
    stock owners are tested in tests/test_hecate_reshard_megatron.py."""
    ckpt = tmp_path / "ckpt"
    section = '{"ranks_per_node": 2, "hecate": {"enabled": true, "reshard_every": 2}}'
    layout = ["--tp", "1", "--ep", "4", "--etp", "1"]
    on = on_equals_stock(world, tmp_path, layout + ["--ckpt-dir", str(ckpt), "--save-every", "6"], section)
    report = on["hecate_reshard"]
    assert report["reshards"] == 6 and len(report["homes"]) == len(report["window_load"]) == 2
    (ckpt / "latest").write_text("step6\n")
    resumed = losses(train(world, ["--model", "gpt2-moe", "--steps", "12", *layout, "--ckpt-dir", str(ckpt),
                                   "--resume", "--moe-plugins", section, "--out", str(tmp_path / "resumed")]))
    first = losses(on)
    assert sorted(resumed) == list(range(6, 12))
    for step in range(6, 12):
        assert resumed[step] == pytest.approx(first[step], rel=1e-6, abs=0), step


def test_hecate_early_gather_in_the_recipe_equals_stock_megatron(world, tmp_path):
    """The recipe's flag with ``prefetch`` and ``rematerialize``: each HF GPT-2 block holding an MoE layer issues
    its spAG when it starts (``wrap_model``), the copies are freed after forward and gathered again early in
    backward (the first layer's when the second releases its copies), and 12 steps equal stock Megatron."""
    on = on_equals_stock(world, tmp_path, ["--tp", "1", "--ep", "4", "--etp", "1"],
                         '{"ranks_per_node": 2, "hecate": {"enabled": true, "prefetch": true, "rematerialize": true}}')
    assert on["hecate_early_blocks"] == 2
    assert on["hecate_regathers"] == [{"next_layer": 12}, {"own_output": 12}], on["hecate_regathers"]


def test_lancet_partitions_in_the_recipe_equal_stock_megatron(world, tmp_path):
    """The recipe's flag with Lancet's batch partitions at EP 2 x expert-DP 2 (the HF GPT-2 blocks handed to the
    executor by ``plugin_model_hooks``; the experts' dW deferred too) matches stock Megatron over 12 steps."""
    on = on_equals_stock(world, tmp_path, ["--tp", "1", "--ep", "2", "--etp", "1"],
                         '{"exchange": "padded", "lancet": {"partitions": 2}}')
    assert on["lancet_partitions"] == {"ranges": 12 * 2, "chosen": [2]}, on["lancet_partitions"]


def test_lancet_dense_wgrad_in_the_recipe_equals_stock_megatron(world, tmp_path):
    """The recipe's flag with Lancet's deferred expert and dense weight gradients at TP 2 x EP 2 (the recipe's
    dense layers are HF GPT-2's Conv1D, handed to Lancet by ``wrap_model``) matches stock Megatron."""
    on = on_equals_stock(world, tmp_path, ["--tp", "2", "--ep", "2", "--etp", "1"],
                         '{"lancet": {"defer_wgrad": true, "dense_wgrad": true}}')
    assert on["moe_plugins"]["lancet"] == {"defer_wgrad": True, "dense_wgrad": True}
    assert all(r["dense_wgrad_layers"] >= 4 for r in on["plugin"]), on["plugin"]   # attention and MLP Conv1Ds
