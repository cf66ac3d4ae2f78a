"""Hecate's early gather (``"hecate": {"prefetch": true}``, moe_plugins/hecate/early.py).

In one process: the overlap meter and the agreed overlap degree (pure), the config key. On 4 gloo ranks (2 nodes
x 2, EP 4) in fp64, the core layer with ``layer.prefetch()`` before other work: 6 Adam steps give the ragged
baseline's losses, outputs and input gradients (<= 1e-9) and the same parameters; the first call copies nothing
(no load seen yet), later calls copy the hot expert; every forward spAG ran on the pipeline lane; every rank
agrees on t; a prefetched call that never ran is drained, and the steps after it stay exact."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_plugins.hecate.config import HecateConfig, hecate_problems
from moe_plugins.hecate.early import UNKNOWN, OverlapMeter, agreed_overlap
from moe_plugins.hecate.plan import overlap_degree, paying_experts
from moe_plugins.tools.verify import VerifySpec
from tests.workers import hecate_early as jobs

WORLD, EXACT, STEPS = 4, 1e-9, 6
SPEC = VerifySpec(world=WORLD, ranks_per_node=2, ep=4, experts=8, tokens=24, hidden=8, ffn=12,
                  schedule="hecate", exchange="ragged", k=2, drop=False, skew=12.0, seed=5)


def test_the_meter_measures_and_keeps_a_bandwidth_once_seen():
    meter = OverlapMeter()
    assert meter.degree(1000) == UNKNOWN                       # nothing measured
    meter.measure(hide_ns=2_000_000, took_ns=0, wire_bytes=0)  # hid 2 ms, moved nothing: no bandwidth yet
    assert meter.degree(1000) == UNKNOWN
    meter.measure(hide_ns=2_000_000, took_ns=1_000_000, wire_bytes=500_000)     # 0.5 GB/s
    assert meter.degree(1000) == overlap_degree(2e-3, 5e8, 1000) == 1000
    meter.measure(hide_ns=1_000_000, took_ns=0, wire_bytes=0)  # a call with no copies keeps the bandwidth
    assert meter.degree(10_000) == 50
    meter.measure(hide_ns=-5, took_ns=1, wire_bytes=1)         # a clock step backwards hides nothing
    assert meter.degree(10) == 0
    assert meter.history == [(2e-3, None), (2e-3, 5e8), (1e-3, 5e8), (0.0, pytest.approx(1e9))]
    assert meter.degree(10) == 0 and len(meter.history) == 4          # asking again records nothing


def test_agreed_overlap_is_the_smallest_known_degree():
    assert agreed_overlap([UNKNOWN] * 4, 8) == 8                # nobody measured: every hot expert
    assert agreed_overlap([5, UNKNOWN, 3, 40], 8) == 3
    assert agreed_overlap([40, 90], 8) == 8                     # capped at E
    assert agreed_overlap([0, 7], 8) == 0                       # nothing can hide: no copies
    with pytest.raises(ValueError, match="degrees_R"):
        agreed_overlap([3, -2], 8)


def test_paying_experts_weigh_saved_token_bytes_against_the_copies():
    # 2 load row_bytes > R expert_bytes: 2 x 3000 x 256 = 1.5 MB > 4 x 66 kB; 2 x 100 x 256 = 51 kB is not
    assert paying_experts([3000, 100, 0, 600], row_bytes=256, expert_bytes=66_000, num_ranks=4) == 2
    assert paying_experts([3000, 100], row_bytes=1024, expert_bytes=1 << 20, num_ranks=4) == 1   # 1 MB experts
    assert paying_experts([515.0], row_bytes=1, expert_bytes=1, num_ranks=1030) == 0            # equal: no gain
    with pytest.raises(ValueError, match="row_bytes"):
        paying_experts([1], row_bytes=0, expert_bytes=1, num_ranks=1)
    with pytest.raises(ValueError, match="load_E"):
        paying_experts([-1], row_bytes=1, expert_bytes=1, num_ranks=1)


def test_config_takes_prefetch():
    assert HecateConfig.from_dict({"prefetch": True}).prefetch is True
    assert HecateConfig().prefetch is False
    problems = hecate_problems({"prefetch": "yes"})
    assert problems == ["moe_plugins.hecate.prefetch ('yes') must be true or false"]


def _err(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("fail_at", [-1, 2])
def test_early_gather_trains_as_the_baseline(world, fail_at):
    results = world(WORLD).run(jobs.training, SPEC, STEPS, 0.05, fail_at)
    overlaps = {tuple(r["early"]["overlap"]) for r in results}
    assert len(overlaps) == 1                                   # every rank planned with the same t
    for r in results:
        early, base = r["early"], r["ragged"]
        for step in range(STEPS):
            assert abs(early["losses"][step] - base["losses"][step]) <= EXACT * max(1.0, abs(base["losses"][step]))
            assert _err(early["y"][step], base["y"][step]) <= EXACT
            assert _err(early["grad_x"][step], base["grad_x"][step]) <= EXACT
        assert all(_err(a, b) <= EXACT for a, b in zip(early["params"], base["params"]))
        assert early["extra"][0] == 0                           # no load seen before the first gate
        assert all(n > 0 for n in early["extra"][1:]), early["extra"]   # the hot expert copied from then on
        assert early["overlap"][0] is not None and all(t >= 1 for t in early["overlap"][1:])
        forward = [s for s in early["spag"] if s[1] == "forward"]
        assert len(forward) == STEPS + (1 if fail_at >= 0 else 0)
        assert {lane for lane, _, _ in forward} == {"pipeline"}
        assert sum(b for _, _, b in forward) > 0
        assert "gathered early, planned with t" in early["notes"][0]
        if fail_at >= 0:
            assert early["refused"] == ["MoE layer input has no tokens"]


# ---- 4 gloo ranks: DeepSpeed, the recipes' GPT-2-MoE --------------------------------------------------------

@pytest.fixture(scope="module")
def stock_runs():
    """Stock DeepSpeed's runs of :func:`test_block_hooks_on_deepspeed_train_as_stock`, by dtype (plain results)."""
    return {}


@pytest.mark.parametrize("remat, lina", [(False, False), (True, False), (True, True)],
                         ids=["early-gather", "early-gather+remat", "early-gather+remat+lina"])
def test_block_hooks_on_deepspeed_train_as_stock(world, stock_runs, remat, lina):
    """The recipes' GPT-2-MoE (HF GPT-2 blocks, DeepSpeed MoE every other block) in fp64 under ZeRO-2 with dropout:
    with the early gather issued by each MoE block's pre-hook, 20 steps give stock's losses (<= 1e-5) and its
    reduced gradients (to one fp32 rounding: ZeRO-2 reduces fp64 gradients in fp32), each ZeRO hook once per
    parameter and step; both MoE layers copy experts; the hooks are removed on disable. With ``rematerialize``
    too, the copies are gathered again early on the lane (moe_plugins/hecate/regather.py): the first MoE layer's
    when the second releases its copies, the second's when the backward reaches it; none is alive after a step.
    With Lina's gradient micro-ops too (the dense and expert gradients reduced in the background on the same
    engine, the exchanges and re-gathers urgent; in fp32, as Lina sums in ZeRO's fp32 communication dtype): the
    same losses, the reduced gradients within 2e-5 of stock's largest (3.4e-6 seen: 20 steps of fp32 rounding)."""
    from tests.workers.lancet_blocks_deepspeed import train

    steps, pool = 20, world(WORLD)
    dtype = torch.float32 if lina else torch.float64     # Lina sums in the gradients' dtype: ZeRO's is fp32
    if dtype not in stock_runs:          # stock DeepSpeed's run, the same for every case of one dtype: run once
        stock_runs[dtype] = pool.run(train, None, steps, 1, 4, None, 2, dtype=dtype, timeout_s=600)
    stock = stock_runs[dtype]
    section = {"schedule": "baseline", "hecate": {"enabled": True, "prefetch": True, "rematerialize": remat}}
    if lina:
        section["lina"] = {"micro_op_mb": 0.01}
    plugin = pool.run(train, section, steps, 1, 4, None, 2, dtype=dtype, timeout_s=600)
    for s, p in zip(stock, plugin):
        assert max(abs(a - b) for a, b in zip(s["losses"], p["losses"])) <= 1e-5, (s["losses"], p["losses"])
        rel = max(float((x - y).abs().max()) / float(x.abs().max()) for a, b in zip(s["grads"], p["grads"])
                  for x, y in zip(a, b))
        assert len(p["grads"]) == steps and rel <= (2e-5 if lina else 1e-6), rel    # fp32: 20 steps' rounding
        assert p["hook_calls"] == s["hook_calls"] and all(set(c.values()) == {1} for c in p["hook_calls"])
        assert p["prefetch_hooks"] == 2 and p["pre_hooks"] == s["pre_hooks"], (p["pre_hooks"], s["pre_hooks"])
        assert len(p["hecate"]) == 2 and all(h["overlap"] is not None for h in p["hecate"])
        assert all("gathered early" in h["notes"][0] for h in p["hecate"])
        assert (p["lina_submitted"] > 0) == lina
        if remat:
            assert [h["regathers"] for h in p["hecate"]] == [{"next_layer": steps}, {"own_output": steps}]
            assert all(h["live_bytes"] == 0 and "re-gathered in backward" in h["notes"][0] for h in p["hecate"])
        else:
            assert all(h["regathers"] == {} for h in p["hecate"])
    assert any(h["extra"] > 0 for p in plugin for h in p["hecate"]), [p["hecate"] for p in plugin]
