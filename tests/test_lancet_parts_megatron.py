"""Lancet's batch partitions on Megatron-core (patches/megatron_lancet_parts.py + moe_plugins/lancet/blocks.py): the
recipes' GPT-2-MoE and BERT-MoE with Megatron's MoE layers in Megatron's DDP on 4 gloo ranks, fp64, dropout on:
every ``main_grad`` equal to stock Megatron's (<= 1e-12) at 2 and 4 partitions, with the experts' dW deferred too,
with gradient accumulation over 2 micro-steps, at EP 4 and at EP 2 (expert-DP 2); each DDP hook once per parameter
and backward; a skewed top-2 gate drops the same routes; the blocks restored on disable; bad setups refused in one
line naming the field."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.workers.lancet_parts_megatron import refused, train  # noqa: E402

EXACT = 1e-12
TIMEOUT_S = 900


def _max_diff(a, b) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("lancet,kw", [({"partitions": 2, "defer_wgrad": False}, {"steps": 4}),
                                       ({"partitions": 4}, {"accumulate": 2}),
                                       ({"partitions": 2, "defer_wgrad": False}, {"ep": 2, "skew": True}),
                                       ({"partitions": 2}, {"bert": True})],
                         ids=["gpt2-parts2", "gpt2-parts4-dw-gas2", "gpt2-ep2-skewed", "bert-parts2-dw"])
def test_partitions_on_megatron_equal_stock(world, lancet, kw):
    pool = world(4)
    stock = pool.run(train, None, **kw, timeout_s=TIMEOUT_S)
    plugin = pool.run(train, {"schedule": "baseline", "exchange": "padded", "lancet": lancet}, **kw,
                      timeout_s=TIMEOUT_S)
    steps, accumulate = kw.get("steps", 3), kw.get("accumulate", 1)
    for s, p in zip(stock, plugin):
        assert len(p["grads"]) == steps and len(p["losses"]) == steps * accumulate
        assert max(abs(a - b) for a, b in zip(s["losses"], p["losses"])) <= EXACT, (s["losses"], p["losses"])
        assert max(_max_diff(a, b) for a, b in zip(s["grads"], p["grads"])) <= EXACT
        assert all(set(c.values()) == {1} for c in p["hooks"]) and p["hooks"] == s["hooks"]
        assert p["dropped"] == s["dropped"] and len(p["dropped"]) == 2 * steps * accumulate
        if kw.get("skew"):
            assert min(p["dropped"]) > 0, p["dropped"]          # the gate drops routes every forward
        assert p["ranges"] == 2 * steps * accumulate and p["stock_calls"] == 0
        assert p["chosen"] == [lancet["partitions"]] and p["restored"]
        assert p["blocks"] == ["BertLayer" if kw.get("bert") else "GPT2Block"] * 4


def test_lina_micro_ops_beside_partitions_equal_stock(world):
    """Lina's gradient micro-ops (the engine's background lane) beside 2 partitions with deferred dW (their
    exchanges and dW on the same engine's pipeline lane), EP 2 x expert-DP 2, accumulation 2: every ``main_grad``
    and loss stock Megatron's (fp64), each DDP hook once, the buckets reduced as micro-ops."""
    pool = world(4)
    kw = {"ep": 2, "accumulate": 2}
    stock = pool.run(train, None, **kw, timeout_s=TIMEOUT_S)
    section = {"schedule": "baseline", "exchange": "padded", "lancet": {"partitions": 2},
               "lina": {"micro_op_mb": 0.001}}
    plugin = pool.run(train, section, **kw, timeout_s=TIMEOUT_S)
    for s, p in zip(stock, plugin):
        assert len(p["grads"]) == 3 and max(abs(a - b) for a, b in zip(s["losses"], p["losses"])) <= EXACT
        assert max(_max_diff(a, b) for a, b in zip(s["grads"], p["grads"])) <= EXACT
        assert all(set(c.values()) == {1} for c in p["hooks"]) and p["hooks"] == s["hooks"]
        assert p["ranges"] == 2 * 3 * 2 and p["chosen"] == [2] and p["restored"]
        assert p["micro_ops"] > 0 and p["routed"] > 0, (p["micro_ops"], p["routed"])


def test_lina_packing_beside_partitions_equals_stock(world):
    """Lina's packing p = 2 (EP 4 -> 2: two experts per rank, regrouped when DDP is built) with 2 partitions and
    deferred dW: the partitions exchange over the packed layout's groups on its engine; the losses and every
    non-expert ``main_grad`` are stock Megatron's in fp64 (the experts' gradients live on other ranks now)."""
    pool = world(4)
    stock = pool.run(train, None, timeout_s=TIMEOUT_S)
    section = {"schedule": "baseline", "exchange": "padded", "lancet": {"partitions": 2},
               "lina": {"micro_op_mb": 0.001, "packing": 2}}
    plugin = pool.run(train, section, timeout_s=TIMEOUT_S)
    for s, p in zip(stock, plugin):
        assert max(abs(a - b) for a, b in zip(s["losses"], p["losses"])) <= EXACT, (s["losses"], p["losses"])
        dense = [{n: g for n, g in step.items() if "local_experts" not in n} for step in s["grads"]]
        assert len(dense[0]) > 0 and max(_max_diff(a, {n: b[n] for n in a}) for a, b in zip(dense, p["grads"])) <= EXACT
        assert p["local_experts"] == [2] and p["ranges"] == 2 * 3 and p["micro_ops"] > 0


def test_auto_and_tune_on_megatron_stay_exact(world, tmp_path):
    """``"auto"`` (the planner's model priced by a profile measured for the layers' layout) and ``"tune"`` (the
    executor times its own ranges at 1, 2, 4 partitions) on Megatron: whatever they run, stock's gradients, and
    every rank decides the same."""
    pool = world(4)
    steps = 12
    stock = pool.run(train, None, steps=steps, timeout_s=TIMEOUT_S)
    section = {"schedule": "baseline", "exchange": "padded", "lancet": {"partitions": "auto", "defer_wgrad": False}}
    auto = pool.run(train, section, steps=2, profile_dir=str(tmp_path), timeout_s=TIMEOUT_S)
    section["lancet"]["partitions"] = "tune"
    tune = pool.run(train, section, steps=steps, timeout_s=TIMEOUT_S)
    for s, a, t in zip(stock, auto, tune):
        assert max(_max_diff(x, y) for x, y in zip(s["grads"][:2], a["grads"])) <= EXACT
        assert max(_max_diff(x, y) for x, y in zip(s["grads"], t["grads"])) <= EXACT
        assert a["chosen"] and set(a["chosen"]) <= {1, 2, 4} and a["ranges"] == 4, a       # a count per range
        ((choice, times),) = t["tuned"].values()                       # one batch shape, training
        assert choice in (1, 2, 4) and 1 in times and set(times) <= {1, 2, 4} and len(times) >= 2, t["tuned"]
        assert set(times) <= set(t["chosen"]) and t["ranges"] == 2 * steps
    assert len({repr(a["chosen"]) for a in auto}) == 1 and len({repr(t["tuned"]) for t in tune}) == 1


def test_bad_setups_refused_in_one_line(world):
    pool = world(4)
    section = {"schedule": "baseline", "exchange": "padded", "lancet": {"partitions": 3, "defer_wgrad": False}}
    assert all("moe_plugins.lancet.partitions (3) must divide the batch (4 samples per rank)" in e
               for e in pool.run(refused, section, timeout_s=TIMEOUT_S))
    section["lancet"]["partitions"] = 2
    assert all("this MoE layer's model was not handed to handle.lancet.partitions.wrap_model" in e
               for e in pool.run(refused, section, skip_wrap=True, timeout_s=TIMEOUT_S))
    assert all("GPT2Block.mlp changes the MoE layer's output (a residual MoE, a scale, a copy...); partitions need it "
               "to return the layer's output y or a view of all of it (batch-first: y.transpose(0, 1)), not a copy" in e
               for e in pool.run(refused, section, copying=True, timeout_s=TIMEOUT_S))
    for e in pool.run(refused, section, ep=2, tp=2, timeout_s=TIMEOUT_S):      # every layer named, in one error
        assert e.count("tensor_model_parallel_size (2) must be 1; partitions cut whole samples") == 2, e
        assert "moe_plugins.lancet.partitions on Megatron MoE layer megatron.moe.2" in e, e
