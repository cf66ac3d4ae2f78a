# Ported from DeepSpeed (https://github.com/deepspeedai/DeepSpeed) tests/unit/v1/moe/test_moe_tp.py.
# Copyright (c) Microsoft Corporation. SPDX-License-Identifier: Apache-2.0 (the original test logic).
# Changed: CPU/gloo pool harness instead of DistributedTest, fp32 instead of fp16; each test runs stock and with
# the moe_plugins DeepSpeed adapter on (baseline, pipeline degree 2, Parm S2), compared with stock.
"""DeepSpeed's MoE-under-tensor-parallelism test (tests/unit/v1/moe/test_moe_tp.py::TestMOETensorParallel; read
from a fork's copy at the v1 path, the same test DeepSpeed keeps at tests/unit/moe/test_moe_tp.py), against the
installed DeepSpeed 0.19.8, stock and with the plugin on.

DeepSpeed's test builds a bare MoE layer under its 4-rank test MPU (contiguous TP blocks) and asserts the number
of local experts and the expert-model-parallel world size after ``deepspeed.initialize``. The port adds one
forward and backward of the layer on tokens shared by each TP group, and checks that with the plugin on the
output, the aux loss and the input gradient equal stock DeepSpeed's.

Parm (``parm-s2``) needs MP > 1, which every layout here has. It refuses DeepSpeed's expert tensor parallelism
(its local combine needs the experts' partial sums, which enable_expert_tensor_parallelism's experts do not
expose): those cases assert the refusal message. TestMOETensorParallelTutel is not ported (Tutel is not
installed; the plugin refuses ``use_tutel``)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.peer import workers as jobs

pytest.importorskip("deepspeed")

FULL = os.environ.get("MOE_PLUGINS_PEER", "") == "full"
MODES = ["stock", "baseline", "baseline-r2", "parm-s2"]
PARM_ETP_REFUSAL = ("moe_plugins.schedule ('parm-s2') cannot run with DeepSpeed's expert tensor parallelism "
                    "(esp {tp}): its local combine needs the experts' partial sums, and "
                    "enable_expert_tensor_parallelism's expert modules all-reduce inside themselves; allowed here: "
                    "'baseline', 'baseline-tp'")

_stock = {}


def run_stock(world, *args):
    if args not in _stock:
        _stock[args] = world(4).run(jobs.moe_tp, "stock", *args)
    return _stock[args]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("use_residual", [True, False])
@pytest.mark.parametrize("enable_expert_tp", [True, False])
@pytest.mark.parametrize("ep_size, tp_size", [(1, 2), (1, 4), (2, 2)])
def test_moe_tensor_parallel(world, ep_size, tp_size, enable_expert_tp, use_residual, mode):
    """Ports tests/unit/v1/moe/test_moe_tp.py::TestMOETensorParallel::test@619e3199 (xylian86/DeepSpeed's copy of
    DeepSpeed's test; world 4, EP x TP in {1x2, 1x4, 2x2}, expert TP on/off, residual on/off)."""
    if not FULL and mode == "baseline-r2" and use_residual:
        pytest.skip("CI share: pipeline degree 2 without the residual MLP only (MOE_PLUGINS_PEER=full runs all)")
    base = run_stock(world, ep_size, tp_size, enable_expert_tp, use_residual)
    ranks = base if mode == "stock" else world(4).run(jobs.moe_tp, mode, ep_size, tp_size, enable_expert_tp,
                                                      use_residual)
    if mode == "parm-s2" and enable_expert_tp:
        for r in ranks:
            assert PARM_ETP_REFUSAL.format(tp=tp_size) in r.get("refused", ""), r
            assert r["refused"].startswith(jobs.REFUSAL + " <root>: ")
        return
    world_size = len(ranks)
    for r, s in zip(ranks, base):
        assert "refused" not in r, r
        assert r["num_local_experts"] == world_size // ep_size
        assert r["expert_mp_world_size"] == (tp_size if enable_expert_tp else 1)
        if mode == "stock":
            assert r["swaps"] == []
            continue
        assert [(w["schedule"], w["mp"], w["ep"], w["esp"]) for w in r["swaps"]] == \
            [(jobs.SECTIONS[mode]["schedule"], tp_size, ep_size, tp_size if enable_expert_tp else 1)]
        torch.testing.assert_close(r["output"], s["output"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["x_grad"], s["x_grad"], rtol=1e-5, atol=1e-6)
        assert r["l_aux"] == pytest.approx(s["l_aux"], rel=1e-6)
