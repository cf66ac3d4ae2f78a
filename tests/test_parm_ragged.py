"""Parm's S1 and S2 with the ragged exchange (moe_plugins/parm/ragged.py) on 4 gloo ranks, fp64: outputs,
gradients, aux loss, expert counts and dropped routes equal the padded schedules' and the single-process
reference (tests/test_ragged_exchange.py's checks) on every layout Parm runs, k 1 and 2, with drops, dropless
and skewed; S1, S2, S2 with SAA, parm-auto's and parm-tune's forms under PipeMoE's chunks; fewer bytes on the fused exchange when dropless load is skewed. The pure
pieces against brute force."""

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from moe_plugins.core.schedule import exchange_problems, with_exchange
from moe_plugins.core.ragged import slot_rows, split_sizes
from moe_plugins.parm.ragged import (RaggedParmS1Schedule, RaggedParmS2Schedule, dump_index, dumped_experts, piece_rows,
                                    s2_piece, undumped)
from moe_plugins.parm.saa_ragged import RaggedParmS2SAASchedule
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify import VerifySpec
from tests.test_parm import assert_exact, forcing, matrix
from tests.test_ragged_exchange import WORLD, _bytes, _check_pair, _layouts
from tests.workers.parm import verify_auto_with_costs, verify_many
from tests.workers.ragged import padded_and_ragged


def _fused_bytes(ranks, phase="forward"):
    return sum(r["ledger"]["moe"].get(f"{phase}:all_to_all@ep_esp", {}).get("bytes", 0) for r in ranks)


# the CI share: every layout once with drops (k 1) and once dropless (k 2); the full profile adds the other two
CI_CASES, OTHER_CASES = ((1, True), (2, False)), ((1, False), (2, True))


def _layout_specs(schedule, cases):
    layouts = [lay for lay in _layouts(schedule) if lay[0] > 1]
    assert len(layouts) >= 4, layouts
    return [VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=k, drop=drop, experts=4, tokens=12,
                       seed=5 + k, schedule=schedule) for mp, ep, esp in layouts for k, drop in cases]


@pytest.mark.parametrize("schedule", ["parm-s1", "parm-s2", "parm-s2-saa"])
def test_parm_ragged_equals_padded_on_every_layout(world, schedule):
    specs = _layout_specs(schedule, CI_CASES)
    specs += [VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=2, drop=drop, skew=20.0,
                         schedule=schedule)
              for mp, ep, esp, drop in ((2, 2, 1, True), (2, 1, 2, False), (2, 2, 2, False))]
    pairs = world(WORLD).run(padded_and_ragged, specs)[0]
    for spec, (padded, ragged) in zip(specs, pairs):
        _check_pair(spec, padded, ragged)
        if spec.ep * spec.esp > 1:
            assert "forward:all_to_all@ep_esp" in ragged[0]["ledger"]["moe"], spec
    assert sum(r["dropped"] for spec, (_, ragged) in zip(specs, pairs) if spec.drop for r in ragged) > 0
    # mp 2, ep 2, esp 2, dropless, every first route to expert 0: the padded buffer pads the 4 experts to the
    # hottest (4 S slots), the ragged one sends the 2 S routes (and E_l counts per member)
    spec, (padded, ragged) = specs[-1], pairs[-1]
    assert (spec.mp, spec.ep, spec.esp, spec.drop) == (2, 2, 2, False)
    for phase in ("forward", "backward"):
        assert _fused_bytes(ragged, phase) * 1.5 < _fused_bytes(padded, phase), (phase, _fused_bytes(ragged, phase),
                                                                                  _fused_bytes(padded, phase))
    moe = ragged[0]["ledger"]["moe"]
    if schedule == "parm-s2":          # the uneven MP split and gather of the capacity are on the ledger
        assert moe["forward:all_to_all@mp"]["count"] == moe["backward:all_to_all@mp"]["count"] == 1
    if schedule == "parm-s2-saa":      # SAA records its gather (forward; backward, in the dispatch side's adjoint)
        assert moe["forward:all_gather@mp"]["count"] == moe["backward:all_gather@mp"]["count"] == 1
        assert "forward:all_to_all@mp" not in moe
    assert _bytes(padded[0]["ledger"]) == (0, 0)           # Parm's flows have no EP-only all-to-all


@pytest.mark.full(covered_by="test_parm_ragged_equals_padded_on_every_layout (every layout, k 1 with drops, k 2 "
                  "dropless)")
@pytest.mark.parametrize("schedule", ["parm-s1", "parm-s2", "parm-s2-saa"])
def test_parm_ragged_equals_padded_on_every_layout_other_cases(world, schedule):
    specs = _layout_specs(schedule, OTHER_CASES)
    for spec, (padded, ragged) in zip(specs, world(WORLD).run(padded_and_ragged, specs)[0]):
        _check_pair(spec, padded, ragged)


@pytest.mark.parametrize("schedule", ["parm-s1", "parm-s2", "parm-s2-saa"])
def test_parm_ragged_under_pipemoe_chunks(world, schedule):
    """S1's chunks of every expert's kept slots; S2's (and SAA's) the same chunk [a, b) of every MP rank's slice:
    each chunk one uneven exchange each way (SAA: its overlapped gather per chunk too), equal to padded and the
    reference."""
    cases = ([(k, drop, r) for k in (1, 2) for drop, r in ((True, 3), (False, 2))] if schedule == "parm-s1" else
             [(1, True, 3), (2, False, 2)])        # S2's two forms: one k each way (S1's: both)
    specs = [VerifySpec(world=WORLD, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=k, drop=drop, pipeline_degree=r,
                        tokens=12, seed=3 + k, schedule=schedule)
             for mp, ep, esp in ((2, 2, 1), (2, 1, 2), (4, 4, 1)) for k, drop, r in cases]
    specs.append(VerifySpec(world=WORLD, ranks_per_node=2, mp=2, ep=2, esp=2, k=2, skew=20.0, drop=False,
                            pipeline_degree=3, schedule=schedule))
    pairs = world(WORLD).run(padded_and_ragged, specs)[0]
    for spec, (padded, ragged) in zip(specs, pairs):
        _check_pair(spec, padded, ragged)
        moe = ragged[0]["ledger"]["moe"]
        forward = moe["forward:all_to_all@ep_esp"]["count"]
        assert forward == 1 + 2 * spec.pipeline_degree, (spec, forward)   # the counts once, then 2 per chunk
        if schedule == "parm-s2-saa":
            assert moe["forward:all_gather@mp"]["count"] == spec.pipeline_degree, (spec, moe)
        if schedule == "parm-s2":              # the MP split and gather stay one each, outside the pipeline
            assert moe["forward:all_to_all@mp"]["count"] == 1, (spec, moe)


def test_parm_ragged_variants_and_refusals():
    registry = default_registry()
    s1, s2 = registry.schedule_class("parm-s1"), registry.schedule_class("parm-s2")
    assert with_exchange(s1, "ragged") is RaggedParmS1Schedule and with_exchange(s2, "ragged") is RaggedParmS2Schedule
    assert RaggedParmS2Schedule.name == "parm-s2"
    assert registry.schedule_class(RaggedParmS2Schedule) is RaggedParmS2Schedule      # the registered name's form
    assert exchange_problems(s1, "ragged", 3) == exchange_problems(s2, "ragged", 2) == []
    saa = registry.schedule_class("parm-s2-saa")
    assert with_exchange(saa, "ragged") is RaggedParmS2SAASchedule and RaggedParmS2SAASchedule.saa
    assert registry.schedule_class(RaggedParmS2SAASchedule) is RaggedParmS2SAASchedule   # the registered name's form
    assert exchange_problems(saa, "ragged", 2) == []
    for name in ("parm-auto", "parm-tune"):             # their ragged forms, and back; any degree
        cls = registry.schedule_class(name)
        ragged = with_exchange(cls, "ragged")
        assert ragged.name == name and issubclass(ragged, cls) and ragged.exchange_mode == "ragged"
        assert ragged.model_saa and with_exchange(ragged, "padded") is cls
        assert with_exchange(ragged, "ragged") is ragged
        assert exchange_problems(cls, "ragged", 2) == exchange_problems(cls, "ragged", "tune") == []
    costed = registry.schedule_class("parm-auto").with_costs(forcing("parm-s1"), "test")
    assert with_exchange(costed, "ragged").costs == costed.costs          # a host's measured costs stay


@pytest.mark.parametrize("choice", ["parm-s1", "parm-s2", "baseline-tp"])
def test_parm_auto_ragged_runs_the_ragged_form_of_its_choice(world, choice):
    specs = matrix("parm-auto-test", [(2, 2, 2), (2, 4, 1), (2, 1, 2)], exchange="ragged")
    specs += [replace(specs[0], skew=20.0, drop=False), replace(specs[3], skew=20.0, drop=False)]
    reports = world(WORLD).run(verify_auto_with_costs, "parm-auto-test", forcing(choice), specs)[0]
    assert_exact(specs, reports)
    for spec, report in zip(specs, reports):
        moe = report["ledger"]["moe"]
        group = "ep" if choice == "baseline-tp" else "ep_esp"
        if choice != "baseline-tp" or spec.ep > 1:
            assert moe[f"forward:all_to_all@{group}"]["count"] == 3, (spec, moe)    # the counts, the rows, back
        assert ("backward:all_reduce@mp" in moe) == (choice == "parm-s1"), (spec, moe)   # S1's split gate
        assert ("forward:all_to_all@mp" in moe) == (choice == "baseline-tp"), (spec, moe)   # its uneven MP split
        assert ("forward:all_gather@mp" in moe) == (choice != "baseline-tp"), (spec, moe)   # S1's tokens, SAA's rows


@pytest.mark.parametrize("choice", ["parm-s1", "parm-s2", "baseline-tp"])
def test_parm_auto_ragged_under_pipemoe_chunks(world, choice):
    """Each choice's ragged form cut into chunks on PipeMoE's lane (its twin shares the candidates' calls and
    which one runs): equal to the reference; the counts once, then two exchanges per chunk."""
    specs = [replace(spec, pipeline_degree=2) for spec in matrix("parm-auto-test", [(2, 2, 2), (2, 4, 1)],
                                                                exchange="ragged") if spec.k == 2]
    specs.append(replace(specs[1], skew=20.0, pipeline_degree=3))
    reports = world(WORLD).run(verify_auto_with_costs, "parm-auto-test", forcing(choice), specs)[0]
    assert_exact(specs, reports)
    group = "ep" if choice == "baseline-tp" else "ep_esp"
    for spec, report in zip(specs, reports):
        forward = report["ledger"]["moe"][f"forward:all_to_all@{group}"]["count"]
        assert forward == 1 + 2 * spec.pipeline_degree, (spec, forward)


def test_parm_tune_ragged_matches_the_reference(world):
    specs = matrix("parm-tune", [(2, 2, 2), (2, 4, 1)], exchange="ragged")
    specs += [replace(spec, pipeline_degree=2) for spec in specs if spec.k == 2 and not spec.drop]
    assert_exact(specs, world(WORLD).run(verify_many, specs)[0])


# ---- pure pieces -----------------------------------------------------------------------------------------

def test_dumped_layout_by_hand():
    # 4 experts, ep 2 x esp 2: members 0, 1 serve experts 0-1, members 2, 3 experts 2-3
    assert dumped_experts(4, 4, 2) == [0, 1, 0, 1, 2, 3, 2, 3]
    assert dump_index([2, 1], 2) == [0, 1, 0, 1, 2, 2]
    assert undumped([[3], [0], [3], [0], [5], [1], [5], [1]], 4, 4, 2) == [3, 0, 5, 1]
    assert slot_rows([3, 0, 5, 1], 1, 3) == [1, 2, 4, 5]
    assert split_sizes([3, 0, 5, 1], 2) == [3, 6]
    with pytest.raises(ValueError, match="do not split evenly"):
        dumped_experts(3, 4, 2)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.data())
def test_dump_and_slices_against_brute_force(ep, esp, per, data):
    experts, members = ep * per, ep * esp
    kept_E = data.draw(st.lists(st.integers(0, 5), min_size=experts, max_size=experts))
    rows = [(e, s) for e in range(experts) for s in range(kept_E[e])]            # the (expert, slot) order
    cells = [[kept_E[e]] for e in dumped_experts(experts, members, esp)]
    assert undumped(cells, experts, members, esp) == kept_E
    dumped = [rows[i] for i in dump_index(split_sizes(kept_E, ep), esp)]
    assert dumped == [(e, s) for e in dumped_experts(experts, members, esp) for s in range(kept_E[e])]
    a = data.draw(st.integers(0, 5))
    b = data.draw(st.integers(a, 6))
    assert [rows[i] for i in slot_rows(kept_E, a, b)] == [(e, s) for e, s in rows if a <= s < b]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.data())
def test_piece_rows_against_brute_force(slices, width, data):
    """A chunk [a, b) of every slice, located in the slices' buffer (each slice m: slots [m w, (m+1) w) of every
    cell, cell by cell): the positions of exactly the (slice, cell, slot) entries whose slot in the slice is in
    [a, b), in buffer order."""
    cells = data.draw(st.lists(st.integers(0, slices * width + 1), min_size=1, max_size=5))
    firsts = [m * width for m in range(slices)]
    buffer = [(m, i, s) for m, first in enumerate(firsts) for i, n in enumerate(cells)
              for s in range(first, min(n, first + width))]
    a = data.draw(st.integers(0, width))
    b = data.draw(st.integers(a, width))
    expected = [pos for pos, (m, _, s) in enumerate(buffer) if a <= s - firsts[m] < b]
    assert piece_rows(cells, firsts, width, a, b) == expected


def test_s2_pieces_partition_the_slices():
    """ep 2 x esp 2, mp 2: the chunks of a slice send, between them, exactly the whole slice's rows per member,
    and every MP rank's rows per EP block add up to the whole call's."""
    kept_E = [3, 0, 5, 1]
    mine = [[kept_E[e]] for e in dumped_experts(4, 4, 2)]
    recv_PLN = [[[kept_E[l + 2 * (g // 2)]] for l in range(2)] for g in range(4)]      # every member the same tokens
    width, firsts, sources = 3, [0, 3], [0, 1, 0, 1]
    whole = s2_piece((mine, recv_PLN), kept_E, 4, 2, firsts, sources, 1, 0, width)
    assert whole.blocks_PB == ((3, 4), (0, 2)) and whole.dump == (0, 1, 0, 1)     # block 1's 2 rows, twice
    pieces = [s2_piece((mine, recv_PLN), kept_E, 4, 2, firsts, sources, 1, a, b) for a, b in ((0, 2), (2, 3))]
    assert [sum(col) for col in zip(*(p.plan.send for p in pieces))] == list(whole.plan.send)
    assert [sum(col) for col in zip(*(p.plan.recv for p in pieces))] == list(whole.plan.recv)
    for m in range(2):
        assert [sum(col) for col in zip(*(p.blocks_PB[m] for p in pieces))] == list(whole.blocks_PB[m])
