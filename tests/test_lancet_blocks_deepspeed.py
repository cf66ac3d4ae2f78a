"""Lancet's batch partitions on DeepSpeed (patches/deepspeed_lancet.py + moe_plugins/lancet/blocks.py): the recipes'
GPT-2-MoE on 4 gloo ranks in fp64 under ZeRO-2, dropout on: the reduced gradients equal stock DeepSpeed's
(<= 1e-12) at 2 and 4 partitions (and with the experts' dW deferred too), each ZeRO-2 hook once per parameter and
micro-step, gradient accumulation over 2 micro-steps, 20-step losses within 1e-5 of stock; the blocks restored on
disable; partitions that do not divide the micro-batch and a BERT model refused in one line."""

from __future__ import annotations

import pytest

from tests.workers.lancet_blocks_deepspeed import refused, train

EXACT = 1e-12


def _close(a, b, tol) -> bool:
    return all(float((x - y).abs().max()) <= tol for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("lancet,steps,gas", [({"partitions": 2, "defer_wgrad": False}, 20, 1),
                                              ({"partitions": 4, "defer_wgrad": False}, 3, 2),
                                              ({"partitions": 2}, 3, 1)],
                         ids=["parts2-20steps", "parts4-gas2", "parts2-deferred-dw"])
def test_partitions_on_deepspeed_equal_stock(world, lancet, steps, gas):
    pool = world(4)
    stock = pool.run(train, None, steps, gas, timeout_s=600)
    plugin = pool.run(train, {"schedule": "baseline", "lancet": lancet}, steps, gas, timeout_s=600)
    for s, p in zip(stock, plugin):
        assert max(abs(a - b) for a, b in zip(s["losses"], p["losses"])) <= 1e-5, (s["losses"], p["losses"])
        assert all(_close(a, b, EXACT) for a, b in zip(s["grads"], p["grads"])) and len(s["grads"]) == steps
        assert p["hook_calls"] == s["hook_calls"] and all(set(c.values()) == {1} for c in p["hook_calls"])
        assert p["ranges"] == [2 * steps * gas] and p["stock_calls"] == [0]     # two MoE blocks per forward
        assert p["restored"] and p["queue_empty"]
        # deferred dW: each partition's dispatch-gradient exchange (per layer and micro-step) ran the queue, its
        # experts' dW queued just before; a combine-gradient exchange runs it when earlier work is queued
        exchanges = 2 * lancet["partitions"] * steps * gas
        deferred = lancet.get("defer_wgrad", True)
        assert exchanges <= p["overlap_calls"] <= 2 * exchanges if deferred else p["overlap_calls"] == 0


def test_bad_partitions_refused_in_one_line(world, tmp_path):
    pool = world(4)
    message = pool.run(refused, {"lancet": {"partitions": 3}}, timeout_s=300)[0]
    assert message == ("moe_plugins.lancet.partitions (3) must divide the batch (4 samples per rank): each partition "
                       "holds the same whole samples; use one of [1, 2, 4]"), message
    bert = pool.run(refused, {"lancet": {"partitions": 2, "defer_wgrad": False}}, 4, True, timeout_s=300)[0]
    assert "is a BertLayer: Lancet's batch partitions know the blocks GPT2Block only" in bert, bert
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
        assert len(a["chosen"]) == 1 and len(a["chosen"][0]) == 1 and a["chosen"][0][0] in (1, 2, 4), a["chosen"]
        assert a["ranges"] == [4] and a["restored"]
    assert len({tuple(a["chosen"][0]) for a in auto}) == 1          # every rank chose the same from the same file
