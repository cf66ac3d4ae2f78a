"""Hecate's pooled slots (``"hecate": {"reshard_every": n, "pool_slots": true}``: Algorithm 2 as the paper has it,
the layers sharing every rank's expert slots) on DeepSpeed, 4 gloo ranks (2 nodes x 2), the recipes' GPT-2-MoE
in fp64 with dropout: the config's rules, training with the experts moved across the layers' modules equal to
stock DeepSpeed, and checkpoints written in the stock layout both ways."""

from __future__ import annotations

import pytest
import torch

from moe_plugins.core.plugin_config import PluginConfig
from moe_plugins.hecate.config import HecateConfig

WORLD = 4


def _jobs():
    pytest.importorskip("deepspeed")
    from tests.workers import hecate_pool_deepspeed
    return hecate_pool_deepspeed


def test_the_section_takes_pool_slots_with_reshard_every_on_both_hosts():
    from moe_plugins.patches.deepspeed_hecate import config_choices
    from moe_plugins.patches.megatron_hecate import sections
    cfg = PluginConfig.from_dict({"hecate": {"reshard_every": 2, "pool_slots": True}}, **config_choices())
    assert HecateConfig.from_dict(cfg.hecate).pool_slots is True and HecateConfig().pool_slots is False
    with pytest.raises(ValueError, match=r"pool_slots \(True\) needs moe_plugins\.hecate\.reshard_every >= 1"):
        PluginConfig.from_dict({"hecate": {"pool_slots": True}}, **config_choices())
    with pytest.raises(ValueError, match=r"pool_slots \('yes'\) must be true or false"):
        PluginConfig.from_dict({"hecate": {"reshard_every": 2, "pool_slots": "yes"}}, **config_choices())
    megatron = PluginConfig.from_dict({"hecate": {"reshard_every": 2, "pool_slots": True}}, sections=sections())
    assert HecateConfig.from_dict(megatron.hecate).pool_slots is True          # tests/test_hecate_pool_megatron.py


@pytest.mark.parametrize("stage, every", [(0, 100), (2, 100), (2, 2)], ids=["zero0", "zero2", "zero2-plan-every-2"])
def test_experts_moved_across_layers_train_as_stock(world, stage, every):
    """After the first step each rank's two slots hold two experts of one layer (ranks 0-1 layer 0's, ranks 2-3
    layer 1's): some experts sit in the other layer's module, with their Adam state (ZeRO 2: their slices of the
    fp32 master partition and moments). 8 steps equal stock DeepSpeed's losses (1e-5), and every expert ends with
    stock's values by (layer, id). With Algorithm 2 every 2 steps (pooled plan) as well: the same losses, 4 rounds."""
    jobs = _jobs()
    steps = 8
    results = world(WORLD).run(jobs.pooled_vs_stock, stage, steps, every, timeout_s=180)
    on_all, off_all = {}, {}
    for rank, res in enumerate(results):
        off, on = res["off"], res["on"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(off["losses"], on["losses"]))
        assert len(on["losses"]) == steps and rel <= 1e-5, (rank, rel, off["losses"], on["losses"])
        assert on["rounds"] == steps // every + 1                        # the move by hand is a round too
        if every > steps:                                                  # only the move by hand
            assert on["homes"] == [tuple(h) for h in jobs.UNEVEN]
            assert on["held"] == ([2, 0] if rank < 2 else [0, 2])         # one layer's two experts per rank
        assert sum(on["held"]) == 2 and all(r["on"]["homes"] == on["homes"] for r in results)
        on_all.update(on["experts"])
        off_all.update(off["experts"])
    if every <= steps:            # the pooled plan itself left some rank with two experts of one layer
        assert any(r["on"]["held"] != [1, 1] for r in results)
        assert results[0]["on"]["homes"] != [tuple(h) for h in jobs.UNEVEN]
    assert set(on_all) == set(off_all) and len(on_all) == 2 * 4 * 4       # 2 layers x 4 experts x 4 tensors
    assert max(float((off_all[n] - on_all[n]).abs().max() / off_all[n].abs().max()) for n in off_all) <= 1e-4


@pytest.mark.parametrize("save_pooled", [True, False], ids=["pooled-to-stock", "stock-to-pooled"])
def test_pooled_checkpoints_are_stock_files(world, tmp_path, save_pooled):
    jobs = _jobs()
    results = world(WORLD).run(jobs.pooled_checkpoint, str(tmp_path), 2, save_pooled, timeout_s=180)
    from tests.workers.hecate_reshard_deepspeed import round_trip
    assert len(round_trip(results)) == 2 * 4 * 4            # resumed losses equal, every expert bitwise, by id
    for res in results:
        pooled = res["saver"] if save_pooled else res["loader"]
        assert pooled["homes"] == [tuple(h) for h in jobs.UNEVEN]


def test_pooled_moves_need_one_expert_shape_and_one_group():
    """The pooled move refuses, before anything moves, layers whose expert slots differ in shape or that run on
    different EP groups (one process; the checks come before any collective)."""
    from types import SimpleNamespace

    from moe_plugins.hecate.rehome import Resharder

    def layer(shape, ranks=(0,)):
        sched = SimpleNamespace(homes=(0, 0), groups=SimpleNamespace(ep=SimpleNamespace(ranks=ranks)))
        params = [torch.nn.Parameter(torch.zeros(shape)) for _ in range(2)]
        return sched, (lambda: [[(p, None)] for p in params])

    mixed = Resharder([layer((2, 3)), layer((3, 3))], every=1, pooled=True)
    mixed.reshard(None, [(0, 0), (0, 0)])                # the same homes: nothing moves, nothing to check
    assert mixed.rounds == 1 and mixed.layers_moved == 0
    with pytest.raises(ValueError, match="pooled slots need every layer's experts of one shape"):
        mixed.reshard(None, [(0, 0), (0, 1)])
    groups = Resharder([layer((2, 3)), layer((2, 3), ranks=(1,))], every=1, pooled=True)
    with pytest.raises(ValueError, match="must share one FSSDP"):
        groups.reshard(None, [(0, 0), (0, 1)])


def test_set_homes_keeps_e_over_r_per_rank_unless_pooled():
    from types import SimpleNamespace

    from moe_plugins.hecate.schedule import HecateSchedule
    layer = SimpleNamespace(config=SimpleNamespace(num_experts=4), groups=SimpleNamespace(ep=SimpleNamespace(size=2)),
                            _state=SimpleNamespace(early=None, homes=(0, 0, 1, 1)))
    HecateSchedule.set_homes(layer, (1, 0, 0, 1))
    assert layer._state.homes == (1, 0, 0, 1)
    HecateSchedule.set_homes(layer, (0, 0, 0, 1), pooled=True)          # pooled: three experts on rank 0
    assert layer._state.homes == (0, 0, 0, 1)
    for homes, pooled, message in (((0, 0, 0, 1), False, "one of the 2 EP members, 2 each"),
                                   ((0, 0, 2, 1), True, "one of the 2 EP members"), ((0, 1), True, "the 4 experts")):
        with pytest.raises(ValueError, match=message):
            HecateSchedule.set_homes(layer, homes, pooled=pooled)
    assert layer._state.homes == (0, 0, 0, 1)
