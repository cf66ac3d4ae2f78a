"""Lancet's planner (moe_plugins/lancet/plan.py) and ``moe-plugins plan lancet``, pure: the executor model by hand,
the DP against a brute force over every segmentation and every k, barriers and ``allowed``, the GPT-2-MoE op
list against hand-computed sizes, and the CLI (JSON, text, errors, profiles) in this process."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_plugins.core.costmodel import CostProfile, LinearModel, ProfileKey
from moe_plugins.lancet import plan_cli
from moe_plugins.lancet.plan import (NOT_ALLOWED, GPT2MoESizes, LancetCosts, Op, backward_ops, capacity,
                                     gpt2_moe_ops, plan_segments, segment_time, segment_timeline)
from moe_plugins.plugins import default_registry
from moe_plugins.tools.cli import main


def compute(name, beta, alpha=0.0, barrier=False):
    return Op(name=name, kind="compute", alpha=alpha, beta=beta, barrier=barrier)


def comm(name, beta, alpha=0.0):
    return Op(name=name, kind="comm", alpha=alpha, beta=beta)


def lane_and_thread(events):
    return ([(e.op, e.part, e.start, e.end) for e in events if e.where == "lane"],
            [(e.op, e.part, e.start, e.end) for e in events if e.where == "thread"])


# ---- the executor model by hand ------------------------------------------------------------------------------

def test_k1_is_the_serial_sum():
    ops = [compute("a", 3, alpha=0.5), comm("d", 2, alpha=0.25), comm("c", 1), compute("x", 4, alpha=1)]
    assert segment_time(ops, 1) == pytest.approx(3.5 + 2.25 + 1 + 5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(0, 2), st.floats(0, 10)), min_size=1, max_size=8))
def test_k1_is_the_serial_sum_for_any_ops(rows):
    ops = [Op(name=f"o{i}", kind="compute" if c else "comm", alpha=a, beta=b) for i, (c, a, b) in enumerate(rows)]
    assert segment_time(ops, 1) == pytest.approx(sum(a + b for _, a, b in rows), rel=1e-12, abs=1e-12)


def test_the_docstring_timeline():
    ops = [compute("X", 4), comm("D", 4), compute("Y", 4)]
    lane, thread = lane_and_thread(segment_timeline(ops, 2))
    assert thread == [("X", 1, 0, 2), ("X", 2, 2, 4), ("Y", 1, 6, 8), ("Y", 2, 8, 10)]
    assert lane == [("D", 1, 4, 6), ("D", 2, 6, 8)]      # D1 waits for the thread to walk past X2 (stage-major)
    assert segment_time(ops, 2) == 10 and segment_time(ops, 1) == 12


def test_a_comm_op_is_fully_hidden_behind_another_partitions_compute():
    ops = [compute("X", 4), comm("D", 2), compute("Y", 4)]
    lane, thread = lane_and_thread(segment_timeline(ops, 2))
    assert lane == [("D", 1, 4, 5), ("D", 2, 5, 6)]
    assert thread[2] == ("Y", 1, 5, 7)                   # D2 (5..6) runs entirely under Y1 (5..7)
    assert segment_time(ops, 2) == 9 == segment_time(ops, 1) - 1


def test_the_lane_is_fifo_in_issue_order():
    # C1 could start at 2 (D1 is done) but D2 was issued first: C1 waits until 4, and Y1 with it
    ops = [comm("D", 4), comm("C", 2), compute("Y", 4)]
    lane, thread = lane_and_thread(segment_timeline(ops, 2))
    assert lane == [("D", 1, 0, 2), ("D", 2, 2, 4), ("C", 1, 4, 5), ("C", 2, 5, 6)]
    assert thread == [("Y", 1, 5, 7), ("Y", 2, 7, 9)]
    assert segment_time(ops, 2) == 9


def test_every_partition_pays_the_start_up():
    assert segment_time([compute("X", 4, alpha=1)], 4) == 8
    assert segment_time([comm("D", 6, alpha=0.5)], 3) == pytest.approx(7.5)


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_segment_time_refuses_a_bad_k(k):
    with pytest.raises(ValueError, match=rf"k \({k!r}\) must be an integer >= 1"):
        segment_time([compute("X", 1)], k)


def test_op_refuses_bad_fields_all_at_once():
    with pytest.raises(ValueError, match=r"invalid Op 'g': kind \('gemm'\) must be one of compute, comm; "
                                         r"beta \(-1\) must be a finite number >= 0"):
        Op(name="g", kind="gemm", alpha=0, beta=-1)


def test_backward_ops_mirror_and_scale_compute_only():
    ops = [compute("a", 2, alpha=1), comm("d", 3, alpha=1), compute("e", 4, barrier=True)]
    back = backward_ops(ops, 2.5)
    assert [(o.name, o.alpha, o.beta, o.barrier) for o in back] == [("e", 0, 10, True), ("d", 1, 3, False),
                                                                     ("a", 1, 5, False)]


# ---- the DP --------------------------------------------------------------------------------------------------

def brute_force(ops, max_partitions, allowed, objective, factor):
    """Every segmentation x every k per segment; the mirrored backward written out here again."""
    n, best = len(ops), math.inf
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        segs = list(zip(bounds, bounds[1:]))
        for ks in itertools.product(range(1, max_partitions + 1), repeat=len(segs)):
            if not all(allowed(k) for k in ks) or any(
                    k >= 2 and any(op.barrier for op in ops[i:j]) for (i, j), k in zip(segs, ks)):
                continue
            total = 0.0
            for (i, j), k in zip(segs, ks):
                total += segment_time(ops[i:j], k)
                if objective == "training":
                    mirrored = [Op(name=o.name, kind=o.kind, alpha=o.alpha,
                                   beta=o.beta * (factor if o.kind == "compute" else 1)) for o in ops[i:j][::-1]]
                    total += segment_time(mirrored, k)
            best = min(best, total)
    return best


OPS = st.lists(st.tuples(st.booleans(), st.integers(0, 4), st.integers(0, 40), st.integers(0, 5)),
               min_size=1, max_size=6).map(lambda rows: [
    Op(name=f"o{i}", kind="compute" if c else "comm", alpha=a / 8, beta=float(b), barrier=c and bar == 0)
    for i, (c, a, b, bar) in enumerate(rows)])


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(1, 3), st.sets(st.integers(2, 3)), st.sampled_from(["training", "forward"]),
       st.sampled_from([1.0, 2.0, 3.5]))
def test_the_dp_matches_a_brute_force(ops, max_partitions, banned, objective, factor):
    allowed = lambda k: k not in banned      # noqa: E731
    plan = plan_segments(ops, max_partitions, allowed, objective=objective, backward_factor=factor)
    assert plan.time_s == pytest.approx(brute_force(ops, max_partitions, allowed, objective, factor), rel=1e-6,
                                        abs=1e-9)
    assert [s.start for s in plan.segments] == [0] + [s.end for s in plan.segments[:-1]]
    assert plan.segments[-1].end == len(ops)
    for seg in plan.segments:
        assert allowed(seg.k) and 1 <= seg.k <= max_partitions
        assert seg.k == 1 or not any(op.barrier for op in ops[seg.start:seg.end])
        assert seg.forward_s == pytest.approx(segment_time(ops[seg.start:seg.end], seg.k))
        assert [c.k for c in seg.candidates] == list(range(1, max_partitions + 1))
        chosen = seg.candidates[seg.k - 1]
        assert chosen.time_s == pytest.approx(seg.time_s) and chosen.excluded == ""
    assert plan.time_s == pytest.approx(sum(s.time_s for s in plan.segments))
    assert plan.serial_s == pytest.approx(brute_force(ops, 1, allowed, objective, factor))


def test_a_barrier_is_never_partitioned_even_where_it_would_pay():
    # a comm-heavy op list where the gate sits between dispatch-sized exchanges and the expert-sized compute
    ops = [comm("d0", 8), compute("gate", 8, barrier=True), comm("d1", 8), compute("x", 8)]
    plan = plan_segments(ops, 4, objective="forward")
    segs = [(s.start, s.end, s.k) for s in plan.segments]
    gate_seg = next(s for s in plan.segments if s.start <= 1 < s.end)
    assert gate_seg.k == 1 and all(c.time_s is None and c.excluded == "holds the barrier op gate"
                                   for c in gate_seg.candidates[1:])
    assert segs[-1] == (2, 4, 4)
    # without the flag the whole list would be one pipelined segment, faster: the constraint is what stops it
    free = [compute("gate", 8) if op.name == "gate" else op for op in ops]
    free_plan = plan_segments(free, 4, objective="forward")
    assert [(s.start, s.end, s.k) for s in free_plan.segments] == [(0, 4, 4)]
    assert free_plan.time_s < plan.time_s


def test_allowed_is_respected_and_reported():
    ops = [compute("x", 12), comm("d", 12, alpha=0.01), compute("y", 12)]
    best = plan_segments(ops, 4, objective="forward")
    assert [s.k for s in best.segments] == [4]
    plan = plan_segments(ops, 4, lambda k: k in (1, 3), objective="forward")
    assert [s.k for s in plan.segments] == [3] and plan.ks == (1, 3)
    cands = plan.segments[0].candidates
    assert [c.excluded for c in cands] == ["", NOT_ALLOWED, "", NOT_ALLOWED]
    assert cands[3].time_s == pytest.approx(best.time_s) and best.time_s < plan.time_s    # timed all the same


def test_plan_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"allowed\(1\) is False"):
        plan_segments([compute("x", 1)], 2, lambda k: k == 2)
    with pytest.raises(ValueError, match=r"max_partitions \(0\) must be an integer >= 1"):
        plan_segments([compute("x", 1)], 0)
    with pytest.raises(ValueError, match=r"ops must hold at least one Op; objective \('both'\) must be one of "
                                         r"training, forward; backward_factor \(0\) must be a finite number > 0"):
        plan_segments([], 2, objective="both", backward_factor=0)


def test_training_adds_the_mirrored_backward_with_the_same_k():
    ops = [compute("x", 4), comm("d", 4), compute("y", 4)]
    plan = plan_segments(ops, 2, objective="training", backward_factor=2.0)
    seg = plan.segments[0]
    assert (seg.start, seg.end, seg.k) == (0, 3, 2)
    # backward: y' 8, d 4, x' 8 at k = 2: y'1 0..4, y'2 4..8, d1 8..10, d2 10..12, x'1 10..14, x'2 14..18
    assert seg.forward_s == 10 and seg.backward_s == 18 and plan.time_s == 28
    assert plan.serial_s == 12 + 20


# ---- the GPT-2-MoE ops ---------------------------------------------------------------------------------------

SIZES = GPT2MoESizes(B=2, L=6, M=8, H=16, heads=2, E=4, k=2, f=1.25, P=2, layers=2, moe_every=2, element_bytes=2)
COSTS = LancetCosts(alpha_a=0.5, beta_a=0.25, alpha_c=0.125, beta_c=0.001)


def test_gpt2_moe_ops_against_hand_computed_sizes():
    assert capacity(B=2, L=6, E=4, k=2, f=1.25) == 8            # ceil(2 * 1.25 * 12 / 4) = ceil(7.5)
    ops = gpt2_moe_ops(SIZES, COSTS)
    got = [(o.name, o.kind, o.alpha, o.beta, o.barrier) for o in ops]
    attention = 4 * 2 * 6 * 64 + 2 * 2 * 36 * 8                 # 3072 + 1152 = 4224 macs
    nbytes = 4 * 8 * 8 * 2                                      # E C M element_bytes = 512
    assert got == [
        ("block0.attention", "compute", 6 * 0.125, attention * 0.001, False),
        ("block0.ffn", "compute", 2 * 0.125, 3072 * 0.001, False),            # 2 B L M H
        ("block1.attention", "compute", 6 * 0.125, attention * 0.001, False),
        ("block1.gate", "compute", 0.125, 384 * 0.001, True),                 # B L M E
        ("block1.dispatch", "comm", 0.5, nbytes * 0.25, False),
        ("block1.experts", "compute", 2 * 0.125, 8192 * 0.001, False),        # 2 E C M H
        ("block1.combine", "comm", 0.5, nbytes * 0.25, False),
    ]


def test_every_block_is_moe_with_moe_every_1():
    ops = gpt2_moe_ops(GPT2MoESizes(B=1, L=4, M=4, H=8, heads=1, E=2, layers=3, moe_every=1), COSTS)
    assert sum(o.barrier for o in ops) == 3 and len(ops) == 15 and not any(o.name.endswith("ffn") for o in ops)


def test_sizes_and_costs_refuse_bad_values():
    with pytest.raises(ValueError, match=r"B \(0\) must be an integer >= 1; f \(0\) must be a finite number > 0"):
        GPT2MoESizes(B=0, L=6, M=8, H=16, heads=2, E=4, f=0)
    with pytest.raises(ValueError, match=r"M \(8\) must be divisible by heads \(3\); E \(4\) must be divisible "
                                         r"by P \(3\); k \(5\) must not exceed E \(4\)"):
        GPT2MoESizes(B=1, L=6, M=8, H=16, heads=3, E=4, P=3, k=5)
    with pytest.raises(ValueError, match=r"beta_c \(-1\) must be a finite number >= 0"):
        LancetCosts(alpha_a=0, beta_a=0, alpha_c=0, beta_c=-1)


# ---- the CLI -------------------------------------------------------------------------------------------------

def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


LAYER = ["--B", "8", "--L", "1024", "--M", "1024", "--H", "4096", "--heads", "16", "--E", "16", "--k", "2",
         "--P", "8", "--layers", "4"]
MANUAL = ["--alpha-a", "1.72e-5", "--beta-a", "2.96e-10", "--alpha-c", "6.19e-5", "--beta-c", "4.1e-14"]


def test_plan_lancet_is_a_registered_planner():
    assert "lancet" in default_registry().planners()


def test_plan_lancet_json():
    code, out, err = run_cli("plan", "lancet", *LAYER, *MANUAL, "--batch", "6", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["planner"] == "lancet" and plan["costs_source"] == "flags" and plan["allowed_k"] == [1, 2, 3, 6]
    assert plan["layer"]["capacity"] == 1024 and plan["layer"]["exchange_bytes"] == 16 * 1024 * 1024 * 4
    assert [s["start"] for s in plan["segments"]] == [0] + [s["end"] for s in plan["segments"][:-1]]
    assert plan["segments"][-1]["end"] == len(plan["ops"]) == 2 * 2 + 2 * 5
    for seg in plan["segments"]:
        assert 6 % seg["k"] == 0 and (seg["k"] == 1 or not any(n.endswith(".gate") for n in seg["ops"]))
        assert [c["k"] for c in seg["candidates"]] == list(range(1, 9))
        allowed = [c for c in seg["candidates"] if c["time_s"] is not None and not c["excluded"]]
        assert seg["time_s"] == pytest.approx(min(c["time_s"] for c in allowed))
    assert any(s["k"] > 1 for s in plan["segments"]) and plan["time_s"] < plan["serial_s"]
    assert plan["time_s"] == pytest.approx(sum(s["time_s"] for s in plan["segments"]))
    # no pipelining: every op once forward and once backward (compute work x 2), from the printed ops
    serial = sum(2 * o["alpha"] + o["beta"] * (3 if o["kind"] == "compute" else 2) for o in plan["ops"])
    assert plan["serial_s"] == pytest.approx(serial)


def test_plan_lancet_text_explains_every_segment(tmp_path):
    code, out, err = run_cli("plan", "lancet", *LAYER, "--cache-dir", str(tmp_path), "--objective", "forward")
    assert code == 0, err
    assert out.startswith("Lancet plan (forward): ") and "without pipelining" in out
    assert "default: PipeMoE paper's 16-GPU testbed" in out and "(no cached profile with ep=8" in out
    assert out.count("<- chosen") == out.count("  segment ") >= 3
    assert "k = 2..8: excluded, the segment holds the barrier op block1.gate" in out
    assert "3 does not divide --batch 8" in out


KEY = ProfileKey(world=8, ranks_per_node=8, mp=1, ep=8, esp=1, backend="nccl", device="cpu")
PROFILE = CostProfile(key=KEY, dtype="float32", models={
    "gemm": LinearModel(alpha=2e-5, beta=3e-14, unit="mac"),
    "all_to_all@ep": LinearModel(alpha=4e-5, beta=5e-10, unit="byte")})


def test_plan_lancet_reads_a_profile_file_and_the_cache(tmp_path, monkeypatch):
    path = PROFILE.save(tmp_path / "p.json")
    code, out, err = run_cli("plan", "lancet", *LAYER, "--profile", str(path), "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["costs_source"] == f"profile {path}"
    assert plan["costs"] == {"alpha_a": 4e-5, "beta_a": 5e-10, "alpha_c": 2e-5, "beta_c": 3e-14}
    monkeypatch.setattr(plan_cli, "this_device", lambda: "cpu")
    cached = PROFILE.save(tmp_path / "cache" / "profile-x.json")
    code, out, err = run_cli("plan", "lancet", *LAYER, "--cache-dir", str(tmp_path / "cache"), "--json")
    assert code == 0, err
    assert json.loads(out)["costs_source"] == f"cached profile {cached}"
    code, out, err = run_cli("plan", "lancet", *LAYER[:-4], "--P", "4", "--layers", "4", "--cache-dir",
                             str(tmp_path / "cache"), "--json")      # ep 4: the cached ep=8 profile does not fit
    assert code == 0, err
    assert json.loads(out)["costs_source"].startswith("default: PipeMoE paper's")


@pytest.mark.parametrize("args, message", [
    (["--max-partitions", "0"], "invalid Lancet plan: --max-partitions (0) must be an integer >= 1"),
    (["--E", "12", "--heads", "7"],
     "--M (1024) must be divisible by --heads (7); --E (12) must be divisible by --P (8)"),
    (["--batch", "0", "--moe-every", "0"], "--moe-every (0) must be an integer >= 1; --batch (0) must be an integer"),
    (["--backward-factor", "inf"], "--backward-factor (inf) must be a finite number > 0"),
    (["--alpha-a", "1e-3"], "the manual costs need all four flags; missing: --beta-a, --alpha-c, --beta-c"),
    (MANUAL[:-1] + ["-1"], "invalid Lancet costs: --beta-c (-1.0) must be a finite number >= 0"),
    (["--profile", "x.json", "--alpha-a", "1"], "give either --alpha-a/--beta-a/--alpha-c/--beta-c or --profile"),
])
def test_plan_lancet_bad_input_is_one_line(args, message):
    code, out, err = run_cli("plan", "lancet", *LAYER, *args)
    lines = err.strip().splitlines()
    assert code == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("moe-plugins plan: error:") and message in lines[0]


def test_plan_lancet_help():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        main(["plan", "lancet", "--help"])
    assert exc.value.code == 0
    assert "operator partition pass" in out.getvalue() and "--max-partitions" in out.getvalue()


# ---- the runtime's choice ("partitions": "auto"): the executor's ranges, its time, the choice -------------------

def _stack():
    return (Op(name="attn0", kind="compute", alpha=0.0, beta=1.0), Op(name="gate", kind="compute", alpha=0.0, beta=0.1,
                                                                      barrier=True),
            Op(name="dispatch", kind="comm", alpha=0.0, beta=4.0), Op(name="experts", kind="compute", alpha=0.0, beta=2.0),
            Op(name="combine", kind="comm", alpha=0.0, beta=4.0), Op(name="attn1", kind="compute", alpha=0.0, beta=3.0))


def test_executor_ranges_run_from_each_gate_to_the_next():
    from moe_plugins.lancet.choice import executor_ranges
    ops = _stack()
    assert executor_ranges(ops) == [(2, 6)]
    two = ops + (Op(name="gate2", kind="compute", alpha=0.0, beta=0.1, barrier=True),
                 Op(name="d2", kind="comm", alpha=0.0, beta=1.0))
    assert executor_ranges(two) == [(2, 6), (7, 8)]
    assert executor_ranges(ops[:2]) == []                     # a gate with nothing after it


def test_executor_time_pipelines_the_ranges_and_not_the_backward():
    from moe_plugins.lancet.choice import executor_time
    ops = _stack()
    serial = sum(op.time(1) for op in ops)
    assert executor_time(ops, 1, "forward") == pytest.approx(serial)
    assert executor_time(ops, 2, "forward") == pytest.approx(1.1 + segment_time(ops[2:], 2))
    assert executor_time(ops, 2, "forward") < serial          # the exchanges hide under other partitions
    back = sum(op.time(1) * (2.0 if op.kind == "compute" else 1.0) for op in ops)
    assert executor_time(ops, 1, "training") == pytest.approx(serial + back)
    costly = tuple(replace(op, alpha=0.5) for op in ops)      # alpha paid k times in the unpipelined backward
    assert executor_time(costly, 2, "training") - executor_time(costly, 2, "forward") == pytest.approx(
        back + 4 * 0.5 * 2 + 2 * 0.5)                          # 4 range ops x 2 calls, 2 whole-batch ops x 1


def test_choose_partitions_follows_the_link_and_the_launch_cost():
    from moe_plugins.lancet.choice import choose_partitions
    (k,), (times,) = choose_partitions(_stack(), [1, 2, 4], "forward")
    assert k > 1 and times[k] == min(times.values()) and set(times) == {1, 2, 4}
    launch_bound = tuple(replace(op, alpha=10.0) for op in _stack())
    assert choose_partitions(launch_bound, [1, 2, 4])[0] == (1,)
    with pytest.raises(ValueError, match="ks is empty"):
        choose_partitions(_stack(), [])


def _two_ranges(tail_compute: float):
    """Two MoE blocks: the first range has attention behind its exchanges, the last ``tail_compute`` of it."""
    gate = Op(name="gate2", kind="compute", alpha=0.0, beta=0.1, barrier=True)
    tail = (Op(name="d2", kind="comm", alpha=0.5, beta=4.0), Op(name="e2", kind="compute", alpha=0.5, beta=0.4),
            Op(name="c2", kind="comm", alpha=0.5, beta=4.0))
    after = (Op(name="attn2", kind="compute", alpha=0.5, beta=tail_compute),) if tail_compute else ()
    return tuple(replace(op, alpha=0.5) for op in _stack()) + (gate,) + tail + after


def test_each_range_gets_its_own_count_and_the_last_one_fewer():
    """The executor's ranges are timed on their own: the last MoE block, with nothing behind its combine, is
    better off with fewer partitions than the first, which hides its exchanges under the next attention."""
    from moe_plugins.lancet.choice import choose_partitions, executor_time
    ks, times = choose_partitions(_two_ranges(0.0), [1, 2, 4], "forward")
    assert ks[0] > ks[1] == 1 and len(times) == 2, (ks, times)
    assert executor_time(_two_ranges(0.0), ks, "forward") < min(executor_time(_two_ranges(0.0), k, "forward")
                                                                for k in (1, 2, 4))
    assert choose_partitions(_two_ranges(6.0), [1, 2, 4], "forward")[0][1] > 1     # compute behind it again
    with pytest.raises(ValueError, match=r"one count per range; the op list has 2"):
        executor_time(_two_ranges(0.0), [2])


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("objective", ["forward", "training"])
def test_the_per_range_choice_is_the_brute_force_optimum(seed, objective):
    """Against every vector of counts over the ranges (3 ranges, 4 candidates: 64 vectors), on random op lists."""
    import itertools
    import random

    from moe_plugins.lancet.choice import choose_partitions, executor_ranges, executor_time
    rng = random.Random(seed)
    ops = []
    for block in range(3):
        ops += [Op(name=f"a{block}", kind="compute", alpha=rng.uniform(0, 0.3), beta=rng.uniform(0, 5)),
                Op(name=f"g{block}", kind="compute", alpha=0.0, beta=0.1, barrier=True)]
        ops += [Op(name=f"{n}{block}", kind=kind, alpha=rng.uniform(0, 0.3), beta=rng.uniform(0, 5))
                for n, kind in (("d", "comm"), ("e", "compute"), ("c", "comm"))]
    ops.append(Op(name="head", kind="compute", alpha=0.0, beta=rng.uniform(0, 5)))
    assert len(executor_ranges(ops)) == 3
    ks, _ = choose_partitions(ops, [1, 2, 3, 4], objective)
    best = min(executor_time(ops, v, objective) for v in itertools.product([1, 2, 3, 4], repeat=3))
    assert executor_time(ops, ks, objective) == pytest.approx(best, rel=1e-9)
