"""Lancet's batch partitions through Megatron-core's own TransformerLayer (issue 26), in its own TransformerBlock (built
while the plugin is enabled, it installs the block executor itself) on 4 gloo ranks (EP 4, fp64, hidden and attention dropout 0.1, top-2 with capacity drops): the same outputs, input and
parameter gradients as stock Megatron (<= 1e-12), the same dropped routes, every range partitioned; settings the
executor cannot replay refused when the block is built, naming them. Also run on megatron-core 0.19.2 (make test-mcore19)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.workers import lancet_layers_megatron as jobs  # noqa: E402

TIMEOUT_S = 600


@pytest.mark.parametrize("parts", [2, 4])
def test_partitions_in_megatron_transformer_layers_equal_stock(world, parts):
    for r in world(4).run(jobs.equal_job, parts, timeout_s=TIMEOUT_S):
        assert max(r["err"]) <= 1e-12, r["err"]
        assert r["same_names"] and r["nonzero"]
        assert r["dropped"]["ours"] == r["dropped"]["stock"] and sum(r["dropped"]["stock"]) > 0, r["dropped"]
        assert r["kinds"] == ["TransformerLayer"] and r["chosen"] == [parts] and r["stock_calls"] == 0
        assert r["ranges"] == 3 * 2                           # 3 calls x 2 MoE layers, each a partitioned range
        assert r["restored"]


def test_a_gpt_model_needs_only_the_section(world):
    """Megatron's GPTModel (embeddings, 2 MoE TransformerLayers, output layer and loss) built while the plugin is
    enabled with ``"lancet": {"partitions": 2}`` and nothing else: its decoder installs the executor, and the
    per-token losses and every parameter gradient equal stock's (fp64, <= 1e-12, dropout on)."""
    for r in world(4).run(jobs.gpt_job, timeout_s=TIMEOUT_S):
        assert max(r["err"]) <= 1e-12 and r["same_names"], r["err"]
        assert r["ranges"] == [2 * 2]                        # one executor: 2 calls x 2 MoE layers


def test_tuned_partitions_stay_exact_and_every_rank_decides_the_same(world):
    """``"tune"``: the executor times its own ranges at 1, 2 and 4 partitions (Megatron's heads, batch dim and
    dropout replay as above): whatever counts it ran, stock's outputs and gradients."""
    results = world(4).run(jobs.equal_job, "tune", 8, timeout_s=TIMEOUT_S)
    for r in results:
        assert max(r["err"]) <= 1e-12 and r["dropped"]["ours"] == r["dropped"]["stock"], (r["err"], r["dropped"])
        ((choice, times),) = r["tuned"].values()                     # one batch shape
        assert choice in (1, 2, 4) and len(times) >= 2 and set(r["chosen"]) >= set(times), r["tuned"]
        assert r["ranges"] == 8 * 2
    assert len({repr(r["tuned"]) for r in results}) == 1


def test_training_through_megatron_ddp_with_deferred_dw_equals_stock(world):
    """4 steps through Megatron's DDP (overlap_grad_reduce), partitions 2 with the experts' dW deferred: the same
    losses and main_grads as stock Megatron (fp64, <= 1e-12), each DDP hook once per parameter and step."""
    for r in world(4).run(jobs.train_job, 2, timeout_s=TIMEOUT_S):
        assert max(r["loss_err"]) <= 1e-12 and max(r["grad_err"]) <= 1e-12, (r["loss_err"], r["grad_err"])
        stock, ours = r["hooks"]
        assert ours == stock == [[1]] * 4, r["hooks"]
        assert r["ranges"] == 4 * 2 and r["again"]          # wrap_model on covered layers: the block's executor


def test_settings_partitions_cannot_replay_are_refused_naming_them(world):
    fused, recompute = world(4).run(jobs.refused_job, {"bias_dropout_fusion": True}, timeout_s=TIMEOUT_S)[0], \
        world(4).run(jobs.refused_job, {"recompute_granularity": "full", "recompute_method": "uniform",
                                        "recompute_num_layers": 1}, timeout_s=TIMEOUT_S)[0]
    assert "bias_dropout_fusion (True) with hidden_dropout (0.1)" in fused, fused
    assert "recompute_granularity ('full') must be None" in recompute, recompute
    assert world(4).run(jobs.refused_job, {"bias_dropout_fusion": True, "hidden_dropout": 0.0},
                        timeout_s=TIMEOUT_S)[0] == ""
