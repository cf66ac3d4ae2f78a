"""Hecate's pooled slots on Megatron-core (``"hecate": {"reshard_every": n, "pool_slots": true}``: Algorithm 2 as
the paper has it, the layers sharing every rank's expert slots), 4 gloo ranks (2 nodes x 2, EP 4), two MoE layers
in Megatron's DDP with its fp32 Adam: training with experts moved across the layers' SequentialMLPs equal to stock
Megatron, the state dict and dist_checkpointing files written in the stock layout. Also run on megatron-core 0.19.2 (make test-mcore19)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.workers import hecate_pool_megatron as jobs  # noqa: E402

WORLD, TIMEOUT_S = 4, 300


def _merged(results, *keys):
    """Every rank's dict at ``keys`` (nested: e.g. run, then key), merged."""
    out = {}
    for res in results:
        for key in keys:
            res = res[key]
        out.update(res)
    return out


@pytest.mark.parametrize("every, forced", [(100, True), (2, False)], ids=["moved-by-hand", "pooled-plan-every-2"])
def test_experts_moved_across_layers_train_as_stock_megatron(world, every, forced):
    """By hand: after the first step ranks 0-1 hold two experts of layer 0 and ranks 2-3 two of layer 1, so some
    experts sit in the other layer's SequentialMLP with their main_grad and Adam moments. By Algorithm 2 every 2
    steps: the pooled plan itself leaves some rank with two experts of one layer. 8 steps: losses within 1e-5 of
    stock Megatron's; every expert's weights, main_grad and moments by (layer, id) within 1e-5; the state dict
    written under stock_homes() equals stock's, and the experts go back to the pooled homes after it."""
    steps = 8
    results = world(WORLD).run(jobs.pooled_vs_stock, steps, every, forced, timeout_s=TIMEOUT_S)
    for rank, res in enumerate(results):
        stock, plugin = res["stock"], res["plugin"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], plugin["losses"]))
        assert len(plugin["losses"]) == steps and rel <= 1e-5, (rank, rel, stock["losses"], plugin["losses"])
        assert plugin["rounds"] == steps // every + forced
        assert sum(plugin["held"]) == 2 and plugin["homes_after"] == plugin["homes"]
        if forced:
            assert plugin["homes"] == [tuple(h) for h in jobs.UNEVEN]
            assert plugin["held"] == ([2, 0] if rank < 2 else [0, 2])
        for a, b in zip(stock["state"], plugin["state"]):
            assert set(a) == set(b) and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a), rank
    if not forced:
        assert any(r["plugin"]["held"] != [1, 1] for r in results), [r["plugin"]["held"] for r in results]
    a, b = _merged(results, "stock", "experts"), _merged(results, "plugin", "experts")
    assert set(a) == set(b) and len({k.split(".")[0] + "." + k.split(".")[1] for k in a}) == 2 * 4
    assert any(k.endswith("exp_avg_sq") for k in a) and any(k.endswith("main_grad") for k in a)
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a), \
        max((a[k] - b[k]).abs().max().item() for k in a)


def test_bf16_pooled_moves_carry_the_fp32_masters(world):
    """bf16 under Megatron's mixed-precision Adam: the move by hand after the first step puts experts in the other
    layer's SequentialMLP with their bf16 values, main_grad, fp32 master and the master's moments, bitwise by
    (layer, id); 8 steps then track stock Megatron's bf16 run (losses within 2e-2 relative, masters and moments by
    (layer, id) within 5e-2: Adam moves a master up to lr 1e-2 a step), and the state dict written under
    stock_homes() is stock's to bf16 rounding."""
    steps = 8
    results = world(WORLD).run(jobs.pooled_vs_stock, steps, 100, True, True, timeout_s=TIMEOUT_S)
    before, after = (_merged(results, "plugin", "forced", when) for when in ("before", "after"))
    assert set(before) == set(after) and any(k.endswith("main_param") for k in before)
    assert any(k.endswith("exp_avg_sq") for k in before)
    assert all(torch.equal(before[k], after[k]) for k in before), \
        [k for k in before if not torch.equal(before[k], after[k])]
    for rank, res in enumerate(results):
        stock, plugin = res["stock"], res["plugin"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], plugin["losses"]))
        assert rel <= 2e-2, (rank, rel, stock["losses"], plugin["losses"])
        assert plugin["held"] == ([2, 0] if rank < 2 else [0, 2])
        for a, b in zip(stock["state"], plugin["state"]):
            assert set(a) == set(b) and all(torch.allclose(a[k].float(), b[k].float(), atol=5e-2) for k in a)
    a, b = _merged(results, "stock", "experts"), _merged(results, "plugin", "experts")
    masters = [k for k in a if k.endswith(("main_param", "exp_avg", "exp_avg_sq"))]
    assert set(a) == set(b) and masters
    worst = max((a[k] - b[k]).abs().max().item() for k in masters)
    assert worst <= 5e-2, worst


def test_a_pooled_dist_checkpoint_loads_into_stock_megatron(world, tmp_path):
    """Saved with experts in the other layer's modules, the checkpoint holds every expert under its (layer, global
    id): stock layers with other weights load exactly the saver's experts; the saver's stay where they were."""
    (tmp_path / "ckpt").mkdir()
    results = world(WORLD).run(jobs.checkpoint_to_stock, str(tmp_path / "ckpt"), timeout_s=TIMEOUT_S)
    before, after, loaded = (_merged(results, key) for key in ("before", "after", "loaded"))
    assert set(before) == set(loaded) and len({k.rsplit(".", 2)[0] for k in before}) == 2 * 4, sorted(before)
    assert all(torch.equal(before[k], loaded[k]) and torch.equal(before[k], after[k]) for k in before)
    assert all(r["homes"] == [tuple(h) for h in jobs.UNEVEN] for r in results)



def test_pooled_layers_stepped_by_two_optimizers_are_refused(world):
    errors = world(WORLD).run(jobs.two_optimizers_error, timeout_s=TIMEOUT_S)
    assert all("pool_slots (True): the Hecate layers are stepped by several optimizers" in e for e in errors), errors
