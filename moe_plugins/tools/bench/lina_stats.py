"""Statistics of the training-step contention bench, as pure functions over the ranks' raw measurements.

- **Backward all-to-all time per op**: the i-th urgent backward all-to-all of a step has a start and an end
  on every rank (one clock: the ranks share a machine). Its time is the latest end minus the latest start:
  from the moment the last rank entered the collective (when it can first move every byte) to the moment
  the last rank left it. Ranks that entered early and waited are not charged for their wait.
- **Slowdown** of an op: its time over the ``noreduce`` row's median time of the same op (same index in the
  step) in the same rate group; the CDF of those is the paper's Fig. 4.
- **Reduction time**: how long the step's gradient all-reduces ran (one lane, one at a time: its busy time),
  slowest rank, median over steps. Against ``sync``'s (the same bytes, alone on the link) it shows how much
  the reduction itself was slowed by sharing the link.
- **Bytes on the wire**: what left each node's NIC during a step (the first rank of the node reads it),
  median over the timed steps, busiest node. Every row that reduces must move the same bytes.
- **Targets** (issue #23): ``fifo``'s median slowdown >= 1.5 (else contention was not reproduced), the
  lina row's <= 1.15, and the lina step >= 1.15x faster than ``fifo`` where contended, at most 3 % slower
  where not. *Contended* means ``fifo``'s median slowdown reached 1.5 at that rate.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from moe_plugins.tools.bench.lina_plan import LINA, NO_PRIORITY, REFERENCE
from moe_plugins.tools.bench.report import paired_ratio, per_node, time_stats

CONTENTION_MIN = 1.5        # fifo's backward all-to-all slowdown that counts as contention reproduced
LINA_A2A_MAX = 1.15         # lina's backward all-to-all slowdown at most
SPEEDUP_MIN = 1.15          # lina's step speed-up over fifo where contended
UNCONTENDED_SLOWER_MAX = 1.03   # lina's step over fifo's where not contended
WIRE_TOLERANCE = 0.02       # rows that reduce must move the same bytes, to 2 %


def op_times_ms(per_rank: Sequence[Sequence[Sequence[Tuple[int, int]]]]) -> List[List[float]]:
    """``per_rank[rank][step]`` is that step's (start_ns, end_ns) per backward all-to-all, in issue order.
    Returns ``[step][op]`` times in ms: latest end minus latest start over the ranks."""
    if not per_rank:
        raise ValueError("op_times_ms needs at least one rank")
    steps = len(per_rank[0])
    if any(len(r) != steps for r in per_rank):
        raise ValueError(f"ranks recorded different step counts: {[len(r) for r in per_rank]}")
    out = []
    for s in range(steps):
        counts = [len(r[s]) for r in per_rank]
        if len(set(counts)) != 1:
            raise ValueError(f"step {s}: ranks recorded different numbers of backward all-to-alls: {counts}")
        out.append([(max(r[s][i][1] for r in per_rank) - max(r[s][i][0] for r in per_rank)) / 1e6
                     for i in range(counts[0])])
    return out


def per_op_median(times: Sequence[Sequence[float]]) -> List[float]:
    """Median over steps of each op index (``times[step][op]``, every step the same op count)."""
    if not times:
        return []
    return [float(np.median([step[i] for step in times])) for i in range(len(times[0]))]


def slowdowns(times: Sequence[Sequence[float]], reference: Sequence[float]) -> List[float]:
    """Every op's time over the reference's median time of the same op index."""
    out = []
    for step in times:
        if len(step) != len(reference):
            raise ValueError(f"a step has {len(step)} backward all-to-alls, the reference {len(reference)}")
        out += [t / ref for t, ref in zip(step, reference) if ref > 0]
    return out


def cdf(values: Sequence[float]) -> Tuple[List[float], List[float]]:
    """Sorted values and their cumulative fractions (i + 1) / n."""
    xs = sorted(float(v) for v in values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def node_bytes(per_rank_steps: Sequence[Sequence[Optional[int]]], ranks_per_node: int, mode: str) -> Optional[float]:
    """Busiest node's median bytes per step. ``per_rank_steps[rank][step]``; ``first``: a counter every rank
    of a node reads (the NIC), ``sum``: what each rank itself sends (the model). None without a counter."""
    if mode not in ("first", "sum"):
        raise ValueError(f"mode ({mode!r}) must be 'first' or 'sum'")
    if not per_rank_steps or any(v is None for r in per_rank_steps for v in r):
        return None
    totals = [per_node([r[s] for r in per_rank_steps], ranks_per_node, mode) for s in range(len(per_rank_steps[0]))]
    return max(float(np.median([t[n] for t in totals])) for n in range(-(-len(per_rank_steps) // ranks_per_node)))


def wire_check(nic_mb: Dict[str, Optional[float]], kinds: Dict[str, str],
               tolerance: float = WIRE_TOLERANCE) -> Dict[str, Any]:
    """Every reducing row's NIC bytes against the first reducing row's (``noreduce`` moves fewer, by design).
    ``flagged``: rows off by more than ``tolerance``."""
    reducing = [label for label, kind in kinds.items() if kind != REFERENCE and nic_mb.get(label) is not None]
    if not reducing:
        return {"reference": None, "ratios": {}, "flagged": [], "tolerance": tolerance}
    ref = reducing[0]
    ratios = {label: nic_mb[label] / nic_mb[ref] for label in reducing}
    return {"reference": ref, "ratios": ratios, "tolerance": tolerance,
            "flagged": [label for label, r in ratios.items() if abs(r - 1) > tolerance]}


def headline(kinds: Dict[str, str], kind: str) -> Optional[str]:
    """The first row of ``kind`` in the plan's order (the lina row the targets judge; others are the sweep)."""
    return next((label for label, k in kinds.items() if k == kind), None)


def targets(rows: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's targets for one rate group, from the summarised rows; each {name, value, target, met}."""
    kinds = {label: r["kind"] for label, r in rows.items()}
    fifo, lina = headline(kinds, NO_PRIORITY), headline(kinds, LINA)
    out: List[Dict[str, Any]] = []
    if fifo is None or rows[fifo]["a2a_slowdown_median"] is None:
        return out
    contention = rows[fifo]["a2a_slowdown_median"]
    contended = contention >= CONTENTION_MIN
    out.append({"name": f"{fifo} backward all-to-all / {REFERENCE} (median slowdown): contention reproduced",
                "value": contention, "target": f">= {CONTENTION_MIN}", "met": contended})
    if lina is None or rows[lina]["a2a_slowdown_median"] is None:
        return out
    out.append({"name": f"{lina} backward all-to-all / {REFERENCE} (median slowdown)",
                "value": rows[lina]["a2a_slowdown_median"], "target": f"<= {LINA_A2A_MAX}",
                "met": rows[lina]["a2a_slowdown_median"] <= LINA_A2A_MAX})
    speedup = rows[fifo]["median_ms"] / rows[lina]["median_ms"]
    if contended:
        out.append({"name": f"step speed-up of {lina} over {fifo} (contended)", "value": speedup,
                    "target": f">= {SPEEDUP_MIN}", "met": speedup >= SPEEDUP_MIN})
    else:
        out.append({"name": f"step of {lina} over {fifo} (not contended)", "value": 1 / speedup,
                    "target": f"<= {UNCONTENDED_SLOWER_MAX}", "met": 1 / speedup <= UNCONTENDED_SLOWER_MAX})
    return out


def contention_split(rows: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, float]]:
    """Where ``fifo``'s contention landed: its backward all-to-alls' median slowdown (over ``noreduce``) and its
    all-reduces' time over ``sync``'s, which moved the same bytes alone; beside them ``sync``'s own median
    slowdown, the noise floor (its backward runs with no reduction beside it, like ``noreduce``'s). None
    without those rows."""
    kinds = {label: r["kind"] for label, r in rows.items()}
    fifo, sync = headline(kinds, NO_PRIORITY), headline(kinds, "sync")
    if fifo is None or sync is None or not rows[sync].get("reduce_ms_median") or \
            rows[fifo].get("reduce_ms_median") is None or rows[fifo]["a2a_slowdown_median"] is None:
        return None
    return {"a2a_slowdown": rows[fifo]["a2a_slowdown_median"],
            "reduce_slowdown": rows[fifo]["reduce_ms_median"] / rows[sync]["reduce_ms_median"],
            "noise_floor": rows[sync]["a2a_slowdown_median"]}


def _quantiles(values: Sequence[float]) -> Dict[str, Optional[float]]:
    if not values:
        return {"median": None, "p10": None, "p90": None}
    a = np.asarray(values, dtype=float)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)), "p90": float(np.percentile(a, 90))}


def summarize_rate(record: Dict[str, Any], ranks_per_node: int) -> Dict[str, Any]:
    """One rate group: per row step time, backward all-to-all times and slowdowns, bytes; ratios; targets."""
    raw_rows = record["rows"]
    times = {label: op_times_ms(raw["bwd_a2a_ns_per_rank"]) for label, raw in raw_rows.items()}
    ref_label = headline({k: v["kind"] for k, v in raw_rows.items()}, REFERENCE)
    reference = per_op_median(times[ref_label]) if ref_label is not None else None
    ref_median = _quantiles([t for st in times[ref_label] for t in st])["median"] if ref_label else None
    rows: Dict[str, Dict[str, Any]] = {}
    for label, raw in raw_rows.items():
        ops = [t for step in times[label] for t in step]
        slow = slowdowns(times[label], reference) if reference else []
        nic = node_bytes(raw["nic_tx_bytes_per_rank"], ranks_per_node, "first")
        model = node_bytes(raw["model_bytes_per_rank"], ranks_per_node, "sum")
        q, s = _quantiles(ops), _quantiles(slow)
        reduce_ms = [max(steps) / 1e6 for steps in zip(*raw["reduce_ns_per_rank"])]
        rows[label] = {**time_stats(raw["times_s"]), "kind": raw["kind"], "notes": raw["notes"],
                       "times_s": raw["times_s"], "a2a_ops": len(times[label][0]) if times[label] else 0,
                       "a2a_ms_median": q["median"], "a2a_ms_p10": q["p10"], "a2a_ms_p90": q["p90"],
                       "a2a_ms_per_op": times[label], "a2a_slowdown_median": s["median"],
                       "a2a_slowdown_p90": s["p90"], "a2a_slowdowns": slow,
                       "a2a_vs_noreduce_median": q["median"] / ref_median if ref_median and q["median"] else None,
                       "reduce_ms_median": _quantiles(reduce_ms)["median"] if any(reduce_ms) else None,
                       "nic_MB_per_node": None if nic is None else nic / 1e6,
                       "model_MB_per_node": None if model is None else model / 1e6,
                       "grad_max_abs_diff_vs_sync": raw["grad_max_abs_diff_vs_sync"]}
    kinds = {label: r["kind"] for label, r in rows.items()}
    fifo = headline(kinds, NO_PRIORITY)
    for label, r in rows.items():
        if fifo is not None and label != fifo:
            r["step_speedup_vs_fifo"] = rows[fifo]["median_ms"] / r["median_ms"]
            r["paired_vs_fifo"] = paired_ratio(r["times_s"], rows[fifo]["times_s"])
        if ref_label is not None and label != ref_label:
            r["step_vs_noreduce"] = r["median_ms"] / rows[ref_label]["median_ms"]
    return {"rate": record["rate"], "rows": rows, "targets": targets(rows), "contention_split": contention_split(rows),
            "wire": wire_check({k: r["nic_MB_per_node"] for k, r in rows.items()}, kinds),
            "traces": {label: {"round": raw["trace_round"], "per_rank": raw["trace_per_rank"]}
                       for label, raw in raw_rows.items()}}
