"""Megatron ``dist_checkpointing`` across layouts with the plugin's layer (issue #28, item 2, Megatron part).

One MoE layer (4 experts, top-2, fp64, no capacity) is saved with ``dist_checkpointing.save`` of its
``sharded_state_dict()`` at TP 2 / EP 2 (world 4; expert-TP 1 with biases, and expert-TP 2 = Megatron's default
without them) and loaded at TP 1 / EP 4 on the same 4 gloo ranks: plugin -> plugin, plugin -> stock and
stock -> plugin (stock = Megatron's ``MoELayer`` from its own spec provider, plugin = ``PluginMoELayer`` from
``moe_plugins.patches.megatron.get_moe_module_spec``). The loaded layer holds the saved layer's full weights,
bit for bit, per global expert (gathered over expert-TP) and for the router, and gives the saved layer's outputs
on the same global tokens (tests/workers/ckpt_reshard_megatron.py says how both are gathered).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.workers import ckpt_reshard_megatron as jobs  # noqa: E402

JOB_TIMEOUT_S = 600
LOAD_LAYOUT = (1, 4, 1)                 # tp, ep, etp
OUTPUT_RTOL = 1e-12                     # fp64: the experts' sums only change order with the layout


def _check_loaded(saved, loaded, kind):
    assert loaded["load_result"] == ([], []), kind
    assert saved["disagree"] == [] and loaded["disagree"] == [], kind
    assert sorted(loaded["weights"]) == sorted(saved["weights"]), kind
    for name, want in saved["weights"].items():
        assert not torch.equal(loaded["before"][name], want), (kind, name)      # the load had something to do
        assert torch.equal(loaded["weights"][name], want), (kind, name)
    scale = float(saved["outputs"].abs().max())
    err = float((loaded["outputs"] - saved["outputs"]).abs().max())
    assert err <= OUTPUT_RTOL * scale, (kind, err, scale)


@pytest.mark.parametrize("save_kind, load_kinds, save_layout, bias", [
    ("plugin", ["plugin", "stock"], (2, 2, 1), True),
    ("stock", ["plugin"], (2, 2, 1), True),
    ("plugin", ["plugin", "stock"], (2, 2, 2), False),        # expert-TP 2 -> 1: experts' weights resharded
])
def test_saved_at_tp2_ep2_loads_at_tp1_ep4(world, tmp_path, save_kind, load_kinds, save_layout, bias):
    """Every rank reports the same gathered weights and outputs; each loaded kind equals what was saved."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    results = world(jobs.WORLD).run(jobs.save_then_load_job, str(ckpt), save_kind, load_kinds, save_layout,
                                    LOAD_LAYOUT, bias, timeout_s=JOB_TIMEOUT_S)
    saved = results[0]["saved"]
    names = sorted(saved["weights"])
    experts = {n.split(".")[1] for n in names if n.startswith("experts.")}
    assert experts == {str(g) for g in range(jobs.E)}
    assert any(n.startswith("router.") for n in names)
    # the global experts differ, so a misplaced expert would show
    fc1 = [saved["weights"][f"experts.{g}.linear_fc1.weight"] for g in range(jobs.E)]
    assert all(not torch.equal(fc1[a], fc1[b]) for a in range(jobs.E) for b in range(a))
    assert ("experts.0.linear_fc1.bias" in names) == bias
    for rank_result in results:
        assert sorted(rank_result["loaded"]) == sorted(load_kinds)
        assert torch.equal(rank_result["saved"]["outputs"], saved["outputs"])
        for kind in load_kinds:
            _check_loaded(rank_result["saved"], rank_result["loaded"][kind], kind)
    assert (ckpt / "metadata.json").exists()
