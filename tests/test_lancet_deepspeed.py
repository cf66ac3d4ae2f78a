"""Lancet on the DeepSpeed host (patches/deepspeed_lancet.py): a tiny DeepSpeed MoE model in fp64 under ZeRO-2 on
4 gloo ranks (EP 4 and EP 2), trained by stock DeepSpeed, by the plugin and by the plugin with ``"lancet":
{"defer_wgrad": true}``: the reduced gradient partitions equal stock's and the plugin's (<= 1e-12) at every
boundary, each parameter's ZeRO-2 reduction hook fires once per micro-step, gradient accumulation 2, 20-step
losses equal within 1e-5, with ``engine.backward`` and with ``loss.backward()`` (the epilogue patch), pipeline
degree 1 and 2, and DeepSpeed restored after disable; one case under ZeRO-1."""

from __future__ import annotations

import pytest

from tests.workers import lancet_deepspeed as jobs

pytest.importorskip("deepspeed")

WORLD = 4
EXACT = 1e-12


def _max_err(a, b) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) if a else 0.0


CASES = [(4, 2, 20, 1, False, 1), (2, 1, 3, 2, True, 1), (4, 1, 2, 2, False, 1), (2, 2, 3, 2, True, 2)]


@pytest.mark.parametrize("ep,k,steps,gas,torch_style,degree", CASES,
                         ids=["ep4-k2-20-steps", "ep2-k1-gas2-loss.backward", "ep4-k1-gas2",
                              "ep2-k2-gas2-r2-loss.backward"])
def test_lancet_equals_stock_deepspeed_under_zero2(world, ep, k, steps, gas, torch_style, degree):
    results = world(WORLD).run(jobs.compare_runs, ep, k, steps, gas, torch_style, degree, timeout_s=400)
    for r in results:
        stock, plugin, lancet = r["stock"], r["plugin"], r["lancet"]
        assert lancet["lancet_layers"] and not plugin["lancet_layers"]
        assert lancet["items_run"] > 0 and lancet["queue_empty"]
        # r = 1: each backward ran its dW behind its dispatch exchange; r = 2: behind the chunks' backward exchanges
        # in flight on the lane (PipeMoE's _Fence runs the queue while it waits for them)
        calls = lancet["overlap_calls"]
        assert calls == steps * gas if degree == 1 else calls >= steps * gas, calls
        assert all(run["epilogue_restored"] for run in (stock, plugin, lancet))
        assert len(lancet["grads"]) == steps
        for got, want in zip(lancet["grads"], plugin["grads"]):
            assert _max_err(got, want) <= EXACT
        for got, want in zip(lancet["grads"], stock["grads"]):
            assert _max_err(got, want) <= EXACT
        for a, b in zip(lancet["losses"], stock["losses"]):
            assert abs(a - b) <= 1e-5
        params = set(stock["hook_calls"][0])
        assert params and any("deepspeed_experts" in name for name in params)
        for calls in lancet["hook_calls"]:
            assert calls == dict.fromkeys(params, 1), calls       # once per parameter and micro-step
        assert lancet["hook_calls"] == stock["hook_calls"]


def test_lancet_under_zero_1(world):       # (ZeRO 0 reduces no fp64 gradient in DeepSpeed 0.19.8, stock or not)
    for r in world(WORLD).run(jobs.compare_runs, 2, 2, 3, 2, False, 1, 1, timeout_s=400):
        stock, lancet = r["stock"], r["lancet"]
        assert lancet["items_run"] > 0 and lancet["queue_empty"] and lancet["overlap_calls"] == 6
        for got, want in zip(lancet["grads"], stock["grads"]):
            assert _max_err(got, want) <= EXACT
        assert lancet["hook_calls"] == stock["hook_calls"] and set(lancet["hook_calls"][0].values()) == {1}


def test_lancet_section_refusals(world):
    messages = world(WORLD).run(jobs.refused, {"lancet": {"partitions": 2}})
    # the tiny model holds its MoE layer in no block list: the block executor does not know it
    assert all("moe_plugins.lancet.partitions (2): Lancet's batch partitions need the model's MoE layers in one "
               "torch.nn.ModuleList of blocks; found 0" in m for m in messages), messages
