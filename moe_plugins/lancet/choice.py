"""The block executor's partition counts from the planner's model (``"partitions": "auto"``; pure: no torch).

The executor (:mod:`moe_plugins.lancet.blocks`) cannot run the DP's free segments (:func:`.plan.plan_segments`):
the gate needs the whole batch, so it pipelines fixed *ranges*, from each gate to the next (:func:`executor_ranges`),
and runs every other op once on the whole batch. What it can choose is the partition count of each range. The
ranges run one after another, so the op list's time is the sum of the ranges' times and of the ops outside them
(:func:`executor_time`), and the best count of each range is found on its own (:func:`choose_partitions`): the
DP restricted to the executor's segments. The last range (the last MoE layer and what follows it) often has
less compute behind its exchanges than the others, and then gets fewer partitions.

A range's time at k partitions: its ops stage-major (:func:`.plan.segment_time`), and with the ``"training"``
objective its mirrored backward, which this model does not pipeline: each op's backward k times, ``alpha`` paid
k times (:func:`.plan.backward_ops`).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple, Union

from moe_plugins.lancet.plan import BACKWARD_FACTOR, OBJECTIVES, TIE, Op, backward_ops, check_k, segment_time

Counts = Union[int, Sequence[int]]       # one count for every range, or one per range in order


def executor_ranges(ops: Sequence[Op]) -> List[Tuple[int, int]]:
    """The ranges [a, b) the block executor runs partition by partition: from each barrier's next op (the
    dispatch after the gate) up to the next barrier (excluded) or the end."""
    gates = [i for i, op in enumerate(ops) if op.barrier]
    return [(g + 1, nxt) for g, nxt in zip(gates, gates[1:] + [len(ops)]) if g + 1 < nxt]


def _check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective ({objective!r}) must be one of {', '.join(OBJECTIVES)}")


def range_time(ops: Sequence[Op], a: int, b: int, k: int, objective: str = "training",
               backward_factor: float = BACKWARD_FACTOR) -> float:
    """The model's time of range [a, b) of ``ops`` at k partitions (module docstring)."""
    check_k(k)
    _check_objective(objective)
    total = segment_time(ops[a:b], k)
    if objective == "training":
        total += sum(k * op.time(k) for op in backward_ops(ops[a:b], backward_factor))
    return total


def executor_time(ops: Sequence[Op], k: Counts, objective: str = "training",
                  backward_factor: float = BACKWARD_FACTOR) -> float:
    """The model's time of the op list as the executor runs it: each range at its count (``k``: one for all, or
    one per range), every other op once on the whole batch (and its backward once, with ``"training"``)."""
    _check_objective(objective)
    ranges = executor_ranges(ops)
    counts = [k] * len(ranges) if isinstance(k, int) else list(k)
    if len(counts) != len(ranges):
        raise ValueError(f"k ({list(counts)}) must give one count per range; the op list has {len(ranges)}")
    inside = {i for a, b in ranges for i in range(a, b)}
    outside = [op for i, op in enumerate(ops) if i not in inside]
    total = sum(range_time(ops, a, b, c, objective, backward_factor) for (a, b), c in zip(ranges, counts))
    total += sum(op.time(1) for op in outside)
    if objective == "training":
        total += sum(op.time(1) for op in backward_ops(outside, backward_factor))
    return total


def choose_partitions(ops: Sequence[Op], ks: Sequence[int],
                      objective: str = "training") -> Tuple[Tuple[int, ...], Tuple[Dict[int, float], ...]]:
    """Per range (:func:`executor_ranges`), the k among ``ks`` with the least :func:`range_time` (ties within
    :data:`.plan.TIE`: fewer partitions), and every candidate's time for that range."""
    if not ks:
        raise ValueError("ks is empty: at least k = 1 must be allowed")
    chosen, times = [], []
    for a, b in executor_ranges(ops):
        per_k = {k: range_time(ops, a, b, k, objective) for k in sorted(ks)}
        best = min(per_k.values())
        chosen.append(next(k for k, t in per_k.items() if t <= best * (1 + TIE)))
        times.append(per_k)
    return tuple(chosen), tuple(times)
