"""Hecate's re-materialisation (``"hecate": {"rematerialize": true}``, moe_plugins/hecate/remat.py) and the
copy-memory ledger (moe_plugins/hecate/memory.py).

In one process: the config, the ledger's merge of several layers (peaks, steps, per call rows), real tensor
lifetimes, and the saved-tensor hooks on a toy copy (freed after forward, one re-gather per backward, gradients
bitwise those without, an in-place change refused; an early re-gather started once and used, the chain holding
calls weakly). On 4 gloo ranks (2 nodes x 2) in fp64: one core layer with
it equals the reference, the baseline and Hecate without it (bitwise), with one more ``spag`` in backward of the
forward's bytes; a stack of 3 MoE layers trains bitwise as without it while at most one layer's copies are alive
(<= 1/L + 10% of the run without it), also with the re-gathers started early on a pipeline lane; on DeepSpeed it equals stock in fp64 and trains under ZeRO 2 with stock's
losses."""

from __future__ import annotations

import gc
import weakref
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

from moe_plugins.core.experts import ExpertWeights
from moe_plugins.core.plugin_config import PluginConfig
from moe_plugins.hecate.config import HecateConfig
from moe_plugins.hecate.memory import CopyLedger, CopyRecord, call_rows, live_peak, step_peaks
from moe_plugins.hecate.plan import Placement, stock_homes
from moe_plugins.hecate.remat import OwnedRead, Rematerialiser, RereadableWeights
from moe_plugins.hecate.schedule import HecateSchedule
from moe_plugins.hecate.flow import expert_numel
from moe_plugins.hecate.sparse import sparse_bytes, whole_shards
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify import VerifySpec, compare
from tests.workers import hecate_remat as jobs

WORLD, LAYERS, EXACT = 4, 3, 1e-9
NODES = (0, 0, 1, 1)
SPEC = VerifySpec(world=WORLD, ranks_per_node=2, ep=4, experts=8, tokens=24, hidden=8, ffn=12,
                  schedule="hecate", exchange="ragged")
REMAT = {"hecate": {"enabled": True, "rematerialize": True}}


def _err(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


# ---- config ----------------------------------------------------------------------------------------------

def test_config_accepts_rematerialize_with_the_same_rules():
    from moe_plugins.patches.deepspeed_hecate import config_choices
    cfg = PluginConfig.from_dict(REMAT, **config_choices())             # the DeepSpeed adapter's rules
    assert HecateConfig.from_dict(cfg.hecate).rematerialize is True
    assert HecateSchedule.from_section({"rematerialize": True}).options.rematerialize is True
    assert HecateConfig().rematerialize is False and HecateConfig().regather == "early"
    assert HecateSchedule.from_section({"rematerialize": True, "regather": "at_need"}).options.regather == "at_need"
    from moe_plugins.hecate.config import lane_on                 # an early re-gather needs the pipeline lane
    assert lane_on(cfg) and not lane_on(PluginConfig.from_dict({"hecate": {**REMAT["hecate"], "regather": "at_need"}},
                                                               **config_choices()))
    for section, message in (({"hecate": {"rematerialize": "yes"}}, r"rematerialize \('yes'\) must be true or false"),
                             ({"hecate": {"rematerialize": True, "regather": "soon"}},
                              r"regather \('soon'\) must be one of 'early', 'at_need'"),
                             ({"hecate": {"rematerialize": True, "reshard_every": -5}},
                              r"reshard_every \(-5\) must be an integer >= 0"),
                             ({**REMAT, "pipeline_degree": 2}, r"pipeline_degree \(2\) must be 1 with "
                                                               r"moe_plugins\.hecate\.rematerialize"),
                             ({**REMAT, "schedule": "parm-s2"}, r"schedule \('parm-s2'\) cannot run Hecate")):
        with pytest.raises(ValueError, match=message):
            PluginConfig.from_dict(section, **config_choices())
    with pytest.raises(ValueError, match="Hecate is run by the DeepSpeed and Megatron-core adapters"):   # others refuse
        PluginConfig.from_dict(REMAT, **default_registry().config_choices())


# ---- the ledger (one process) ----------------------------------------------------------------------------

def _ledger(layer, *spans):
    ledger = CopyLedger(layer)
    for i, (alloc, free, size) in enumerate(spans):
        ledger.records.append(CopyRecord(layer, "forward", i, size, alloc, free))
    return ledger


def test_live_peak_merges_layers_steps_and_calls():
    a = _ledger("a", (10, 40, 100), (50, 60, 100))
    b = _ledger("b", (20, 30, 10), (40, None, 7))        # a copy still alive; one made as another is freed
    assert live_peak([a]) == 100 and live_peak([a, b]) == 110
    assert live_peak([a, b, a]) == 110                    # a ledger passed twice counts once
    assert live_peak([a, b], 30, 45) == 107               # a tie (40): the materialisation counts first
    assert live_peak([a, b], 41, 49) == 7 and live_peak([a, b], 0, 5) == 0
    assert step_peaks([a, b], [0, 35, 70]) == [110, 107]
    assert [(r["layer"], r["call"], r["live_after"]) for r in call_rows([a, b])] == [
        ("a", 0, 100), ("b", 0, 110), ("b", 1, 107), ("a", 1, 107)]
    with pytest.raises(ValueError, match=r"bounds_ns \(\[5, 1\]\) must be at least two increasing stamps"):
        step_peaks([a], [5, 1])
    with pytest.raises(ValueError, match=r"phase \('sideways'\) must be one of"):
        a.track(torch.zeros(2), "sideways", 0)
    with pytest.raises(ValueError, match=r"keep \(0\) must be an integer >= 1"):
        CopyLedger("a", keep=0)


def test_the_ledger_follows_real_tensor_lifetimes():
    ledger = CopyLedger("moe", keep=2)
    w_CF = torch.cat([torch.ones(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)]).view(2, 6)
    record = ledger.track(w_CF, "forward", 0)               # a view: its base is what views keep alive
    kept = w_CF[1]
    del w_CF
    gc.collect()
    assert ledger.live_bytes == 96 and record.free_ns is None
    del kept
    gc.collect()
    assert ledger.live_bytes == 0 and record.free_ns is not None and ledger.peak_bytes == 96
    for call in (1, 2):
        ledger.track(torch.zeros(3), "backward", call)
    assert len(ledger.records) == 2 and ledger.summary() == {           # older records drop out, totals stay
        "live_bytes": 0, "peak_bytes": 96, "forward_copies": 1, "forward_bytes": 96, "backward_copies": 2,
        "backward_bytes": 24}


def _toy(owned_EF: torch.Tensor, remat: bool, ledger: CopyLedger, early=None):
    """A copy tensor made from ``owned_EF`` (twice each row, as spAG would), used by two GEMMs like an expert
    (``early``: the Rematerialiser's early issuer)."""
    def gather(w):
        return torch.cat([w, w]).contiguous()
    w_CF = _Gather.apply(owned_EF, gather)
    ledger.track(w_CF, "forward", 0)
    x_CNF = torch.linspace(-1, 1, 4 * 3 * owned_EF.shape[1], dtype=torch.float64).view(4, 3, -1).requires_grad_()
    r = None
    if remat:
        owned = OwnedRead(ExpertWeights(owned_EF, owned_EF, owned_EF, owned_EF))
        r = Rematerialiser(w_CF, lambda: gather(owned.read().w1_EMH.detach()),
                           lambda w: ledger.track(w, "backward", 0), early=early)
    with r.hooks() if r is not None else nullcontext():
        t = torch.bmm(x_CNF, w_CF.unsqueeze(2)).tanh()          # tanh saves its output
        y = (t * torch.bmm(x_CNF, w_CF.flip(1).unsqueeze(2))).sum()
    return y, r, weakref.ref(t)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, gather):
        return gather(w)

    @staticmethod
    def backward(ctx, g):
        half = g.shape[0] // 2
        return g[:half] + g[half:], None


def test_rematerialiser_frees_the_copies_and_gathers_once_per_backward():
    base = torch.linspace(0.1, 0.9, 10, dtype=torch.float64).view(2, 5)
    grads = {}
    for remat in (False, True):
        owned = base.clone().requires_grad_(True)
        ledger = CopyLedger("toy")
        y, r, saved = _toy(owned, remat, ledger)
        gc.collect()
        assert ledger.live_bytes == (0 if remat else 160), remat          # freed after the forward with remat
        y.backward(retain_graph=True)
        grads[remat] = owned.grad.clone()
        if remat:
            assert r.gathers == 1 and ledger.totals["backward"] == (1, 160)
            owned.grad = None
            y.backward()                                                  # a second backward gathers again
            assert r.gathers == 2 and torch.equal(owned.grad, grads[True])
        del y
        gc.collect()
        assert ledger.live_bytes == 0 and saved() is None                 # the graph and what it saved are gone
    assert torch.equal(grads[True], grads[False])                        # bitwise: the same copies, re-gathered
    y, r, saved = _toy(base.clone().requires_grad_(True), True, CopyLedger("toy"))
    del y                                                                # a graph dropped without a backward
    gc.collect()
    assert saved() is None and r.gathers == 0
    owned = base.clone().requires_grad_(True)
    y, _, _ = _toy(owned, True, CopyLedger("toy"))
    with torch.no_grad():
        owned.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place between the layer's forward and its backward"):
        y.backward()


class _Ready:
    """A handle whose result is there (an early re-gather that finished)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def wait(self) -> torch.Tensor:
        return self.w


def test_an_early_regather_is_used_once_and_the_chain_holds_calls_weakly():
    from moe_plugins.hecate.regather import RegatherChain
    base = torch.linspace(0.1, 0.9, 10, dtype=torch.float64).view(2, 5)
    ledger, issued = CopyLedger("toy"), []

    def early():                        # what regather._issue does: gather, record, hand over
        w = torch.cat([base, base]).contiguous()
        ledger.track(w, "backward", 0)
        issued.append(w)
        return _Ready(w)
    owned = base.clone().requires_grad_(True)
    y, r, _ = _toy(owned, True, ledger, early=early)
    assert r.start_early() and not r.start_early() and len(issued) == 1       # started once
    y.backward()
    assert r.gathers == r.early_gathers == 1 and len(issued) == 1             # the early copies served the views
    assert ledger.totals["backward"] == (1, 160) and not r.start_early()     # served: nothing more to start
    plain = base.clone().requires_grad_(True)
    _toy(plain, False, CopyLedger("toy"))[0].backward()
    assert torch.equal(owned.grad, plain.grad)
    with torch.no_grad():                                                     # nothing saved: nothing to start
        _, idle, _ = _toy(base.clone(), True, CopyLedger("toy"), early=early)
    assert not idle.start_early() and len(issued) == 1
    chain = RegatherChain()
    y1, r1, _ = _toy(base.clone().requires_grad_(True), True, CopyLedger("toy"), early=early)
    y2, r2, _ = _toy(base.clone().requires_grad_(True), True, CopyLedger("toy"), early=early)
    assert chain.push(r1) is None
    previous = chain.push(r2)
    assert previous() is r1
    del y1, r1                                                                # its graph dropped without backward
    gc.collect()
    assert previous() is None


def test_rereadable_weights_are_read_again_not_held():
    param = torch.nn.Parameter(torch.ones(2, 3))
    reads = []

    def reread():
        reads.append(1)
        return ExpertWeights(param.detach() * 2, param.detach(), param.detach(), param.detach())
    stacked = param * 2
    owned = OwnedRead(RereadableWeights(stacked, param, param, param, reread=reread, sources=(param,)))
    assert reads == [] and torch.equal(owned.read().w1_EMH, stacked) and reads == [1]
    with torch.no_grad():
        param.add_(1)
    with pytest.raises(RuntimeError, match=r"versions \[0\] -> \[1\]"):
        owned.read()


def test_deepspeed_stacked_weights_are_rereadable_from_the_parameters():
    from moe_plugins.patches.deepspeed_hecate import stacked_weights
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 4))
                                  for _ in range(2))
    w = stacked_weights(experts)
    again = w.reread()
    assert isinstance(w, RereadableWeights) and w.w1_EMH.grad_fn is not None and again.w1_EMH.grad_fn is None
    assert all(torch.equal(a, b) for a, b in zip((w.w1_EMH, w.b1_EH, w.w2_EHM, w.b2_EM),
                                                 (again.w1_EMH, again.b1_EH, again.w2_EHM, again.b2_EM)))
    assert sorted(map(id, w.sources)) == sorted(map(id, experts.parameters())) and len(w.sources) == 8


# ---- 4 gloo ranks: the core layer ------------------------------------------------------------------------

ONE_LAYER = [replace(SPEC, k=1, drop=True, skew=12.0, seed=4, capacity_factor=1.5),
             replace(SPEC, k=2, drop=False, skew=12.0, seed=5),
             replace(SPEC, mp=2, ep=2, k=2, drop=True, skew=12.0, seed=5, capacity_factor=1.5)]


def test_one_layer_with_remat_equals_reference_and_the_run_without(world):
    results = world(WORLD).run(jobs.one_layer, ONE_LAYER)
    for i, spec in enumerate(ONE_LAYER):
        ranks = [r[i] for r in results]
        report = compare(replace(spec, schedule="baseline"), [r["remat"] for r in ranks])
        assert report["ok"], (spec, {k: v for k, v in report.items() if k.startswith("max_err")})
        for r in ranks:
            on, off, base = r["remat"], r["hecate"], r["ragged"]
            for key in ("y", "grad_x", "grad_wg", "aux", "counts"):
                assert torch.equal(on[key], off[key]), (spec, key)             # bitwise the run without it
                assert _err(on[key], base[key]) <= EXACT, (spec, key)
            assert on["dropped"] == off["dropped"] == base["dropped"]
            assert all(torch.equal(a, b) for a, b in zip(on["grad_experts"], off["grad_experts"]))
            assert on["accumulated"] == off["accumulated"] == {n: 1 for n in on["accumulated"]}
            assert len(on["accumulated"]) == 5                                  # gate + 4 expert tensors, once each
            led_on, led_off = on["ledger"]["moe"], off["ledger"]["moe"]
            assert led_on["backward:spag@ep"]["count"] == led_on["forward:spag@ep"]["count"] == 1
            assert led_on["backward:spag@ep"]["bytes"] == led_on["forward:spag@ep"]["bytes"]
            assert led_on["backward:sprs@ep"] == led_off["backward:sprs@ep"]
            assert "backward:spag@ep" not in led_off
            assert on["memory"]["backward_copies"] == 1 and on["memory"]["live_bytes"] == 0
            assert on["memory"]["backward_bytes"] == on["memory"]["forward_bytes"] > 0
            assert off["memory"]["backward_copies"] == 0
            if spec.mp == 1:         # the ledger's spag bytes, each way: those of the plan
                want = sparse_bytes(Placement(on["copies_E"], NODES),
                                    whole_shards(expert_numel(spec.hidden, spec.ffn), stock_homes(8, WORLD), WORLD),
                                    on["rank"], 8)
                assert led_on["forward:spag@ep"]["bytes"] == led_on["backward:spag@ep"]["bytes"] == want.sent


def test_a_stack_of_layers_keeps_one_layers_copies_and_trains_as_without(world):
    steps = 2
    spec = replace(SPEC, k=2, drop=False, skew=6.0, seed=3)
    for rank, res in enumerate(world(WORLD).run(jobs.stack_training, spec, LAYERS, steps)):
        on, off, base, early = res["remat"], res["hecate"], res["ragged"], res["early"]
        # training: bitwise the run without it, the baseline's within 1e-9
        assert on["losses"] == off["losses"] and len(set(on["losses"])) == steps
        assert max(abs(a - b) for a, b in zip(on["losses"], base["losses"])) <= EXACT
        for key in ("y", "grad_x"):
            assert torch.equal(on[key], off[key]) and _err(on[key], base[key]) <= EXACT
        assert all(torch.equal(a, b) for a, b in zip(on["grads"] + on["params"], off["grads"] + off["params"]))
        assert max(_err(a, b) for a, b in zip(on["params"], base["params"])) <= EXACT
        for run in (on, off, base):                       # every parameter's gradient accumulated once a step
            assert run["accumulated"] == {n: steps for n in run["names"]} and len(run["names"]) == 5 * LAYERS
        # memory: every layer's copies alive after the forward without it; none with it
        made = {(row["layer"], row["call"]): row["bytes"] for row in off["calls"] if row["phase"] == "forward"}
        assert made == {(row["layer"], row["call"]): row["bytes"] for row in on["calls"] if row["phase"] == "forward"}
        per_step = [sum(made[(f"moe{i}", s)] for i in range(LAYERS)) for s in range(steps)]
        assert min(made.values()) > 0 and all(e > 0 for e in off["extra"])
        assert off["live_forward"] == per_step and on["live_forward"] == [0] * steps
        assert on["live_backward"] == off["live_backward"] == [0] * steps
        assert off["step_peaks"] == per_step and off["peak"] == max(per_step)
        assert on["peak"] == max(made.values()), (rank, on["peak"], made)          # one layer's copies at a time
        assert on["peak"] <= (1 / LAYERS + 0.1) * off["peak"], (rank, on["peak"], off["peak"])
        assert all(a <= (1 / LAYERS + 0.1) * b for a, b in zip(on["step_peaks"], off["step_peaks"]))
        assert max(row["live_after"] for row in on["calls"]) == on["peak"]
        regathered = {(row["layer"], row["call"]): row["bytes"] for row in on["calls"] if row["phase"] == "backward"}
        assert regathered == made                        # every layer call's copies gathered again, same bytes
        # the price: one more spag per layer and step, of the forward's bytes; sprs unchanged
        for layer in (f"moe{i}" for i in range(LAYERS)):
            led_on, led_off = on["ledger"][layer], off["ledger"][layer]
            assert led_on["backward:spag@ep"]["count"] == led_on["forward:spag@ep"]["count"] == steps
            assert led_on["backward:spag@ep"]["bytes"] == led_on["forward:spag@ep"]["bytes"]
            assert led_on["forward:spag@ep"] == led_off["forward:spag@ep"]
            assert led_on["backward:sprs@ep"] == led_off["backward:sprs@ep"]
            assert "backward:spag@ep" not in led_off
        # the early re-gather (a pipeline lane, the layers chained): bitwise the same, still one layer's copies
        # at a time, every re-gather started before the backward needed it: layers 0..L-2 when the next layer
        # released its copies, the last when the gradient reached its output; without a lane all at need
        assert early["losses"] == on["losses"]
        assert all(torch.equal(a, b) for a, b in zip(early["grads"] + early["params"], on["grads"] + on["params"]))
        assert early["regathers"] == [{"next_layer": steps}] * (LAYERS - 1) + [{"own_output": steps}]
        assert on["regathers"] == res["at_need"]["regathers"] == [{"at_need": steps}] * LAYERS   # "regather": "at_need"
        assert res["at_need"]["losses"] == on["losses"] and res["at_need"]["ledger"] == on["ledger"]
        assert early["live_forward"] == early["live_backward"] == [0] * steps
        assert early["peak"] == on["peak"] and early["step_peaks"] == on["step_peaks"], (rank, early["peak"])
        assert {(r["layer"], r["call"]): r["bytes"] for r in early["calls"] if r["phase"] == "backward"} == made
        assert early["ledger"] == on["ledger"]                # the same collectives, bytes and phases


# ---- 4 gloo ranks: DeepSpeed -----------------------------------------------------------------------------

def test_deepspeed_fp64_with_remat_equals_stock(world):
    pytest.importorskip("deepspeed")
    from moe_plugins.tools.verify_deepspeed import DeepSpeedVerifySpec
    from tests.workers.hecate_deepspeed import fp64_against_stock
    spec = DeepSpeedVerifySpec(world=WORLD, ranks_per_node=2, experts=8, tokens=16, hidden=8, ffn=16,
                               min_capacity=0, dtype="float64", schedule="hecate", exchange="ragged", skew=6.0,
                               ep=4, k=2, drop=False)
    report = world(WORLD).run(fp64_against_stock, spec, REMAT)[0]
    assert report["ok"] and report["routing_equal"] and report["expert_ids_equal"], report
    assert max(report[k] for k in ("max_err_out", "max_err_grad_in", "max_err_grad_w", "max_err_aux")) <= EXACT
    layer = next(iter(report["ledger"].values()))
    assert layer["forward:spag@ep"]["count"] == layer["backward:spag@ep"]["count"] == 1
    assert layer["forward:spag@ep"]["bytes"] == layer["backward:spag@ep"]["bytes"] > 0
    for r in report["ranks"]:
        assert r["hecate"]["extra"] > 0 and r["accumulated"] == {n: 1 for n in r["params"]}


def test_deepspeed_zero2_with_remat_trains_as_stock(world):
    pytest.importorskip("deepspeed")
    steps = 4
    for rank, res in enumerate(world(WORLD).run(jobs.deepspeed_on_and_off, 2, REMAT, 2, 2, 0, steps)):
        off, on = res["off"], res["on"]
        rel = max(abs(a - b) / abs(a) for a, b in zip(off["losses"], on["losses"]))
        assert len(on["losses"]) == steps and rel <= 1e-5, (rank, rel)
        assert on["swaps"][0]["schedule"] == "hecate" and on["extra"] > 0
        assert "re-gathered in backward" in on["notes"][0]
        assert on["zero_hooks"] == off["zero_hooks"] == {n: steps for n in on["params"]}   # ZeRO 2's hook once
        layer = next(iter(on["ledger"].values()))
        assert layer["backward:spag@ep"]["count"] == layer["forward:spag@ep"]["count"] == steps
        assert layer["backward:sprs@ep"]["count"] == steps
        memory = on["memory"]
        assert memory["backward_copies"] == memory["forward_copies"] == steps and memory["live_bytes"] == 0
        assert memory["backward_bytes"] == memory["forward_bytes"] > 0
        assert on["live_forward"] == [0] * steps                       # freed after the forward
        assert on["regathers"] == {"own_output": steps}        # on the adapter's lane, as the backward reached it
        assert max(on["step_peaks"]) == memory["peak_bytes"] > 0 and min(on["step_peaks"]) > 0
