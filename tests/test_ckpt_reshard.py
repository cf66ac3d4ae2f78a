"""DeepSpeed MoE checkpoints saved at EP 4 / world 4 and resumed at another size (issue #28, item 2).

Saved with ZeRO stage 0, with the plugin on or off, and loaded through ``moe_plugins.patches.deepspeed_reshard``
at world 2 / EP 2, world 1 / EP 1 and world 2 / EP 1, with the plugin on or off: every parameter and its Adam
state (named by global expert id) equals what was saved, bit for bit, and the losses of the next steps equal
those of the saving run going on uninterrupted (the data are the same per global batch and nothing in the loss
depends on how the batch is split; tests/workers/ckpt_reshard.py). ZeRO stage 1/2 state cannot be resharded:
refused before loading, naming both sizes. What DeepSpeed does alone is pinned down too, so that a DeepSpeed
upgrade that changes it shows up here. The recipe's resume goes through the same tool (one torchrun test).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from moe_plugins.patches.deepspeed_reshard import (Layout, check_resume, ep_from_expert_names, expert_owner,
                                                   expert_param_order, global_expert_id, read_saved_layout)
from tests.workers import ckpt_reshard as jobs

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[1]
PLUGIN = {"schedule": "baseline"}
STEPS, MORE = 3, 3
TARGETS = [(2, 2), (1, 1), (2, 1)]            # (world, ep) to load at


# ---- pure helpers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_experts,ep", [(4, 4), (4, 2), (4, 1), (8, 2), (6, 3)])
def test_expert_owner_and_global_id_are_inverse(num_experts, ep):
    seen = [expert_owner(g, num_experts, ep) for g in range(num_experts)]
    assert len(set(seen)) == num_experts and {r for r, _ in seen} == set(range(ep))
    assert [global_expert_id(r, j, num_experts, ep) for r, j in seen] == list(range(num_experts))


@pytest.mark.parametrize("call,field", [
    (lambda: expert_owner(4, 4, 2), "global_id"), (lambda: expert_owner(0, 4, 3), "ep (3) must divide"),
    (lambda: expert_owner(0, 0, 1), "num_experts"), (lambda: global_expert_id(2, 0, 4, 2), "ep_rank"),
    (lambda: global_expert_id(0, 2, 4, 2), "local"), (lambda: global_expert_id(0, 0, 4, 0), "ep (0)"),
    (lambda: expert_param_order(["inp.weight"], {}), "'inp.weight'"),
    (lambda: expert_param_order(["a.deepspeed_experts.0.w"], {"b.deepspeed_experts.": 1}), "no count"),
    (lambda: ep_from_expert_names(["a.deepspeed_experts.2.w"], 4), "do not divide")])
def test_bad_input_is_a_value_error_naming_it(call, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        call()


def test_expert_param_order_regrows_each_layer_to_the_asked_count():
    names = [f"m{l}.deepspeed_experts.{j}.{s}" for l in range(2) for j in range(2) for s in ("0.weight", "2.bias")]
    prefixes = {f"m{l}.deepspeed_experts.": 1 for l in range(2)}
    assert expert_param_order(names, {p: 2 for p in prefixes}) == names
    assert expert_param_order(names, prefixes) == [n for n in names if ".deepspeed_experts.0." in n]
    four = expert_param_order(names, {p: 4 for p in prefixes})
    assert len(four) == 16
    assert four[4:8] == [f"m0.deepspeed_experts.{j}.{s}" for j in (2, 3) for s in ("0.weight", "2.bias")]
    assert ep_from_expert_names(four, 8) == 2 and ep_from_expert_names(["inp.weight"], 8) is None


def layout(world: int, ep: int, stage: int = 0, half: bool = False) -> Layout:
    return Layout(world=world, dp=world, ep=ep, zero_stage=stage, num_experts=(4, 4), half=half)


def test_check_resume_accepts_what_reshards_and_names_both_sizes_otherwise():
    check_resume(layout(4, 4, 1), layout(4, 4, 1))              # unchanged: DeepSpeed's own load
    check_resume(layout(4, 2), layout(2, 2))                    # ZeRO 0, same EP: DeepSpeed's own load works
    check_resume(layout(4, 4), layout(2, 1))                    # ZeRO 0 fp32: resharded
    for saved, now, why in [(layout(4, 4, 1), layout(2, 2, 1), "ZeRO stage 1 partitions"),
                            (layout(4, 4, 2), layout(4, 2, 2), "ZeRO stage 2 partitions"),
                            (layout(4, 4, 0), layout(2, 2, 1), "resume with ZeRO stage 0"),
                            (layout(2, 2, 1), layout(2, 2, 0), "resume with ZeRO stage 1"),
                            (layout(4, 4, half=True), layout(2, 2), "only fp32"),
                            (layout(4, 4), Layout(2, 2, 2, 0, (8, 8), False), "experts per MoE layer")]:
        with pytest.raises(ValueError) as info:
            check_resume(saved, now)
        msg = str(info.value)
        assert why in msg and saved.describe() in msg and now.describe() in msg, msg


# ---- DeepSpeed on gloo ranks ----------------------------------------------------------------------------------

def merged(results: List[Dict[str, Any]]) -> Dict[str, Dict[str, torch.Tensor]]:
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for r in results:
        out.update(r["state"])
    return out


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    """Stage-0 checkpoints at world 4 / EP 4, plugin on and off, with the saving run's continuation."""
    out = {}
    for name, plugin in (("on", PLUGIN), ("off", None)):
        path = str(tmp_path_factory.mktemp(f"ckpt_{name}"))
        results = world(4).run(jobs.save, 0, plugin, 4, path, STEPS, MORE)
        assert results[0]["swaps"] == (2 if plugin else 0)          # both MoE layers run the plugin, or none
        out[name] = {"path": path, "state": merged(results), "eval": results[0]["eval"], "after": results[0]["after"]}
    return out


def test_saved_layout_is_read_from_the_files(saved):
    assert read_saved_layout(saved["on"]["path"], "t") == Layout(world=4, dp=4, ep=4, zero_stage=0,
                                                                  num_experts=(4, 4), half=False)


@pytest.mark.parametrize("save_plugin", ["on", "off"])
@pytest.mark.parametrize("load_plugin", ["on", "off"])
@pytest.mark.parametrize("size", TARGETS, ids=[f"world{w}-ep{e}" for w, e in TARGETS])
def test_zero0_reshards_exactly_and_continues_like_the_uninterrupted_run(world, saved, save_plugin, load_plugin,
                                                                         size):
    ref = saved[save_plugin]
    n, ep = size
    results = world(n).run(jobs.load, 0, PLUGIN if load_plugin == "on" else None, ep, ref["path"], STEPS, MORE,
                           False)
    assert "error" not in results[0], results[0]["error"]
    assert results[0]["swaps"] == (2 if load_plugin == "on" else 0)
    got = merged(results)
    assert sorted(got) == sorted(ref["state"])                   # every global expert somewhere, dense too
    for name, entry in ref["state"].items():
        assert set(got[name]) == set(entry) == {"param", "exp_avg", "exp_avg_sq", "step"}, name
        for key, tensor in entry.items():
            assert torch.equal(got[name][key], tensor), (name, key)
    # the same global batches: the loss before and after each further step is the uninterrupted run's
    assert results[0]["eval"] == pytest.approx(ref["eval"], rel=1e-5)
    assert results[0]["after"] == pytest.approx(ref["after"], rel=1e-5)
    assert all(math.isfinite(l) for l in results[0]["after"])


def test_deepspeed_alone_fails_on_zero0_expert_state_at_another_ep(world, saved):
    result = world(2).run(jobs.load, 0, None, 2, saved["off"]["path"], STEPS, MORE, True)[0]
    assert result["error"].startswith("ValueError: loaded state dict contains a parameter group that doesn't "
                                      "match the size"), result


@pytest.mark.parametrize("stage,save_plugin", [(1, PLUGIN), (2, None)])
def test_zero_partitioned_state_at_another_size_is_refused_before_loading(world, tmp_path, stage, save_plugin):
    path = str(tmp_path)
    world(4).run(jobs.save, stage, save_plugin, 4, path, 1, 0)
    assert read_saved_layout(path, "t") == Layout(world=4, dp=4, ep=4, zero_stage=stage, num_experts=(4, 4),
                                                  half=False)
    tool, native = (world(2).run(jobs.load, stage, PLUGIN, 2, path, 1, 0, flag)[0] for flag in (False, True))
    assert tool["error"].startswith("ValueError: cannot resume checkpoint") and \
        f"saved at world 4 (DP 4, EP 4, ZeRO stage {stage}), at world 2 (DP 2, EP 2, ZeRO stage {stage})" \
        in tool["error"] and f"ZeRO stage {stage} partitions the optimizer state" in tool["error"], tool
    # DeepSpeed alone refuses too, but only after it has loaded the weights
    assert native["error"].startswith("ZeRORuntimeException: The checkpoint being loaded used a DP world size "
                                      "of 4 but the current world size is 2"), native


# ---- the recipe -----------------------------------------------------------------------------------------------

def recipe(nproc: int, ep: int, config: Path, ckpt: Path, out: Path, steps: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "moe_plugins.recipes.train_deepspeed", "--ds-config", str(config), "--max-chars", "60000",
           "--ep", str(ep), "--steps", str(steps), "--ckpt-dir", str(ckpt), "--save-every", "2", "--out", str(out)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.full(covered_by="test_zero0_reshards_exactly_and_continues_like_the_uninterrupted_run, "
                             "test_zero_partitioned_state_at_another_size_is_refused_before_loading, "
                             "test_check_resume_accepts_what_reshards_and_names_both_sizes_otherwise")
def test_recipe_resumes_at_another_size_or_refuses(tmp_path):
    """Saved at world 4 / EP 4 (ZeRO 0); resumed at world 2 / EP 2 it trains on from the saved step; asked
    to resume with ZeRO 1 at world 2 it stops with the sizes named. (The recipe's batches are per rank, so its
    losses at another world are not those of the old one: the exact continuation is checked above.)"""
    base = json.loads((ROOT / "recipes" / "configs" / "gpt2_moe_tiny.json").read_text())
    configs = {}
    for stage in (0, 1):
        configs[stage] = tmp_path / f"zero{stage}.json"
        configs[stage].write_text(json.dumps({**base, "zero_optimization": {"stage": stage}}))
    ckpt = tmp_path / "ckpt"
    first = recipe(4, 4, configs[0], ckpt, tmp_path / "run4", 2)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    shutil.copytree(ckpt, tmp_path / "ckpt_copy")          # the resumed run saves step 4 at world 2 into ckpt
    resumed = recipe(2, 2, configs[0], ckpt, tmp_path / "run2", 4)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    steps = [json.loads(l) for l in (tmp_path / "run2" / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [2, 3] and all(math.isfinite(r["loss"]) for r in steps)
    refused = recipe(2, 2, configs[1], tmp_path / "ckpt_copy", tmp_path / "run2z1", 4)
    assert refused.returncode != 0
    assert "cannot resume checkpoint" in refused.stderr + refused.stdout and \
        "saved at world 4 (DP 4, EP 4, ZeRO stage 0), at world 2 (DP 2, EP 2, ZeRO stage 1)" in \
        refused.stderr + refused.stdout
    assert not (tmp_path / "run2z1" / "steps.jsonl").exists()       # refused before its first step
