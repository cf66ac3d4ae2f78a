"""The ragged exchange under the hosts, 4 gloo ranks: DeepSpeed's layer swapped by the adapter equals stock
DeepSpeed in fp64 (bitwise where it is for the padded exchange), and trains 20 steps with the losses of stock;
Megatron's layer equals stock Megatron in fp64."""

from __future__ import annotations

import pytest

from moe_plugins.tools.verify_deepspeed import DeepSpeedVerifySpec, host_spec_problems, run_rank
from tests.workers import deepspeed as jobs

pytest.importorskip("deepspeed")

WORLD = 4


def _spec(**kw) -> DeepSpeedVerifySpec:
    base = dict(world=WORLD, ranks_per_node=2, experts=4, tokens=16, hidden=8, ffn=16, min_capacity=0,
                dtype="float64", exchange="ragged")
    base.update(kw)
    spec = DeepSpeedVerifySpec(**base)
    assert host_spec_problems(spec) == []
    return spec


@pytest.mark.parametrize("combo", [dict(mp=2, ep=2, esp=2, k=2, drop=True, schedule="baseline-tp"),
                                   dict(mp=2, ep=4, k=2, drop=True, schedule="baseline-tp"),
                                   dict(mp=2, ep=2, k=1, drop=False, skew=20.0, schedule="baseline-tp"),
                                   dict(mp=2, ep=2, esp=2, k=2, drop=True, schedule="baseline-tp", pipeline_degree=3),
                                   dict(mp=2, ep=2, k=2, drop=False, skew=20.0, schedule="baseline-tp",
                                        pipeline_degree=2),
                                   dict(ep=4, k=2, drop=False, skew=20.0), dict(ep=4, k=1, drop=True),
                                   dict(ep=2, k=2, drop=True, skew=20.0), dict(ep=2, mp=2, esp=2, k=2, drop=True),
                                   dict(ep=4, k=2, drop=False, skew=20.0, pipeline_degree=3),
                                   dict(mp=2, ep=2, k=2, drop=True, schedule="parm-s1"),
                                   dict(mp=2, ep=2, k=2, drop=False, skew=20.0, schedule="parm-s1", pipeline_degree=2),
                                   dict(mp=2, ep=2, k=2, drop=False, skew=20.0, schedule="parm-s2"),
                                   dict(mp=2, ep=4, k=1, drop=True, schedule="parm-s2", pipeline_degree=2),
                                   dict(mp=2, ep=2, k=2, drop=False, skew=20.0, schedule="parm-auto"),
                                   dict(mp=2, ep=2, k=2, drop=True, schedule="parm-s2-saa"),
                                   dict(mp=2, ep=2, k=2, drop=False, skew=20.0, schedule="parm-s2-saa",
                                        pipeline_degree=3)],
                         ids=str)
def test_deepspeed_layer_with_the_ragged_exchange_equals_stock(world, combo):
    report = world(WORLD).run(run_rank, _spec(**combo))[0]
    assert report["ok"], report
    for key in ("max_err_out", "max_err_grad_in", "max_err_grad_w", "max_err_aux"):
        assert report[key] <= 1e-12, (key, report[key])
    assert report["routing_equal"] and report["state_keys_equal"] and report["attrs_equal"]
    # chunks run the expert GEMMs on other row counts than stock's (5e-17 apart in fp64 here)
    if combo.get("pipeline_degree", 1) == 1:
        assert report["bitwise_equal"], "outputs and input gradients bitwise equal to stock DeepSpeed"
    assert report["swaps"][0]["exchange"] == "ragged"
    layer = next(iter(report["ledger"].values()))
    # the ragged exchange: the counts, then per chunk the rows and back; backward, the rows twice per chunk
    r, schedule = combo.get("pipeline_degree", 1), combo.get("schedule", "baseline")
    group = "ep_esp" if schedule.startswith("parm") else "ep"      # Parm's fused EP&ESP exchange
    if schedule == "parm-auto" and f"forward:all_to_all@{group}" not in layer:
        group = "ep"                                                # it chose DeepSpeed's flow
    assert layer[f"forward:all_to_all@{group}"]["count"] == 1 + 2 * r
    assert layer[f"backward:all_to_all@{group}"]["count"] == 2 * r
    if schedule in ("baseline-tp", "parm-s2"):     # the MP rank's slice: its uneven split and gather
        assert layer["forward:all_to_all@mp"]["count"] == layer["backward:all_to_all@mp"]["count"] == 1


def test_deepspeed_training_20_steps_ragged_equals_stock(world):
    results = world(WORLD).run(jobs.train_on_and_off, 1, {"schedule": "baseline", "exchange": "ragged"}, 4, 2, 0, 20)
    for rank, res in enumerate(results):
        off, on = res["off"]["losses"], res["on"]["losses"]
        assert len(off) == len(on) == 20
        rel = max(abs(a - b) / abs(a) for a, b in zip(off, on))
        assert rel <= 1e-5, (rank, rel)
    log = results[0]["on"]["log"]
    assert any("runs schedule 'baseline', ragged exchange" in line for line in log), log


def test_megatron_layer_with_the_ragged_exchange_equals_stock(world):
    pytest.importorskip("megatron.core")
    from moe_plugins.tools.verify_megatron import MegatronVerifySpec
    from moe_plugins.tools.verify_megatron import run_rank as megatron_rank
    # ESP 1: Megatron's experts get the kept rows only, with tokens_per_expert (LayerParams.row_experts)
    for kw in (dict(ep=4, k=2, drop=False), dict(ep=2, mp=2, esp=2, k=1, drop=True),
               dict(ep=4, k=2, drop=False, pipeline_degree=2), dict(ep=2, k=2, drop=True),
               dict(ep=2, mp=2, k=2, drop=False, schedule="parm-s1"),
               dict(ep=2, mp=2, k=1, drop=True, schedule="parm-s2", pipeline_degree=2),
               dict(ep=2, mp=2, k=2, drop=True, schedule="parm-auto")):
        spec = MegatronVerifySpec(world=WORLD, ranks_per_node=2, experts=4, tokens=16, hidden=8, ffn=16,
                                  min_capacity=0, dtype="float64", exchange="ragged", **kw)
        report = world(WORLD).run(megatron_rank, spec)[0]
        assert report["ok"] and report["routing_equal"], report
        assert max(report[k] for k in ("max_err_out", "max_err_grad_in", "max_err_grad_w")) <= 1e-12
