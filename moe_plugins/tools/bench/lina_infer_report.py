"""The inference latency bench's report (``benchmarks/lina_infer.py``; issue #24): groups, ratios, targets, the
format check, Markdown and the latency CDF plot. Pure but for the plot.

Format (the bench's: ``groups[].rows[name]``)::

    {"meta": {...},
     "groups": [{"case": "real" | "skew=S", "rate": "200mbit",
                 "rows": {"deepspeed": {"p50_ms", "p95_ms", "p99_ms", "mean_ms", "n", "latency_ms": [...],
                                        "layers": [...], "skew": {...}, "lina": null | {...},
                                        "output_max_abs_diff_vs_deepspeed", "p50_vs_deepspeed",
                                        "p95_vs_deepspeed"}, ...},
                 "skew": {"busiest_share", "busiest_share_batch_mean", "even_share", "per_layer"},
                 "accuracy": lina-infer's estimation accuracy, "phase2_rate": ..., "targets": [...]}]}

Targets (issue #24, where the routing is skewed): ``lina-infer``'s p95 at least 1.3x better than
``deepspeed``'s, within 1.25x of ``ideal``'s, and its median no worse than ``deepspeed``'s.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional

from moe_plugins.tools.bench.lina_infer_rank import REFERENCE, ROWS
from moe_plugins.tools.bench.report import fmt_paired, paired_ratio

LINA = "lina-infer"
TIMES = ("p50_ms", "p95_ms", "p99_ms")


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b <= 0 else a / b


def targets(rows: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's three targets for ``lina-infer`` (those whose rows ran)."""
    if LINA not in rows or REFERENCE not in rows:
        return []
    lina, ds = rows[LINA], rows[REFERENCE]
    out = [{"name": "lina-infer p95 speed-up over deepspeed (deepspeed p95 / lina-infer p95)",
            "value": _ratio(ds["p95_ms"], lina["p95_ms"]), "target": ">= 1.3"},
           {"name": "lina-infer p50 over deepspeed p50 (median no worse)",
            "value": _ratio(lina["p50_ms"], ds["p50_ms"]), "target": "<= 1.0"}]
    if "ideal" in rows:
        out.insert(1, {"name": "lina-infer p95 over ideal p95", "value": _ratio(lina["p95_ms"], rows["ideal"]["p95_ms"]),
                       "target": "<= 1.25"})
    for t in out:
        bound = float(t["target"].split()[1])
        t["met"] = t["value"] is not None and (t["value"] >= bound if t["target"].startswith(">=") else
                                               t["value"] <= bound)
    return out


def make_group(case: str, rate: str, rows: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """One (case, rate) group from rank 0's per-row summaries: ratios to deepspeed, the routing's skew (from the
    deepspeed row: the model's own routing), Lina's accuracy and phase-2 rate, the targets."""
    rows = {name: dict(rows[name]) for name in ROWS if name in rows}
    ref = rows.get(REFERENCE)
    for r in rows.values():
        r["p50_vs_deepspeed"] = _ratio(r["p50_ms"], ref["p50_ms"]) if ref else None
        r["p95_vs_deepspeed"] = _ratio(r["p95_ms"], ref["p95_ms"]) if ref else None
        # round i of every row served the same batch side by side: per-round ratios cancel the machine's drift
        r["paired_vs_deepspeed"] = paired_ratio(r["latency_ms"], ref["latency_ms"]) if ref else None
    skew = dict((ref or {}).get("skew") or {})
    skew["per_layer"] = [layer.get("busiest_share") for layer in (ref or {}).get("layers", [])]
    lina = (rows.get(LINA) or {}).get("lina") or {}
    return {"case": case, "rate": rate, "rows": rows, "skew": skew, "accuracy": lina.get("accuracy"),
            "phase2_rate": lina.get("phase2_rate"), "targets": targets(rows)}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def report_problems(report: Any) -> List[str]:
    """Everything wrong with a report's format (empty: well formed), each naming where."""
    if not isinstance(report, dict) or not isinstance(report.get("groups"), list) or not report["groups"]:
        return ["the report must be an object with a non-empty list 'groups'"]
    problems = [] if isinstance(report.get("meta"), dict) else ["meta must be an object"]
    for gi, g in enumerate(report["groups"]):
        where = f"groups[{gi}]"
        if not isinstance(g, dict) or not isinstance(g.get("rows"), dict):
            problems.append(f"{where} must be an object with an object 'rows'")
            continue
        problems += [f"{where}.{k} is missing" for k in ("case", "rate", "skew", "targets") if k not in g]
        if REFERENCE not in g["rows"]:
            problems.append(f"{where}.rows has no {REFERENCE!r} row")
        for name, r in g["rows"].items():
            at = f"{where}.rows[{name!r}]"
            if name not in ROWS:
                problems.append(f"{at}: unknown row; allowed: {', '.join(ROWS)}")
            bad = [k for k in TIMES + ("n",) if not _number(r.get(k))]
            if bad:
                problems.append(f"{at}: {', '.join(bad)} must be finite numbers")
                continue
            if not (0 < r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]):
                problems.append(f"{at}: needs 0 < p50_ms <= p95_ms <= p99_ms (got {r['p50_ms']}, {r['p95_ms']}, "
                                f"{r['p99_ms']})")
            if len(r.get("latency_ms") or []) != r["n"]:
                problems.append(f"{at}: latency_ms must hold n ({r['n']}) per-batch times")
            if not isinstance(r.get("layers"), list) or not r["layers"]:
                problems.append(f"{at}: layers must list the MoE layers")
            if name in ("lina-infer", "lina-infer-noest") and not isinstance(r.get("lina"), dict):
                problems.append(f"{at}: lina (Lina's own figures) must be an object")
        share = g.get("skew", {}).get("busiest_share")
        if share is not None and not (_number(share) and 0 < share <= 1):
            problems.append(f"{where}.skew.busiest_share ({share!r}) must be in (0, 1]")
    return problems


def _fmt(v: Any, digits: int = 2, pct: bool = False) -> str:
    if v is None:
        return "–"
    return f"{v:.1%}" if pct else f"{v:.{digits}f}"


def markdown(report: Dict[str, Any]) -> str:
    meta = report["meta"]
    out = [f"# {meta.get('title', 'Lina inference latency')}", ""] + [f"- {line}" for line in meta.get("header_lines", [])]
    out += ["", "Columns: per-batch latency of the slowest rank over the timed rounds (p50 / p95 / p99), each "
            "row's p50 and p95 over deepspeed's; paired = the median of the per-round ratios to deepspeed (rows served the same batch in the same round) with its bootstrap 90% interval; a2a p95 = per MoE layer, the p95 over batches of the layer's "
            "exchange time (slowest rank; source in the JSON); layer p95 = the MoE layer's wall time; max|Δy| = "
            "batch 0's output against deepspeed's (ideal differs by construction).", ""]
    for g in report["groups"]:
        skew = g["skew"]
        out += [f"## {g['case']}, {g['rate']}", "",
                f"Skew (the deepspeed row's routing): busiest expert {_fmt(skew.get('busiest_share'), pct=True)} of a "
                f"layer's tokens over the run (per layer: {', '.join(_fmt(s, pct=True) for s in skew.get('per_layer', []))}; "
                f"mean over batches of the per-batch busiest share {_fmt(skew.get('busiest_share_batch_mean'), pct=True)}; "
                f"even {_fmt(skew.get('even_share'), pct=True)}). Lina: estimation accuracy "
                f"{_fmt(g.get('accuracy'), pct=True)}, phase 2 re-planned in {_fmt(g.get('phase2_rate'), pct=True)} "
                f"of layer-batches.", "",
                "| row | p50 ms | p95 ms | p99 ms | p50 / ds | p95 / ds | paired t / t_ds (90% CI) | a2a p95 ms per "
                "layer | layer p95 ms per layer | max\\|Δy\\| |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in g["rows"].items():
            a2a = " / ".join(_fmt(layer.get("exchange_p95_ms")) for layer in r["layers"])
            lay = " / ".join(_fmt(layer.get("layer_p95_ms")) for layer in r["layers"])
            diff = r.get("output_max_abs_diff_vs_deepspeed")
            out.append(f"| {name} | {_fmt(r['p50_ms'])} | {_fmt(r['p95_ms'])} | {_fmt(r['p99_ms'])} | "
                       f"{_fmt(r['p50_vs_deepspeed'], 3)} | {_fmt(r['p95_vs_deepspeed'], 3)} | "
                       f"{fmt_paired(r.get('paired_vs_deepspeed'))} | {a2a} | {lay} | "
                       f"{'–' if diff is None else f'{diff:.1e}'} |")
        out += ["", "Targets (issue #24):", ""]
        out += [f"- {'met' if t['met'] else '**MISSED**'}: {t['name']}: {_fmt(t['value'], 3)} (target {t['target']})"
                for t in g["targets"]] or ["- (no lina-infer row: nothing to judge)"]
        rows = g["rows"]
        if LINA in rows and "lina-infer-noest" in rows:
            noest = rows["lina-infer-noest"]
            out.append(f"- without estimation (lina-infer-noest, phase 2 only): p50 "
                       f"{_fmt(_ratio(noest['p50_ms'], rows[LINA]['p50_ms']), 3)}x and p95 "
                       f"{_fmt(_ratio(noest['p95_ms'], rows[LINA]['p95_ms']), 3)}x lina-infer's "
                       f"(the paper: median 18.6-24% worse without estimation)")
        out.append("")
    return "\n".join(out) + "\n"


def plot(report: Dict[str, Any], path: Path) -> None:
    """One panel per (case, rate): the per-batch latency CDF of every row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    groups = report["groups"]
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    for ax, g in zip(axes[0], groups):
        for name, r in g["rows"].items():
            xs = np.sort(np.asarray(r["latency_ms"], dtype=float))
            ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=f"{name} (p95 {r['p95_ms']:.1f})")
        for q in (0.5, 0.95):
            ax.axhline(q, color="grey", lw=0.5, ls=":")
        ax.set_title(f"{g['case']}, {g['rate']}")
        ax.set_xlabel("batch latency, slowest rank (ms)")
        ax.set_ylabel("fraction of batches")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
