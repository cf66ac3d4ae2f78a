"""Hecate's FSSDP in the core MoE layer (moe_plugins/hecate/schedule.py) and its config section.

On 4 gloo ranks (2 nodes x 2, EP 4) in fp64: outputs, input gradients, gate and expert weight gradients (at the
owners), aux loss and dropped routes equal the single-process reference (``moe_plugins.tools.verify.compare``)
and the baseline schedule (ragged and padded) to <= 1e-9, dropless and with drops, k in {1, 2}, a skewed gate
(expert 0 hot) and a balanced one; copies are really made and ranks other than the hot expert's owner compute
its tokens; Adam steps give the baseline's losses. In one process: the pure route plan, the flat expert rows,
the config section and its refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_plugins.core.experts import ExpertWeights
from moe_plugins.core.plugin_config import PluginConfig, plugin_config_problems
from moe_plugins.core.schedule import exchange_problems
from moe_plugins.hecate.config import HecateConfig, hecate_problems
from moe_plugins.hecate.flow import expert_numel, flat_experts, route_plan, unflat_experts
from moe_plugins.hecate.plan import Placement, stock_homes
from moe_plugins.hecate.schedule import HecateSchedule
from moe_plugins.hecate.sparse import sparse_bytes, whole_shards
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify import VerifySpec, compare
from tests.workers.hecate_layer import one_call, refused, training
from tests.workers.host_reads import reads_per_step

WORLD = 4
EXACT = 1e-9
NODES = (0, 0, 1, 1)
SPEC = VerifySpec(world=WORLD, ranks_per_node=2, ep=4, experts=8, tokens=24, hidden=8, ffn=12,
                  schedule="hecate", exchange="ragged")
F = expert_numel(SPEC.hidden, SPEC.ffn)


def _err(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


# ---- pure pieces -----------------------------------------------------------------------------------------

def test_route_plan_sends_every_route_once_to_a_copy():
    placement = Placement(copies_E=((0, 1, 2, 3), (0,), (1,), (1, 3), (2,), (2,), (3,), (3,)), nodes_R=NODES)
    counts_RE = [[5, 1, 0, 2, 0, 0, 1, 0], [4, 0, 2, 3, 0, 1, 0, 0], [6, 0, 0, 1, 2, 0, 0, 0], [3, 2, 0, 0, 0, 0, 0, 1]]
    plans = [route_plan(counts_RE, r, placement) for r in range(WORLD)]
    for r, plan in enumerate(plans):
        assert sorted(plan.perm_X) == list(range(sum(counts_RE[r])))            # a permutation of its rows
        assert [plans[s].send[r] for s in range(WORLD)] == list(plan.recv)     # the exchange agrees
        assert plan.experts == placement.experts_on(r)
        assert sum(plan.rows_C) == sum(plan.recv)
    assert [plan.rows_C[plan.experts.index(0)] for plan in plans] == [5, 4, 6, 3]   # expert 0: all local
    # expert 3 (copies on ranks 1 and 3): rank 0 has no copy, so its 2 routes go to rank 1 (same node)
    assert plans[1].recv_RC[0][plans[1].experts.index(3)] == 2
    with pytest.raises(ValueError, match="counts_RE must hold 4 rows"):
        route_plan(counts_RE[:3], 0, placement)


def test_flat_experts_round_trip():
    gen = torch.Generator().manual_seed(0)
    w = ExpertWeights(*(torch.randn(s, generator=gen, dtype=torch.float64) for s in ((2, 3, 5), (2, 5), (2, 5, 3),
                                                                                     (2, 3))))
    flat = flat_experts(w)
    assert flat.numel() == 2 * expert_numel(3, 5)
    back = unflat_experts(flat.view(2, -1), 3, 5)
    for a, b in zip(back.__dict__.values(), w.__dict__.values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"must be \(C, 38\)"):
        unflat_experts(flat.view(1, -1), 3, 5)


# ---- config ----------------------------------------------------------------------------------------------

def _parse(section):
    return PluginConfig.from_dict(section, **default_registry().config_choices())


NO_HOST = "moe_plugins.hecate: Hecate is run by the DeepSpeed and Megatron-core adapters"


def test_config_section_parses():
    for section in ({"hecate": {"enabled": True, "extra_experts": 3, "rematerialize": False, "reshard_every": 0}},
                    {"schedule": "hecate", "exchange": "ragged"}, {"schedule": "baseline", "hecate": {}}):
        problems = plugin_config_problems(section, **default_registry().config_choices())
        assert len(problems) == 1 and problems[0].startswith(NO_HOST), problems     # valid; only the adapters run it
    with pytest.raises(ValueError, match="this reader \\(a tool that checks the section without an adapter"):
        _parse({"hecate": {}})
    cfg = PluginConfig(hecate={"extra_experts": 3})              # the typed field (checks need the registry)
    assert HecateConfig.from_dict(cfg.hecate).budget_m(2) == 3
    assert HecateConfig.from_dict({"extra_experts": "auto"}).budget_m(2) == 2
    assert _parse({"schedule": "parm-s2", "hecate": {"enabled": False}}).hecate == {"enabled": False}
    assert HecateSchedule.from_section({"extra_experts": 1}).options.extra_experts == 1
    assert default_registry().schedule_class(HecateSchedule.from_section(None)).name == "hecate"


@pytest.mark.parametrize("section,message", [
    ({"hecate": {"extra_experts": 0}}, r"moe_plugins\.hecate\.extra_experts \(0\) must be an integer >= 1"),
    ({"hecate": {"extra_experts": "many"}}, r"extra_experts \('many'\) must be an integer >= 1 .* or \"auto\""),
    ({"hecate": {"extra_experts": True}}, r"extra_experts \(True\) must be"),
    ({"hecate": {"reshard_every": -1}}, r"reshard_every \(-1\) must be an integer >= 0"),
    ({"hecate": {"rematerialize": "yes"}}, r"hecate\.rematerialize \('yes'\) must be true or false"),
    ({"hecate": {"enabled": "yes"}}, r"hecate\.enabled \('yes'\) must be true or false"),
    ({"hecate": {"extra_expert": 1}}, r"hecate\.extra_expert is unknown; allowed: enabled, .*did you mean"),
    ({"hecate": [1]}, r"moe_plugins\.hecate \(\[1\]\) must be a JSON object"),
    ({"schedule": "parm-s2", "hecate": {}}, r"moe_plugins\.schedule \('parm-s2'\) cannot run Hecate"),
    ({"schedule": "baseline-tp", "hecate": {"enabled": True}}, r"schedule \('baseline-tp'\) cannot run Hecate"),
    ({"hecate": {"rematerialize": True}, "pipeline_degree": 2},
     r"pipeline_degree \(2\) must be 1 with moe_plugins\.hecate\.rematerialize"),
    ({"schedule": "hecate", "pipeline_degree": "auto", "hecate": {"rematerialize": True}},
     r"pipeline_degree \('auto'\) must be 1 with moe_plugins\.hecate\.rematerialize"),
    ({"hecate": {}, "exchange": "padded"}, r"exchange \('padded'\) cannot be used with Hecate"),
    ({"hecate": {}, "esp": 2}, r"esp \(2\) must be 1 or null with Hecate"),
    ({"schedule": "hecate", "hecate": {"enabled": False}}, r"hecate\.enabled \(False\) contradicts"),
])
def test_config_refusals(section, message):
    with pytest.raises(ValueError, match=message):
        _parse(section)


def test_schedule_refusals():
    assert hecate_problems({"extra_experts": 2, "reshard_every": 0}) == []
    assert exchange_problems(HecateSchedule, "ragged", 3) == []                  # PipeMoE's chunks
    assert exchange_problems(HecateSchedule.from_section({"rematerialize": True}), "ragged", 2) == [
        "schedule 'hecate' with rematerialize runs pipeline_degree 1, not 2: the re-gather is built for one expert "
        "step per call"]
    assert exchange_problems(HecateSchedule, "ragged", "auto") == []       # priced by the agreed rows (row_load)
    assert "not 'tune'" in exchange_problems(HecateSchedule.from_section({"rematerialize": True}), "ragged", "tune")[0]
    assert "runs the ragged exchange only" in exchange_problems(HecateSchedule, "padded")[0]
    layout = replace(SPEC, ep=2, esp=2).layout()
    assert default_registry().schedule_problems("hecate", layout) == [
        "schedule 'hecate' runs at esp 1, not 2: copies of ESP shards are not built"]
    with pytest.raises(ValueError, match="must be a HecateConfig"):
        HecateSchedule.configured({"extra_experts": 1})


# ---- 4 gloo ranks ----------------------------------------------------------------------------------------

CASES = [replace(SPEC, k=k, drop=drop, skew=skew, seed=3 + k, capacity_factor=1.5 if drop else 1.0)
         for k in (1, 2) for drop in (True, False) for skew in (0.0, 12.0)]


@pytest.mark.parametrize("extra", ["auto", 1])
def test_hecate_equals_reference_and_baseline(world, extra):
    results = world(WORLD).run(one_call, CASES, extra)
    hot_elsewhere = drops = spag_bytes = 0
    for i, spec in enumerate(CASES):
        ranks = [r[i] for r in results]
        for name in ("hecate", "ragged", "padded"):
            report = compare(replace(spec, schedule="baseline"), [r[name] for r in ranks])
            assert report["ok"], (spec, name, {k: v for k, v in report.items() if k.startswith("max_err")})
        for r in ranks:
            h, b = r["hecate"], r["ragged"]
            assert torch.equal(h["counts"], b["counts"]) and h["dropped"] == b["dropped"]
            assert torch.equal(h["aux"], b["aux"])
            for key in ("y", "grad_x", "grad_wg"):
                assert _err(h[key], b[key]) <= EXACT, (spec, key)
            for gh, gb in zip(h["grad_experts"], b["grad_experts"]):
                assert _err(gh, gb) <= EXACT, (spec, "grad_experts")
            drops += h["dropped"]
        h0 = ranks[0]["hecate"]
        assert all(r["hecate"]["copies_E"] == h0["copies_E"] for r in ranks)           # every rank plans the same
        assert h0["extra"] > 0, (spec, h0["copies_E"])                                  # copies beyond the homes
        kept_E = [sum(r["hecate"]["rows_E"][e] for r in ranks) for e in range(spec.experts)]
        assert kept_E == list(h0["load_E"])                                            # every kept route computed once
        if spec.skew and not spec.drop:        # expert 0 (owner: rank 0) hot; with drops its capacity caps it
            assert max(range(spec.experts), key=lambda e: h0["load_E"][e]) == 0, h0["load_E"]
            assert len(h0["copies_E"][0]) == WORLD if extra == "auto" else len(h0["copies_E"][0]) >= 2
            hot_elsewhere += sum(r["hecate"]["rows_E"][0] for r in ranks[1:])
        placement, shards = Placement(h0["copies_E"], NODES), whole_shards(F, stock_homes(8, WORLD), WORLD)
        for r in ranks:                       # the ledger's spAG / spRS bytes: those of the plan, exactly
            want = sparse_bytes(placement, shards, r["hecate"]["rank"], 8)
            ledger = r["hecate"]["ledger"]["moe"]
            assert ledger["forward:spag@ep"]["bytes"] == want.sent
            assert ledger["backward:sprs@ep"]["bytes"] == want.received
            spag_bytes += want.sent
    assert hot_elsewhere > 0 and drops > 0 and spag_bytes > 0


@pytest.mark.parametrize("mp,ep", [(1, 2), (2, 2)], ids=["ep2-expert_dp2", "mp2-ep2"])
def test_hecate_on_other_layouts(world, mp, ep):
    """EP 2 with two expert-DP replicas (each EP group plans its own copies; the owners' gradients then sum over
    expert-DP as usual), and MP 2 (the EP members hold MP replicas of the same tokens, as in the baseline)."""
    specs = [replace(SPEC, mp=mp, ep=ep, k=2, drop=drop, skew=skew, seed=5, capacity_factor=1.5 if drop else 1.0)
             for drop, skew in ((True, 0.0), (False, 12.0))]
    results = world(WORLD).run(one_call, specs)
    for i, spec in enumerate(specs):
        ranks = [r[i] for r in results]
        for name in ("hecate", "ragged"):
            report = compare(replace(spec, schedule="baseline"), [r[name] for r in ranks])
            assert report["ok"], (spec, name, {k: v for k, v in report.items() if k.startswith("max_err")})
        assert all(r["hecate"]["extra"] > 0 for r in ranks)
        for r in ranks:
            for key in ("y", "grad_x", "grad_wg"):
                assert _err(r["hecate"][key], r["ragged"][key]) <= EXACT, (spec, key)


def test_hecate_trains_like_the_baseline(world):
    spec = replace(SPEC, k=2, drop=False, skew=2.0, seed=11)
    runs = world(WORLD).run(training, spec, 4)
    for r in runs:
        assert r["hecate"]["extra"] > 0
        assert max(abs(a - b) for a, b in zip(r["hecate"]["losses"], r["ragged"]["losses"])) <= EXACT
        assert len(set(r["hecate"]["losses"])) == 4                                       # the weights did move
        for ph, pb in zip(r["hecate"]["params"], r["ragged"]["params"]):
            assert _err(ph, pb) <= EXACT


def test_one_host_read_per_call(world):
    """The counts' all-gather is read once per call (the plan and split sizes are computed on the host from it);
    nothing else reads a tensor value in a steady-state step (dropless: the gate's agreed capacity is read too)."""
    spec = replace(SPEC, k=2, drop=True, skew=12.0)
    for per_step in world(WORLD).run(reads_per_step, spec, 3, timeout_s=300):
        for step in per_step[1:]:
            (where,) = step
            assert step[where] == 1 and where.startswith("tolist at schedule") and "prepare" in where, step


CHUNKED = [replace(SPEC, k=2, drop=False, skew=12.0, seed=5), replace(SPEC, k=1, drop=True, skew=12.0, seed=4,
                                                                         capacity_factor=1.5),
           replace(SPEC, k=2, drop=True, seed=6, capacity_factor=1.5)]


def check_chunked_call(spec: VerifySpec, ranks) -> int:
    """One chunked Hecate call (``one_call``'s per-rank results for ``spec``) against the reference and the ragged
    baseline at degree 1 (<= 1e-9), one spAG and one spRS, every kept route computed once; returns the chunks
    it ran (the token all-to-alls / 2, the same on every rank)."""
    report = compare(replace(spec, schedule="baseline"), [r["hecate"] for r in ranks])
    assert report["ok"], (spec, {k: v for k, v in report.items() if k.startswith("max_err")})
    for r in ranks:
        h, b = r["hecate"], r["ragged"]
        assert torch.equal(h["counts"], b["counts"]) and h["dropped"] == b["dropped"]
        for key in ("y", "grad_x", "grad_wg"):
            assert _err(h[key], b[key]) <= EXACT, (spec, key)
        assert all(_err(gh, gb) <= EXACT for gh, gb in zip(h["grad_experts"], b["grad_experts"]))
        led = h["ledger"]["moe"]
        assert led["forward:spag@ep"]["count"] == led["backward:sprs@ep"]["count"] == 1
    h0 = ranks[0]["hecate"]
    assert h0["extra"] > 0 and all(r["hecate"]["copies_E"] == h0["copies_E"] for r in ranks)
    assert [sum(r["hecate"]["rows_E"][e] for r in ranks) for e in range(spec.experts)] == list(h0["load_E"])
    exchanges = {r["hecate"]["ledger"]["moe"]["forward:all_to_all@ep"]["count"] for r in ranks}
    assert len(exchanges) == 1 and min(exchanges) % 2 == 0, (spec, exchanges)
    return exchanges.pop() // 2


@pytest.mark.parametrize("degree", [3, 8])
def test_hecate_with_pipemoe_chunks_equals_reference_and_baseline(world, degree):
    """PipeMoE's chunks (degree 3; 8: more chunks than some experts' routes): each piece routed on its own over
    the shared copies, one spAG per call, its exchanges on the pipeline lane; outputs and all gradients equal the
    reference and the ragged baseline at degree 1 (<= 1e-9), every kept route computed once."""
    results = world(WORLD).run(one_call, CHUNKED, "auto", degree)
    for i, spec in enumerate(CHUNKED):
        assert check_chunked_call(spec, [r[i] for r in results]) == degree
    messages = world(WORLD).run(refused, SPEC, 2, True)            # rematerialize: degree 1 only
    assert all(m is not None and "with rematerialize runs pipeline_degree 1, not 2" in m for m in messages)
