"""Lancet's batch partitions on DeepSpeed (patches/deepspeed_lancet.py + moe_plugins/lancet/blocks.py): the recipes'
GPT-2-MoE on 4 gloo ranks in fp64 under ZeRO-2, dropout on: the reduced gradients equal stock DeepSpeed's
(<= 1e-12) at 2 and 4 partitions (and with the experts' dW deferred too), each ZeRO-2 hook once per parameter and
micro-step, gradient accumulation over 2 micro-steps, 20-step losses within 1e-5 of stock; the blocks restored on
disable; the same for the recipes' BERT-MoE (post-LN BertLayers); partitions that do not divide the micro-batch
refused in one line."""

from __future__ import annotations

import pytest
import torch

from moe_plugins.lancet.tune import best_candidate
from tests.workers.lancet_blocks_deepspeed import refused, train

EXACT = 1e-12


def _close(a, b, tol) -> bool:
    return all(float((x - y).abs().max()) <= tol for x, y in zip(a, b)) and len(a) == len(b)


def _close_fp32_reduced(a, b) -> bool:
    """Equal up to DeepSpeed's reduction: ZeRO-2 reduces fp64 gradients in fp32 (its communication_data_type
    default; fp64 is not accepted) in buckets filled in hook order, and which rank's value a ring all-reduce adds
    first depends on the offset in the bucket. Deferred dense dW fire their hooks later, at other offsets: one fp32
    rounding of the sum, relative to each flat partition's largest gradient."""
    return len(a) == len(b) and all(float((x - y).abs().max()) <= 1e-6 * float(x.abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("lancet,steps,gas,stage", [({"partitions": 2, "defer_wgrad": False}, 20, 1, 2),
                                                    ({"partitions": 4, "defer_wgrad": False}, 3, 2, 2),
                                                    ({"partitions": 2}, 3, 1, 2),
                                                    ({"dense_wgrad": True}, 20, 2, 1),
                                                    ({"partitions": 2, "dense_wgrad": True}, 3, 1, 1),
                                                    ({"dense_wgrad": True}, 3, 2, 2)],
                         ids=["parts2-20steps", "parts4-gas2", "parts2-deferred-dw", "dense-dw-20steps-gas2-zero1",
                              "parts2-dense-dw-zero1", "dense-dw-gas2-zero2"])
def test_partitions_on_deepspeed_equal_stock(world, lancet, steps, gas, stage):
    """ZeRO-1 reduces at the boundary, in parameter order: the deferred dense dW give stock's gradients bitwise.
    ZeRO-2 reduces in hook order, so there they agree to one fp32 rounding (:func:`_close_fp32_reduced`)."""
    pool = world(4)
    stock = pool.run(train, None, steps, gas, 4, None, stage, timeout_s=600)
    plugin = pool.run(train, {"schedule": "baseline", "lancet": lancet}, steps, gas, 4, None, stage, timeout_s=600)
    reorders = lancet.get("dense_wgrad") and stage == 2
    for s, p in zip(stock, plugin):
        assert max(abs(a - b) for a, b in zip(s["losses"], p["losses"])) <= 1e-5, (s["losses"], p["losses"])
        close = _close_fp32_reduced if reorders else (lambda a, b: _close(a, b, EXACT))
        assert all(close(a, b) for a, b in zip(s["grads"], p["grads"])) and len(s["grads"]) == steps
        assert p["hook_calls"] == s["hook_calls"] and all(set(c.values()) == {1} for c in p["hook_calls"])
        parts = lancet.get("partitions", 1)
        if parts > 1:
            assert p["ranges"] == [2 * steps * gas] and p["stock_calls"] == [0]     # two MoE blocks per forward
        assert p["restored"] and p["queue_empty"]
        # dense_wgrad: every Conv1D of the 4 blocks (attention c_attn, c_proj; dense MLP c_fc, c_proj) and no
        # more (the LM head is tied to the embedding: stock; the MoE layers' Linears: the experts' own deferral)
        wanted = [f"transformer.h.{i}.{m}" for i in range(4)
                  for m in ("attn.c_attn", "attn.c_proj") + (("mlp.c_fc", "mlp.c_proj") if i % 2 == 0 else ())]
        assert sorted(p["dense"]) == (sorted(wanted) if lancet.get("dense_wgrad") else []), p["dense"]
        # deferred dW: each partition's dispatch-gradient exchange (per layer and micro-step) ran the queue, its
        # experts' dW queued just before; a combine-gradient exchange runs it when earlier work is queued
        exchanges = 2 * parts * steps * gas
        deferred = lancet.get("defer_wgrad", True)
        assert exchanges <= p["overlap_calls"] <= 2 * exchanges if deferred else p["overlap_calls"] == 0


@pytest.mark.parametrize("lancet,steps,gas", [({"partitions": 2, "defer_wgrad": False}, 20, 1),
                                              ({"partitions": 4}, 3, 2)], ids=["parts2-20steps", "parts4-dw-gas2"])
def test_partitions_on_bert_equal_stock(world, lancet, steps, gas):
    """The recipes' BERT-MoE (BertLayer: attention, then the MoE output LayerNorm(h + dropout(MoE(h)))), eager
    attention, dropout 0.1 everywhere: partitioned like GPT-2, stock's gradients and losses."""
    pool = world(4)
    stock = pool.run(train, None, steps, gas, 4, None, 2, True, timeout_s=600)
    plugin = pool.run(train, {"schedule": "baseline", "lancet": lancet}, steps, gas, 4, None, 2, True, timeout_s=600)
    for s, p in zip(stock, plugin):
        assert p["blocks"] == ["BertLayer"] * 4
        assert max(abs(a - b) for a, b in zip(s["losses"], p["losses"])) <= 1e-5, (s["losses"], p["losses"])
        assert all(_close(a, b, EXACT) for a, b in zip(s["grads"], p["grads"])) and len(s["grads"]) == steps
        assert p["hook_calls"] == s["hook_calls"] and all(set(c.values()) == {1} for c in p["hook_calls"])
        assert p["ranges"] == [2 * steps * gas] and p["stock_calls"] == [0] and p["chosen"] == [[lancet["partitions"]]]
        assert p["restored"] and p["queue_empty"]


def test_bad_partitions_refused_in_one_line(world, tmp_path):
    pool = world(4)
    message = pool.run(refused, {"lancet": {"partitions": 3}}, timeout_s=300)[0]
    assert message == ("moe_plugins.lancet.partitions (3) must divide the batch (4 samples per rank): each partition "
                       "holds the same whole samples; use one of [1, 2, 4]"), message
    dense = pool.run(refused, {"lancet": {"dense_wgrad": True}}, 4, False, "", True, timeout_s=300)[0]
    assert dense.startswith("moe_plugins.lancet.dense_wgrad (True): dense_wgrad cannot wrap: transformer.h.0.attn."
                            "c_proj (") and "ScaledConv1D) is not a plain torch.nn.Linear or transformers' Conv1D" \
        in dense, dense
    auto = pool.run(refused, {"lancet": {"partitions": "auto"}}, 4, False, str(tmp_path), timeout_s=300)[0]
    assert auto.startswith("moe_plugins.lancet.partitions ('auto') needs the cost profile of layout") and \
        "run `moe-plugins profile` on these ranks first, or give an integer" in auto, auto


def test_auto_partitions_from_a_measured_profile(world, tmp_path):
    pool = world(4)
    stock = pool.run(train, None, 2, timeout_s=600)
    auto = pool.run(train, {"lancet": {"partitions": "auto", "defer_wgrad": False}}, 2, 1, 4, str(tmp_path),
                    timeout_s=600)
    for s, a in zip(stock, auto):
        assert all(_close(x, y, EXACT) for x, y in zip(s["grads"], a["grads"])) and len(a["grads"]) == 2
        assert len(a["chosen"]) == 1 and a["chosen"][0] and set(a["chosen"][0]) <= {1, 2, 4}, a["chosen"]  # per range
        assert a["ranges"] == [4] and a["restored"]
    assert len({tuple(a["chosen"][0]) for a in auto}) == 1          # every rank chose the same from the same file


def test_tuned_partitions_time_the_ranges_and_stay_exact(world):
    """``"partitions": "tune"``: the executor tries 1, 2, 4 partitions (the divisors of the micro-batch, upwards
    while faster), timing its own ranges, and keeps the fastest; every step equals stock's whatever it ran (fp64,
    ZeRO-2, dropout on: reduced gradients <= 1e-12, losses <= 1e-5), and every rank decides the same."""
    steps, pool = 12, world(4)
    stock = pool.run(train, None, steps, 1, 4, None, 2, timeout_s=600)
    plugin = pool.run(train, {"schedule": "baseline", "lancet": {"partitions": "tune", "defer_wgrad": False}},
                      steps, 1, 4, None, 2, timeout_s=600)
    decided = {repr(p["tuned"]) for p in plugin}
    assert len(decided) == 1, decided                                   # the same choice on every rank
    for s, p in zip(stock, plugin):
        assert max(abs(a - b) for a, b in zip(s["losses"], p["losses"])) <= 1e-5, (s["losses"], p["losses"])
        assert all(_close(a, b, EXACT) for a, b in zip(s["grads"], p["grads"])) and len(p["grads"]) == steps
        assert p["hook_calls"] == s["hook_calls"] and p["restored"]
        ((choice, times),) = p["tuned"][0].values()                    # one batch shape, training
        assert choice in (1, 2, 4) and 1 in times and set(times) <= {1, 2, 4} and len(times) >= 2, p["tuned"]
        assert set(times) <= set(p["chosen"][0]) and choice == best_candidate(times)   # what ran; the fewest near
        assert p["chosen"][0][-1] <= 4 and p["ranges"] == [2 * steps]                 # the fastest measured


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.full(
    covered_by="[2] (Lina's micro-ops beside Lancet's partitions on one engine) and "
               "test_lina_deepspeed.py::test_dp2_bitwise_and_20_steps (Lina at ZeRO 1)")), 2])
def test_lina_micro_ops_beside_lancet_partitions_equal_stock(world, stage):
    """Lina's gradient micro-ops with Lancet's partitions and deferred dW on one engine (its background and
    pipeline lanes), fp32 (Lina sums in the gradients' dtype): stock's losses and reduced gradients to fp32
    rounding (1e-5 of each flat partition's largest; Lancet's partitioned GEMMs alone differ from stock by about
    7e-7 in fp32, and Lina's sum-then-divide by as much), each ZeRO hook once per parameter, micro-ops submitted,
    the dW queue run while exchanges flew and empty after."""
    pool = world(4)
    steps, fp32 = 10, torch.float32
    stock = pool.run(train, None, steps, 1, 4, None, stage, False, fp32, timeout_s=600)
    plugin = pool.run(train, {"schedule": "baseline", "lancet": {"partitions": 2}, "lina": {"micro_op_mb": 0.05}},
                      steps, 1, 4, None, stage, False, fp32, timeout_s=600)
    for s, p in zip(stock, plugin):
        assert max(abs(a - b) / abs(a) for a, b in zip(s["losses"], p["losses"])) <= 1e-5, (s["losses"], p["losses"])
        assert len(p["grads"]) == steps and all(float((x - y).abs().max()) <= 1e-5 * float(x.abs().max())
                                                for a, b in zip(s["grads"], p["grads"]) for x, y in zip(a, b))
        assert p["hook_calls"] == s["hook_calls"] and all(set(c.values()) == {1} for c in p["hook_calls"])
        assert p["lina_submitted"] > 0 and p["overlap_calls"] > 0 and p["queue_empty"], p


def test_lina_packing_beside_lancet_partitions_equals_stock(world):
    """Lina's packing p = 2 (EP 4 -> 2, two experts per rank, moved with their Adam state before ZeRO-1 flattens
    them) with Lancet's 2 partitions and deferred dW, in fp32: the partitions exchange over the packed layout's
    groups on its engine, and the losses are stock's (1e-5), each ZeRO hook once per parameter."""
    pool = world(4)
    steps, fp32 = 10, torch.float32
    stock = pool.run(train, None, steps, 1, 4, None, 1, False, fp32, timeout_s=600)
    section = {"schedule": "baseline", "lancet": {"partitions": 2}, "lina": {"micro_op_mb": 0.05, "packing": 2}}
    plugin = pool.run(train, section, steps, 1, 4, None, 1, False, fp32, timeout_s=600)
    for s, p in zip(stock, plugin):
        assert max(abs(a - b) / abs(a) for a, b in zip(s["losses"], p["losses"])) <= 1e-5, (s["losses"], p["losses"])
        assert all(set(c.values()) == {1} for c in p["hook_calls"]) and len(p["losses"]) == steps
        assert p["packing"] == [2] and p["local_experts"] == [2] and s["local_experts"] == [1], p
        assert p["ranges"] == [2 * steps] and p["lina_submitted"] > 0 and p["overlap_calls"] > 0 and p["queue_empty"]
