"""Lancet's rows judged against the best fixed PipeMoE degree (#26), for the layer bench's report.

In every (case, rate) group that has a ``lancet`` row (``lancet``, ``lancet@r=N``, ``lancet@r=auto``):

- **best fixed degree**: the fastest (median step) of ``baseline`` and the ``baseline@r=<int>`` rows of the group,
  the rows ``baseline@r=auto`` picks from. Not r = 1 by default: r = 1 is only a candidate.
- **bound**: *link-bound* when ``baseline``'s exposed all-to-all time (:mod:`.lancet_exposure`) is at least half
  its step time (medians), else *compute-bound*; unknown without a ``baseline`` row.
- **targets** (issue #26), per Lancet row: exposed all-to-all at most 0.5 x the best degree's; step time at most
  0.87 x the best degree's when link-bound, 1.05 x when compute-bound; the same inter-node bytes per rank (the
  ledger's model bytes) as the best degree's.
- **bytes**: whether every project row and the stock DeepSpeed layer (counted collectives) moved the same bytes per
  rank: "identical bytes on the wire" in the model's convention; the NIC column beside it shows the wire.

Pure functions over the summarised group (:func:`.report.summarize_group`'s rows).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from moe_plugins.tools.bench.stats import fmt_paired, fmt_value, paired_ratio

LANCET = "lancet"
REFERENCE = "baseline"
LINK_BOUND_SHARE = 0.5        # baseline's exposed all-to-all / step at or above this: link-bound
EXPOSED_MAX = 0.5             # Lancet's exposed all-to-all / the best fixed degree's
STEP_MAX = {"link-bound": 0.87, "compute-bound": 1.05}
BYTES_ROWS = ("deepspeed",)   # stock rows whose counted bytes are compared too


def is_lancet(label: str) -> bool:
    return label == LANCET or label.startswith(LANCET + "@")


def fixed_degrees(labels: Sequence[str]) -> List[str]:
    """Pure: ``baseline`` and the ``baseline@r=<int>`` rows among ``labels`` (what ``baseline@r=auto`` picks from)."""
    prefix = REFERENCE + "@r="
    return [label for label in labels
            if label == REFERENCE or (label.startswith(prefix) and label[len(prefix):].isdigit())]


def bound_of(rows: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Pure: ``{"bound", "share"}``: how much of ``baseline``'s step its exposed all-to-all took."""
    base = rows.get(REFERENCE)
    if base is None or base.get("exposed_ms") is None or not base.get("median_ms"):
        return {"bound": None, "share": None}
    share = base["exposed_ms"] / base["median_ms"]
    return {"bound": "link-bound" if share >= LINK_BOUND_SHARE else "compute-bound", "share": share}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def judge_group(rows: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Pure: the Lancet verdicts of one summarised group (module docstring); None without a Lancet row or a fixed
    degree to compare with."""
    labels = list(rows)
    lancet, fixed = [label for label in labels if is_lancet(label)], fixed_degrees(labels)
    if not lancet or not fixed:
        return None
    best = min(fixed, key=lambda label: rows[label]["median_ms"])
    ref = rows[best]
    bound = bound_of(rows)
    compared = [label for label in labels if rows[label].get("kind") == "plugin" or label in BYTES_ROWS]
    differ = [label for label in compared if rows[label].get("model_bytes_per_rank") != ref.get("model_bytes_per_rank")]
    verdicts = {}
    for label in labels:
        r = rows[label]
        step, exposed = _ratio(r["median_ms"], ref["median_ms"]), _ratio(r.get("exposed_ms"), ref.get("exposed_ms"))
        verdict: Dict[str, Any] = {"step_ratio": step, "exposed_ratio": exposed,
                                   "paired": paired_ratio(r["times_s"], ref["times_s"]) if label != best else None}
        if is_lancet(label):
            step_max = STEP_MAX.get(bound["bound"]) if bound["bound"] else None
            verdict["targets"] = {
                "exposed": None if exposed is None else exposed <= EXPOSED_MAX,
                "step": None if step_max is None else step <= step_max,
                "bytes": r.get("model_bytes_per_rank") == ref.get("model_bytes_per_rank")}
        verdicts[label] = verdict
    return {"best": best, **bound, "bytes_identical": not differ, "bytes_differ": differ, "bytes_compared": compared,
            "rows": verdicts}


def _target(value: Optional[bool]) -> str:
    return "–" if value is None else ("met" if value else "MISSED")


def lancet_lines(report: Dict[str, Any]) -> List[str]:
    """The report's section on Lancet (empty when no group has a Lancet row)."""
    groups = [g for g in report["groups"] if g.get("lancet")]
    if not groups:
        return []
    out = ["", "## Lancet against the best fixed PipeMoE degree", "",
           "best fixed = the fastest of `baseline` and `baseline@r=<int>` in the group (not r = 1 unless it is the "
           "fastest). Exposed a2a = all-to-all time (issue to end, union over the step's exchanges) in which the "
           "rank ran no expert forward/backward and no deferred dW; per round the mean over ranks, then the median "
           "over rounds. a2a overlap = the hidden share of the all-to-all time. Bound: link-bound when baseline's "
           f"exposed a2a is >= {LINK_BOUND_SHARE:g} of its step. Targets (#26): exposed <= {EXPOSED_MAX:g} x "
           f"best's; step <= {STEP_MAX['link-bound']:g} x best's (link-bound) or <= {STEP_MAX['compute-bound']:g} "
           "x (compute-bound); the same model bytes per rank.", "",
           "| case | rate | bound (baseline exposed / step) | row | step ms | t/t_best | paired t/t_best (90% CI) | "
           "exposed a2a ms | a2a ms | a2a overlap | exposed / best's | model MB/node | targets: exposed, step, bytes |",
           "|" + "---|" * 13]
    for g in groups:
        judged, rows = g["lancet"], g["rows"]
        bound = f"{judged['bound']} ({judged['share']:.2f})" if judged["bound"] else "unknown (no baseline exposure)"
        for label, v in judged["rows"].items():
            r = rows[label]
            name = f"**{label}** (best fixed)" if label == judged["best"] else label
            targets = v.get("targets")
            cells = [g["case_label"], g["rate"], bound, name, f"{r['median_ms']:.1f}", fmt_value(v["step_ratio"], 3),
                     fmt_paired(v["paired"]), fmt_value(r.get("exposed_ms"), 1), fmt_value(r.get("a2a_ms"), 1),
                     fmt_value(r.get("a2a_overlap"), 2), fmt_value(v["exposed_ratio"], 3),
                     fmt_value(r["model_MB_per_node"], 3),
                     ", ".join(_target(targets[k]) for k in ("exposed", "step", "bytes")) if targets else ""]
            out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for g in groups:
        judged = g["lancet"]
        same = ("identical" if judged["bytes_identical"] else
                "DIFFERENT for " + ", ".join(judged["bytes_differ"]) + " (against the best fixed degree)")
        out.append(f"- {g['case_label']} @ {g['rate']}: model bytes per rank {same} over "
                   f"{', '.join(judged['bytes_compared'])}.")
    return out
