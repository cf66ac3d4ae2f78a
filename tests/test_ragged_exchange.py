"""The ragged exchange on 4 gloo ranks: outputs, gradients, aux loss and dropped routes equal the padded
exchange's (fp64: aux loss, counts and dropped routes bitwise; outputs and gradients <= 1e-12, since the expert
GEMMs run on other row counts, which may change their blocking, and the weight gradients sum without the padded
zero rows) and the single-process fp64 reference, dropless and with drops, k in {1, 2}, skewed routing included;
the ledger records the true bytes."""

from dataclasses import replace
from typing import List

import pytest
import torch

from moe_plugins.core.layout import ParallelLayout, layout_problems
from moe_plugins.core.reference import reference_moe
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify import VerifySpec, compare, make_problem
from tests.workers.host_reads import reads_per_step
from tests.workers.ragged import padded_and_ragged, sequential_chunks

WORLD = 4
EXACT = 1e-12


def _layouts(schedule="baseline"):
    out = []
    for mp in (1, 2, 4):
        for ep, esp in ((1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)):
            if not layout_problems(WORLD, 2, mp, ep, esp) and not default_registry().schedule_problems(
                    schedule, ParallelLayout(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp)):
                out.append((mp, ep, esp))
    return out


def _err(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _check_pair(spec, padded, ragged):
    """Ragged vs padded, rank by rank, and both vs the reference. Returns whether y and the input gradient were
    bitwise equal (they are where the expert GEMMs block the same way: most cases here)."""
    bitwise = True
    for p, r in zip(padded, ragged):
        where = (spec, r["rank"])
        assert torch.equal(p["counts"], r["counts"]) and p["dropped"] == r["dropped"], where
        assert torch.equal(p["aux"], r["aux"]), where
        for key in ("y", "grad_x", "grad_wg"):
            assert _err(p[key], r[key]) <= EXACT, (where, key, _err(p[key], r[key]))
        for gp, gr in zip(p["grad_experts"], r["grad_experts"]):
            assert _err(gp, gr) <= EXACT, (where, "grad_experts", _err(gp, gr))
        bitwise &= torch.equal(p["y"], r["y"]) and torch.equal(p["grad_x"], r["grad_x"])
    for which, ranks in (("padded", padded), ("ragged", ragged)):
        report = compare(replace(spec, exchange=which), ranks)
        assert report["ok"], (which, spec, {k: report[k] for k in ("max_err_out", "max_err_grad_in",
                                                                      "max_err_grad_w", "routing_equal")})
    return bitwise


def _bytes(ledger, phase="forward"):
    row = ledger.get("moe", {}).get(f"{phase}:all_to_all@ep")
    return (row["bytes"], row["inter_node_bytes"]) if row else (0, 0)


@pytest.mark.parametrize("drop", [True, False], ids=["drop", "dropless"])
def test_ragged_equals_padded_on_every_layout(world, drop):
    specs = [VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=k, drop=drop, experts=4, tokens=12,
                        seed=7 + k) for mp, ep, esp in _layouts() for k in (1, 2)]
    assert len(specs) >= 18
    pairs = world(WORLD).run(padded_and_ragged, specs)[0]
    bitwise = [_check_pair(s, p, r) for s, (p, r) in zip(specs, pairs)]
    assert any(bitwise)
    if drop:
        assert sum(r["dropped"] for _, ragged in pairs for r in ragged) > 0


TP_CASES, TP_OTHER_CASES = ((1, True), (2, False)), ((1, False), (2, True))      # (k, drop)


def _baseline_tp_specs(cases) -> List[VerifySpec]:
    return [VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=k, drop=drop, tokens=12, seed=7 + k,
                       schedule="baseline-tp") for mp, ep, esp in _layouts("baseline-tp") for k, drop in cases]


def test_baseline_tp_ragged_equals_padded(world):
    """baseline-tp (DeepSpeed's flow): each MP rank sends the kept routes of its capacity slice; the ESP
    all-gather / split and the final MP all-gather are uneven too. Every valid layout with k 1 and drops and with
    k 2 dropless (the other two cases: the full profile's test below), and skewed with and without drops."""
    specs = _baseline_tp_specs(TP_CASES)
    specs += [VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=2, drop=drop, skew=20.0,
                         schedule="baseline-tp") for mp, ep, esp in ((2, 2, 2), (2, 2, 1), (2, 1, 2)) for drop in
              (True, False)]
    assert len(specs) >= 18
    pairs = world(WORLD).run(padded_and_ragged, specs)[0]
    for spec, (padded, ragged) in zip(specs, pairs):
        _check_pair(spec, padded, ragged)
    # mp 2, ep 2, esp 2, dropless skewed: the uneven MP and ESP gathers are on the ledger, and fewer bytes travel
    padded, ragged = pairs[-5]
    assert specs[-5].esp == 2 and not specs[-5].drop
    assert {"forward:all_to_all@esp", "forward:all_to_all@mp"} <= set(ragged[0]["ledger"]["moe"])
    assert sum(_bytes(r["ledger"])[0] for r in ragged) < sum(_bytes(r["ledger"])[0] for r in padded)


@pytest.mark.full(covered_by="test_baseline_tp_ragged_equals_padded (every layout, k 1 with drops, k 2 dropless)")
def test_baseline_tp_ragged_equals_padded_other_cases(world):
    specs = _baseline_tp_specs(TP_OTHER_CASES)
    for spec, (padded, ragged) in zip(specs, world(WORLD).run(padded_and_ragged, specs)[0]):
        _check_pair(spec, padded, ragged)


def test_skewed_routing(world):
    """All tokens to expert 0 (the ranks of the other experts receive no row), with drops and dropless, and one
    token per rank."""
    specs = [VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=k, skew=20.0, drop=drop)
             for mp, ep, esp in ((1, 4, 1), (2, 2, 2), (1, 2, 2)) for k in (1, 2) for drop in (True, False)]
    specs += [VerifySpec(world=WORLD, ranks_per_node=2, mp=1, ep=4, esp=1, k=k, tokens=1, drop=drop)
              for k in (1, 2) for drop in (True, False)]
    pairs = world(WORLD).run(padded_and_ragged, specs)[0]
    for spec, (padded, ragged) in zip(specs, pairs):
        _check_pair(spec, padded, ragged)
    # dropless and skewed: the padded buffer pads every expert to the hottest, the ragged one sends the rows
    spec = specs[1]
    assert spec.ep == 4 and not spec.drop and spec.k == 1
    padded_bytes = sum(_bytes(r["ledger"])[0] for r in pairs[1][0])
    ragged_bytes = sum(_bytes(r["ledger"])[0] for r in pairs[1][1])
    assert ragged_bytes * 3 < padded_bytes, (ragged_bytes, padded_bytes)


def test_ledger_records_the_true_bytes(world):
    """Rank 0 (mp 1, ep 4, 2 ranks per node: experts 2 and 3 and ranks 2 and 3 on the other node) sends, forward,
    E counts, its kept routes' rows, and back the rows it received for its expert 0; backward, the same rows the
    other way. Inter-node: the rows for experts 2 and 3, the rows ranks 2 and 3 sent it, and its two remote
    peers' share of the counts."""
    spec = VerifySpec(world=WORLD, ranks_per_node=2, mp=1, ep=4, esp=1, k=2, drop=False, skew=3.0, tokens=16)
    (padded, ragged), = world(WORLD).run(padded_and_ragged, [spec])[0]
    prob = make_problem(spec)
    kept_DE = []
    for d in range(WORLD):
        _, routing = reference_moe(prob.x_DSM[d], prob.wg_EM, prob.full, spec.moe_config())
        kept_DE.append(torch.bincount(routing.expert_SK[routing.slot_SK >= 0], minlength=4).tolist())
    row, counts = spec.hidden * 8, spec.experts * 8
    rows = sum(kept_DE[0]) + sum(kept[0] for kept in kept_DE)
    remote = kept_DE[0][2] + kept_DE[0][3] + kept_DE[2][0] + kept_DE[3][0]
    assert 0 < remote < rows
    assert _bytes(ragged[0]["ledger"]) == (rows * row + counts, remote * row + counts // 2)
    assert _bytes(ragged[0]["ledger"], "backward") == (rows * row, remote * row)
    assert _bytes(padded[0]["ledger"])[0] > rows * row + counts
    _check_pair(spec, padded, ragged)


@pytest.mark.parametrize("schedule,mp,ep,esp", [("baseline", 1, 4, 1), ("baseline", 1, 2, 2),
                                                 ("baseline-tp", 2, 2, 2)])
def test_one_host_read_per_call_the_split_sizes(world, schedule, mp, ep, esp):
    """The ragged exchange's one host read (docs/architecture.md, "Host reads"): the counts, sent and received,
    read together to size the uneven all-to-all; nothing else in a steady-state step with capacity dropping."""
    spec = VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=2, tokens=16, exchange="ragged",
                      schedule=schedule)
    for per_step in world(WORLD).run(reads_per_step, spec, 4, timeout_s=300):
        for step in per_step[1:]:
            (where,) = step
            assert step[where] == 1 and where.startswith("tolist at baseline") and "prepare" in where, step


def test_pipemoe_chunks(world):
    """PipeMoE's pipelined executor at degree 2 and 3 (capacity chunks [a, b) of every expert's kept slots, each
    its own counts-free uneven exchange on the engine's pipeline lane), more chunks than slots included."""
    specs = [VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=k, drop=drop, pipeline_degree=r,
                        tokens=12, seed=3 + k) for mp, ep, esp in ((1, 4, 1), (2, 2, 2), (1, 2, 2)) for k in (1, 2)
             for drop, r in ((True, 3), (False, 2))]
    specs += [VerifySpec(world=WORLD, ranks_per_node=2, mp=1, ep=4, esp=1, k=1, tokens=2, pipeline_degree=8),
              VerifySpec(world=WORLD, ranks_per_node=2, mp=1, ep=4, esp=1, k=2, skew=20.0, drop=False,
                         pipeline_degree=3)]
    pairs = world(WORLD).run(padded_and_ragged, specs)[0]
    for spec, (padded, ragged) in zip(specs, pairs):
        _check_pair(spec, padded, ragged)
        forward = ragged[0]["ledger"]["moe"]["forward:all_to_all@ep"]["count"]
        assert forward == 1 + 2 * spec.pipeline_degree, (spec, forward)   # the counts once, then 2 per chunk


def test_baseline_tp_chunks(world):
    """baseline-tp's ragged form at degree 2 and 3: every MP rank's capacity slice cut into the same chunks
    [a, b) of its slots, each one uneven EP exchange each way (its ESP gather and split too); equal to the padded
    exchange and the reference; more chunks than a slice's slots included."""
    specs = [VerifySpec(world=WORLD, ranks_per_node=2, mp=2, ep=ep, esp=esp, k=k, drop=drop, pipeline_degree=r,
                        tokens=12, seed=5 + k, schedule="baseline-tp")
             for ep, esp in ((2, 2), (2, 1), (1, 2)) for k, drop, r in ((1, True, 3), (2, False, 2))]
    specs += [VerifySpec(world=WORLD, ranks_per_node=2, mp=2, ep=2, esp=2, k=2, drop=False, skew=20.0, tokens=4,
                         pipeline_degree=8, schedule="baseline-tp")]
    pairs = world(WORLD).run(padded_and_ragged, specs)[0]
    for spec, (padded, ragged) in zip(specs, pairs):
        _check_pair(spec, padded, ragged)
        if spec.ep > 1:
            forward = ragged[0]["ledger"]["moe"]["forward:all_to_all@ep"]["count"]
            assert forward == 1 + 2 * spec.pipeline_degree, (spec, forward)   # the counts once, then 2 per chunk


def test_sequential_chunks(world):
    spec = VerifySpec(world=WORLD, ranks_per_node=2, mp=1, ep=2, esp=2, k=2, drop=False, skew=3.0)
    for res in world(WORLD).run(sequential_chunks, spec, 3):
        for padded, ragged in zip(res["padded"], res["ragged"]):
            assert _err(padded, ragged) <= EXACT
