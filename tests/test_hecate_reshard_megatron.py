"""Hecate's re-sharding on Megatron-core (patches/megatron_hecate_reshard.py), on 4 gloo ranks (2 nodes x 2) under
the CPU shims (jobs: tests/workers/hecate_reshard_megatron.py): 20 training steps through Megatron's DDP and fp32
Adam equal stock Megatron's with the experts re-homed (their Adam moments with them), checkpoints through
``dist_checkpointing`` written and read in the stock layout, and the refusals."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.workers import hecate_reshard_megatron as jobs  # noqa: E402

WORLD = 4
JOB_TIMEOUT_S = 1800


def _moved_bitwise(results, half) -> None:
    """Every expert's state by global id just before and after the move by hand: the same keys (Adam's moments
    among them, and masters exactly when ``half``), each bitwise equal."""
    before, after = ({k: v for res in results for k, v in res["plugin"]["forced"][when].items()}
                     for when in ("before", "after"))
    assert set(before) == set(after) and any(k.endswith("exp_avg_sq") for k in before)
    assert any(k.endswith("main_param") for k in before) == bool(half)
    assert all(torch.equal(before[k], after[k]) for k in before), \
        [k for k in before if not torch.equal(before[k], after[k])]


def _merged(results, role: str, key: str):
    out = {}
    for res in results:
        out.update(res[role][key])
    return out


@pytest.mark.parametrize("tp,ep,forced", [(1, 4, None), (2, 2, (1, 0, 1, 0))], ids=["tp1-ep4", "tp2-ep2-forced"])
def test_training_with_resharding_equals_stock_megatron(world, tp, ep, forced):
    """TP 1 x EP 4: experts 0 and 1 are hot, both copied, and the other two crowd node 1, which Algorithm 2 undoes.
    TP 2 x EP 2 (expert-DP 2): the experts are moved by hand once (``forced``), and the replicas must move alike.
    Losses within 1e-5 of stock's at every step; every expert's weights and Adam moments, by global id, within
    1e-5 of stock's after 20 steps."""
    steps = 20
    results = world(WORLD).run(jobs.train_vs_stock, tp, ep, 2, steps, forced, timeout_s=JOB_TIMEOUT_S)
    for rank, res in enumerate(results):
        stock, plugin = res["stock"], res["plugin"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], plugin["losses"]))
        assert len(plugin["losses"]) == steps and rel <= 1e-5, (rank, rel)
        assert any(h != plugin["stock"] for h in plugin["homes"]), (rank, plugin["homes"])     # experts moved
        assert plugin["moves"] == steps // 2 + (forced is not None)
    a, b = _merged(results, "stock", "experts"), _merged(results, "plugin", "experts")
    assert set(a) == set(b) and any(k.endswith("exp_avg_sq") for k in a)
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a), \
        max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("half", [True, "fp16"], ids=["bf16", "fp16"])
def test_bf16_resharding_moves_the_fp32_masters(world, half):
    """bf16 (and fp16, under a constant loss scale of 1024) parameters under Megatron's mixed-precision Adam
    (``Float16OptimizerWithFloat16Params``, fp32 masters held by the torch optimizer): a move by hand after the first step carries every expert's bf16 values,
    ``main_grad``, fp32 master and the master's Adam moments, by global id, bitwise; then 12 steps re-sharding
    every 2 track stock Megatron's bf16 run (losses to bf16 rounding, 2e-2 relative) and every expert's master and
    moments by global id stay near stock's (a master left behind would put another expert's weights in its slot
    at the next step)."""
    steps = 12
    results = world(WORLD).run(jobs.train_vs_stock, 1, 4, 2, steps, (3, 2, 1, 0), half, timeout_s=JOB_TIMEOUT_S)
    before, after = ({k: v for res in results for k, v in res["plugin"]["forced"][when].items()}
                     for when in ("before", "after"))
    assert {v.dtype for k, v in before.items() if k.endswith("weight")} == \
        {torch.float16 if half == "fp16" else torch.bfloat16}
    assert set(before) == set(after) and any(k.endswith("main_param") for k in before)
    assert any(k.endswith("exp_avg_sq") for k in before) and any(k.endswith("main_grad") for k in before)
    assert all(torch.equal(before[k], after[k]) for k in before), \
        [k for k in before if not torch.equal(before[k], after[k])]
    for rank, res in enumerate(results):
        stock, plugin = res["stock"], res["plugin"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], plugin["losses"]))
        assert len(plugin["losses"]) == steps and rel <= 2e-2, (rank, rel, stock["losses"], plugin["losses"])
        assert plugin["homes"][0] == (3, 2, 1, 0) != plugin["stock"] and plugin["moves"] == steps // 2 + 1
    a, b = _merged(results, "stock", "experts"), _merged(results, "plugin", "experts")
    masters = [k for k in a if k.endswith(("main_param", "exp_avg", "exp_avg_sq"))]
    assert set(a) == set(b) and masters
    worst = max((a[k] - b[k]).abs().max().item() for k in masters)
    assert worst <= 1e-2, worst              # 4e-3 measured; with the masters left behind the losses part by 50%


@pytest.mark.parametrize("saver,loader", [("plugin", "stock"), ("stock", "plugin"), ("plugin", "plugin")])
def test_dist_checkpoints_are_stock_megatron_files(world, tmp_path, saver, loader):
    """Saved with the experts away from their stock owners, the checkpoint holds every expert under its global id:
    a stock layer and a re-sharded one load the same experts; the saver's experts stay where they were."""
    (tmp_path / "ckpt").mkdir()
    results = world(WORLD).run(jobs.checkpoint_across, str(tmp_path / "ckpt"), saver, loader,
                               timeout_s=JOB_TIMEOUT_S)
    saved_before = _merged(results, "saver", "before")
    saved, loaded = _merged(results, "saver", "experts"), _merged(results, "loader", "experts")
    assert set(saved) == set(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert all(torch.equal(saved[k], saved_before[k]) for k in saved)
    res = results[0]
    if saver == "plugin":
        assert res["saver"]["homes"] != res["saver"]["stock"]             # saved away from the stock homes
        assert "dist_checkpointing.save(async_sharded_save=True) would write after the experts move back" in \
            res["saver"]["async_error"]
    if loader == "plugin":
        assert res["loader"]["homes_before"] != res["loader"]["stock"]
        assert res["loader"]["homes"] == res["loader"]["stock"]          # moved home to load


def test_expert_biases_under_sequence_parallelism_are_refused(world):
    """Megatron all-reduces the experts' fc2 bias gradients over the TP group slot by slot (which, at expert-TP 1,
    adds different experts' biases: stock's own sum, which the plugin reproduces while the homes are stock's), so
    re-sharding refuses expert biases with sequence parallelism at TP > 1 when the layer is built."""
    for res in world(WORLD).run(jobs.refused_layer, timeout_s=JOB_TIMEOUT_S):
        assert res["error"] is not None and "moe_plugins.hecate.reshard_every (2) cannot run with add_bias_linear and " \
            "sequence_parallel at tensor_model_parallel_size 2" in res["error"], res["error"]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_distributed_optimizer_at_expert_dp_1(world, bf16):
    """Megatron's distributed optimizer at EP 4 = world (expert-DP 1: each rank's shard holds its experts whole,
    the dense scale sharded over DP 4): a move by hand after the first step carries every expert's values,
    ``main_grad``, the flat shard the optimizer steps (fp32: a view of the parameter; bf16: its fp32 master) and
    its Adam moments bitwise by global id; then re-sharding every 2 steps tracks stock Megatron with the same
    optimizer: fp32 losses within 1e-5 and experts with their moments within 1e-4; bf16 within bf16 rounding
    (losses 2e-2 relative, masters and moments 5e-2)."""
    steps = 12
    results = world(WORLD).run(jobs.train_vs_stock, 1, 4, 2, steps, (3, 2, 1, 0), bf16, True, timeout_s=JOB_TIMEOUT_S)
    _moved_bitwise(results, bf16)
    for rank, res in enumerate(results):
        stock, plugin = res["stock"], res["plugin"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], plugin["losses"]))
        assert len(plugin["losses"]) == steps and rel <= (2e-2 if bf16 else 1e-5), (rank, rel)
        assert plugin["homes"][0] == (3, 2, 1, 0) != plugin["stock"] and plugin["moves"] == steps // 2 + 1
    a, b = _merged(results, "stock", "experts"), _merged(results, "plugin", "experts")
    assert set(a) == set(b)
    if bf16:
        masters = [k for k in a if k.endswith(("main_param", "exp_avg", "exp_avg_sq"))]
        worst = max((a[k] - b[k]).abs().max().item() for k in masters)
        assert worst <= 5e-2, worst
    else:
        assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a), \
            max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("tp,bf16", [(1, False), (1, True), (1, "fp16"), (2, False)],
                         ids=["tp1-fp32", "tp1-bf16", "tp1-fp16", "tp2-fp32"])
def test_the_distributed_optimizer_at_expert_dp_2(world, tp, bf16):
    """Megatron's distributed optimizer at EP 2 x expert-DP 2 (TP 1, and TP 2 with expert-TP 1): each rank steps a
    piece of some experts' parameters (some split between the two expert-DP ranks, some not here at all), and which
    piece depends on the slot. A move by hand after the first step, (0, 0, 1, 1) -> (1, 0, 1, 0), takes expert 1
    from slot 1 to slot 0 and expert 3 from rank 1 to rank 0: every expert's values, ``main_grad``, and its master
    (bf16) and Adam moments made whole over expert-DP, bitwise by global id; then re-sharding every 2 steps back to
    the stock homes and out again (in place of Algorithm 2's plan; each move inside the optimizer step, when only
    a rank's own range of the parameters holds the stepped values, before Megatron all-gathers them) tracks stock
    Megatron with the same optimizer (buckets of about 1.5 experts, overlapped reduction): fp32 losses within
    1e-5, experts with their moments within 1e-4; bf16 to its rounding."""
    steps = 12
    results = world(WORLD).run(jobs.train_vs_stock, tp, 2, 2, steps, (1, 0, 1, 0), bf16, True, True,
                               timeout_s=JOB_TIMEOUT_S)
    for res in results:        # per local slot, the (start, end) this rank steps of each parameter
        slot0, slot1 = res["plugin"]["pieces"]
        assert slot0 != slot1 and len(slot0) == len(slot1) == (4 if tp == 1 else 2), (slot0, slot1)
    assert tp > 1 or any(0 < end - start < n for res in results for slot in res["plugin"]["pieces"]
                         for (start, end), n in zip(slot, [jobs.H * jobs.M, jobs.H, jobs.M * jobs.H, jobs.M])), \
        "no parameter split"
    _moved_bitwise(results, bf16)
    for rank, res in enumerate(results):
        stock, plugin = res["stock"], res["plugin"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], plugin["losses"]))
        assert len(plugin["losses"]) == steps and rel <= (2e-2 if bf16 else 1e-5), (rank, rel)
        turns = [plugin["stock"], (1, 0, 1, 0)] * steps
        assert plugin["homes"] == [(1, 0, 1, 0)] + [h for h in turns[:steps // 2] for _ in range(2)][:steps - 1]
        assert plugin["moves"] == steps // 2 + 1
    a, b = _merged(results, "stock", "experts"), _merged(results, "plugin", "experts")
    assert set(a) == set(b)
    # main_grad after the last step: reduced over expert-DP only in the range a rank steps (which moves with the
    # slot), elsewhere that rank's own gradient; the values, masters and moments above and below are whole
    a, b = ({k: v for k, v in d.items() if not k.endswith("main_grad")} for d in (a, b))
    if bf16:
        masters = [k for k in a if k.endswith(("main_param", "exp_avg", "exp_avg_sq"))]
        assert masters and max((a[k] - b[k]).abs().max().item() for k in masters) <= 5e-2
    else:
        assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a), \
            max((a[k] - b[k]).abs().max().item() for k in a)

@pytest.mark.parametrize("loader", ["stock", "plugin"])
def test_distributed_optimizer_checkpoints_are_stock_megatron(world, tmp_path, loader):
    """Megatron's distributed optimizer at EP 2 x expert-DP 2: the model and the optimizer's sharded state
    (``dp_reshardable``, Megatron's flat buffers per DP rank) written through ``dist_checkpointing`` by a stock
    saver and by a re-sharded one (experts away from their stock homes, so the buffers hold them in other slots)
    load into a fresh ``loader`` (a re-sharded plugin one moves home first) with every expert's values, whole masters
    and moments bitwise as saved, by global id; and the loader resumes with the same losses whichever saved."""
    runs = {}
    for saver in ("stock", "plugin"):
        (tmp_path / saver).mkdir()
        runs[saver] = world(WORLD).run(jobs.optimizer_checkpoint_across, str(tmp_path / saver), saver, loader,
                                       "dp_reshardable", timeout_s=JOB_TIMEOUT_S)
    assert runs["plugin"][0]["saver"]["homes"] == (1, 0, 1, 0)
    if loader == "plugin":                  # away from the stock homes until the load moved it there
        assert all(res["loader"]["homes"] == (1, 0, 1, 0) and res["loader"]["loaded_homes"] == (0, 0, 1, 1)
                   for results in runs.values() for res in results)
    for results in runs.values():
        saved, loaded = (_merged(results, role, "experts") for role in ("saver", "loader"))
        saved, loaded = ({k: v for k, v in d.items() if not k.endswith("main_grad")} for d in (saved, loaded))
        assert set(saved) == set(loaded) and any(k.endswith("exp_avg_sq") for k in saved)
        assert all(torch.equal(saved[k], loaded[k]) for k in saved), [k for k in saved
                                                                       if not torch.equal(saved[k], loaded[k])]
    for a, b in zip(runs["stock"], runs["plugin"]):
        rel = max(abs(x - y) / abs(x) for x, y in zip(a["loader"]["after"], b["loader"]["after"]))
        assert len(a["loader"]["after"]) == 2 and rel <= 1e-5, rel
