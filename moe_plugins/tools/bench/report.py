"""Statistics, ratios and the link lower bound of a bench run; JSON, Markdown and PNG output.

Per row of every (case, rate):

- ``median_ms``, ``p10_ms``, ``p90_ms``: forward+backward time of the slowest rank over the timed rounds;
- ``vs_<stock>``: the row's median divided by that stock layer's median in the same (case, rate) group
  (1.0 = as fast; below 1 = faster);
- ``model_MB_per_node``: the largest node's inter-node bytes of one forward+backward in the model
  (ledger for the project's layers, counted collectives for the stock ones), per node = summed over
  its ranks; ``nic_MB_per_node``: what left the busiest node's NIC, measured (headers, TCP acks and gloo's
  own algorithms included); both in MB = 10^6 bytes;
- ``link_lb_ms``: the **link lower bound**, model bytes of the busiest node x 8 / shaped rate: the time the
  shaped NIC needs just to send them; ``vs_link_lb`` = median / link_lb_ms (>= 1; near 1 means the row is
  bound by the link, large means compute or software overhead dominates);
- ``a2a_ms``, ``exposed_ms``, ``a2a_overlap``: the step's all-to-all time, the part of it no compute hid, and the
  hidden share (:mod:`.lancet_exposure`; None where the row's exposure is not measured); groups with a Lancet
  row are judged against the best fixed PipeMoE degree (:mod:`.lancet_report`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from moe_plugins.plugins import default_registry
from moe_plugins.tools.bench.lancet_exposure import exposure_stats
from moe_plugins.tools.bench.lancet_report import judge_group, lancet_lines
from moe_plugins.tools.bench.matrix import BenchPlan, parse_rate
from moe_plugins.tools.bench.rows import STOCK_ROWS
from moe_plugins.tools.bench.stats import fmt_paired, fmt_value, paired_ratio   # noqa: F401 (the report's API)


def time_stats(times_s: Sequence[float]) -> Dict[str, float]:
    a = np.asarray(times_s, dtype=float) * 1e3
    if a.size == 0:
        raise ValueError("time_stats needs at least one time")
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "n": int(a.size)}


def per_node(values: Sequence[Optional[int]], ranks_per_node: int, mode: str) -> Optional[List[int]]:
    """Per-node totals of per-rank values: ``sum`` (model bytes each rank sends) or ``first`` (a counter
    every rank of the node reads, such as the node's NIC)."""
    if any(v is None for v in values):
        return None
    nodes = [list(values[i:i + ranks_per_node]) for i in range(0, len(values), ranks_per_node)]
    return [int(sum(n)) if mode == "sum" else int(n[0]) for n in nodes]


def link_lower_bound_ms(node_bytes: Sequence[int], rate_bps: Optional[int]) -> Optional[float]:
    """Busiest node's bytes x 8 / rate, in ms; None when unshaped. Every op here is symmetric (what a node
    sends equals what it receives), so the busiest sender also bounds the receive side."""
    if rate_bps is None:
        return None
    return max(node_bytes) * 8 / rate_bps * 1e3


def summarize_group(record: Dict[str, Any], plan: BenchPlan) -> Dict[str, Any]:
    rate_bps = parse_rate(record["rate"])
    rows: Dict[str, Dict[str, Any]] = {}
    for label, raw in record["rows"].items():
        model = per_node(raw["model_bytes_per_rank"], plan.ranks_per_node, "sum")
        nic = per_node(raw["nic_tx_bytes_per_rank"], plan.ranks_per_node, "first")
        lb = link_lower_bound_ms(model, rate_bps)
        st = time_stats(raw["times_s"])
        rows[label] = {**st, "kind": raw["kind"], "traffic_source": raw["traffic_source"],
                       "model_MB_per_node": max(model) / 1e6, "nic_MB_per_node": None if nic is None else max(nic) / 1e6,
                       "link_lb_ms": lb, "vs_link_lb": (st["median_ms"] / lb) if lb else None,
                       "max_abs_diff_vs_first": raw["max_abs_diff_vs_first"],
                       "first_row_max_abs": raw["first_row_max_abs"], "times_s": raw["times_s"],
                       "notes": raw.get("notes", []), "ran_as": raw.get("ran_as"),
                       "model_bytes_per_rank": raw["model_bytes_per_rank"], "exposure": raw.get("exposure"),
                       **exposure_stats(raw.get("exposure_per_rank"))}
    for label, row in rows.items():
        for stock in STOCK_ROWS:
            ref = rows.get(stock)
            row[f"vs_{stock}"] = row["median_ms"] / ref["median_ms"] if ref else None
            if ref and label != stock:
                row[f"paired_vs_{stock}"] = paired_ratio(row["times_s"], ref["times_s"])
        peers = [p for p in auto_peers(label, list(rows)) if p in rows]
        if peers:
            best = min(peers, key=lambda p: rows[p]["median_ms"])
            twin = row.get("ran_as") if row.get("ran_as") in peers else None
            row["auto_vs_best"] = {"best": best, "ratio": row["median_ms"] / rows[best]["median_ms"],
                                   "peers": peers, "twin": twin,
                                   "choice_ratio": rows[twin]["median_ms"] / rows[best]["median_ms"] if twin else None,
                                   "twin_ratio": row["median_ms"] / rows[twin]["median_ms"] if twin else None}
    out = {"case": record["case"], "case_label": record["case_label"], "rate": record["rate"],
           "rows": rows, "skipped": record["skipped"], "lancet": judge_group(rows)}
    for key in ("profile", "profile_measurements"):
        if key in record:
            out[key] = record[key]
    return out


def auto_peers(label: str, labels: Sequence[str]) -> List[str]:
    """Pure: the fixed choices an auto row is judged against. A profiled schedule (``parm-auto``): the
    registered schedules it chooses among (``Registry.candidates_of``); ``X@r=<word>`` for a registered degree
    policy (``auto``, ``tune``): every ``X@r=<int>`` (and plain ``X``, r = 1). Other rows have none."""
    name, _, opts = label.partition("@")
    if default_registry().is_profiled(label):
        return [p for p in default_registry().candidates_of(label) if p in labels]
    if opts in {f"r={word}" for word in default_registry().degree_policies()}:
        return [p for p in labels if p == name or (p.startswith(name + "@r=") and p[len(name) + 3:].isdigit())]
    return []


AUTO_TOLERANCE = 1.05       # "within 5% of the best fixed choice"


def auto_summary(report: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Per auto row: in how many groups its median is within 5% of the best peer's median."""
    out: Dict[str, Dict[str, Any]] = {}
    for g in report["groups"]:
        for label, r in g["rows"].items():
            judged = r.get("auto_vs_best")
            if judged is None:
                continue
            s = out.setdefault(label, {"groups": 0, "within": 0, "worst_ratio": 0.0, "ratios": [],
                                       "choice_judged": 0, "choice_within": 0, "twin_ratios": []})
            s["groups"] += 1
            s["within"] += judged["ratio"] <= AUTO_TOLERANCE
            s["worst_ratio"] = max(s["worst_ratio"], judged["ratio"])
            s["ratios"].append(judged["ratio"])
            if judged.get("choice_ratio") is not None:
                s["choice_judged"] += 1
                s["choice_within"] += judged["choice_ratio"] <= AUTO_TOLERANCE
                s["twin_ratios"].append(judged["twin_ratio"])
    return out


def summarize(records: List[Dict[str, Any]], plan: BenchPlan, meta: Dict[str, Any]) -> Dict[str, Any]:
    report = {"meta": meta, "groups": [summarize_group(r, plan) for r in records]}
    report["auto"] = auto_summary(report)
    return report


# ---- output ---------------------------------------------------------------------------------------------

def header(report: Dict[str, Any], title: str) -> List[str]:
    """A report's Markdown title and its header lines (transport, timing, machine, versions, reproduce)."""
    return [f"# {title}: {report['meta']['title']}", ""] + [f"- {line}" for line in report["meta"]["header_lines"]]


def markdown(report: Dict[str, Any]) -> str:
    out = header(report, "moe-plugins bench")
    out += ["", "Columns: time = forward+backward of the slowest rank (median, p10–p90 over the timed rounds); "
            "t/t_X = median over stock layer X's median in the same group; model MB/node = inter-node bytes "
            "of the busiest node in one forward+backward (ledger, or counted collectives for stock layers); "
            "NIC MB/node = measured on the node's NIC; link LB = model bytes x 8 / rate; t/LB = median / link LB; "
            "a2a ms, exposed a2a ms = the step's all-to-all time and the part of it no compute hid (mean over ranks, "
            "median over rounds; – where not measured); max|Δy| = largest output difference from the first row "
            "(same weights and tokens).", ""]
    stock_cols = [s for s in STOCK_ROWS if any(s in g["rows"] for g in report["groups"])]
    exposed = any(r.get("exposed_ms") is not None for g in report["groups"] for r in g["rows"].values())
    head = (["case", "rate", "row", "time ms (p10–p90)"] + [f"t/t_{s}" for s in stock_cols]
            + ["model MB/node", "NIC MB/node", "link LB ms", "t/LB"]
            + (["a2a ms", "exposed a2a ms"] if exposed else []) + ["max|Δy|"])
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in report["groups"]:
        for label, r in g["rows"].items():
            cells = [g["case_label"], g["rate"], label,
                     f"{r['median_ms']:.1f} ({r['p10_ms']:.1f}–{r['p90_ms']:.1f})"]
            cells += [fmt_value(r.get(f"vs_{s}")) for s in stock_cols]
            cells += [fmt_value(r["model_MB_per_node"], 3), fmt_value(r["nic_MB_per_node"], 3), fmt_value(r["link_lb_ms"], 1),
                      fmt_value(r["vs_link_lb"])]
            cells += [fmt_value(r.get("a2a_ms"), 1), fmt_value(r.get("exposed_ms"), 1)] if exposed else []
            cells.append(f"{r['max_abs_diff_vs_first']:.1e}")
            out.append("| " + " | ".join(cells) + " |")
        for label, reason in g["skipped"].items():
            out.append(f"| {g['case_label']} | {g['rate']} | {label} | skipped: {reason} |"
                       + " |" * (len(head) - 4))
    return "\n".join(out + _paired_lines(report, stock_cols) + _auto_lines(report) + lancet_lines(report)
                     + _profile_lines(report)) + "\n"


def _paired_lines(report: Dict[str, Any], stock_cols: Sequence[str]) -> List[str]:
    cells = [(g, label, [r.get(f"paired_vs_{s}") for s in stock_cols]) for g in report["groups"]
             for label, r in g["rows"].items() if any(r.get(f"paired_vs_{s}") for s in stock_cols)]
    if not cells:
        return []
    out = ["", "## Paired ratios", "", "Rounds are interleaved, so each round times every row of a group side by "
           "side: the median of the per-round ratios t_row / t_X, with its bootstrap 90% interval, separates a "
           "row's speed from the machine's drift better than the ratio of medians above.", "",
           "| case | rate | row | " + " | ".join(f"paired t/t_{s} (90% CI)" for s in stock_cols) + " |",
           "|" + "---|" * (3 + len(stock_cols))]
    for g, label, pairs in cells:
        out.append(f"| {g['case_label']} | {g['rate']} | {label} | " + " | ".join(
            map(fmt_paired, pairs)) + " |")
    return out


def _auto_lines(report: Dict[str, Any]) -> List[str]:
    if not report.get("auto"):
        return []
    out = ["", "## Automatic choices", "",
           f"An auto row is *within* when its median is at most {AUTO_TOLERANCE:.2f} x the best median among the "
           "fixed choices it picks from, in the same group (same case, same rate, same run). Where the auto row "
           "ran exactly one of those fixed rows' configurations (its *twin*), two more ratios separate the choice "
           "from the timing noise: t_twin / t_best judges the choice by the fixed rows' own medians (how the "
           "PipeMoE paper scores its choices), and t_auto / t_twin compares two timings of the same code, "
           "so its spread is the noise floor of this machine.", "",
           "| case | rate | auto row | chose | best fixed | t_auto / t_best | twin | t_twin / t_best | t_auto / t_twin |",
           "|---|---|---|---|---|---|---|---|---|"]
    for g in report["groups"]:
        for label, r in g["rows"].items():
            judged = r.get("auto_vs_best")
            if judged is not None:
                chose = "; ".join(r.get("notes", [])) or "–"
                out.append(f"| {g['case_label']} | {g['rate']} | {label} | {chose} | {judged['best']} | "
                           f"{judged['ratio']:.3f} | {judged.get('twin') or '–'} | "
                           f"{fmt_value(judged.get('choice_ratio'), 3)} | {fmt_value(judged.get('twin_ratio'), 3)} |")
    out.append("")
    for label, s in report["auto"].items():
        out.append(f"- **{label}**: within 5% of the best fixed choice in {s['within']} of {s['groups']} groups "
                   f"({100 * s['within'] / s['groups']:.0f}%); worst ratio {s['worst_ratio']:.3f}.")
        if s.get("choice_judged"):
            twins = s["twin_ratios"]
            off = sum(not (1 / AUTO_TOLERANCE <= t <= AUTO_TOLERANCE) for t in twins)
            out.append(f"  - judged by its twin's median: within 5% in {s['choice_within']} of the "
                       f"{s['choice_judged']} groups where it ran a fixed row's configuration; "
                       f"the same code timed twice (t_auto / t_twin) differed by more than 5% in {off} of "
                       f"{len(twins)} (range {min(twins):.3f}–{max(twins):.3f}).")
    return out


def _profile_lines(report: Dict[str, Any]) -> List[str]:
    fits = [(g["case_label"], g["rate"], g["profile"]) for g in report["groups"] if g.get("profile")]
    if not fits:
        return []
    out = ["", "## Cost profiles the auto rows used", "",
           "Measured by the bench at the rate being timed (moe_plugins/tools/bench/profiles.py): the collectives and the "
           "`chunk` term once per layout and rate, shared by every case of that layout; the gemm once per case, "
           "on its shape. t = alpha + beta x, x in bytes (collectives), multiply-adds (gemm) or chunks. Each "
           "distinct fit is listed once, with the cases that planned from it.", "",
           "| rate | model | cases | alpha s | beta s/unit | R² |", "|---|---|---|---|---|---|"]
    distinct: Dict[tuple, Dict[str, list]] = {}     # aliases (ep_esp == ep when esp = 1) and shared fits once
    for case, rate, prof in fits:
        for key, m in prof.items():
            entry = distinct.setdefault((m["unit"], m["alpha"], m["beta"], m["r2"]),
                                        {"keys": [], "cases": [], "rates": []})
            for field, value in (("keys", key), ("cases", case), ("rates", rate)):
                entry[field] += [value] if value not in entry[field] else []
    every_case = {case for case, _, _ in fits}
    for (_, alpha, beta, r2), entry in distinct.items():
        used = (f"all {len(every_case)}" if len(every_case) > 1 and set(entry["cases"]) == every_case
                else ", ".join(entry["cases"]))
        out.append(f"| {', '.join(entry['rates'])} | {' = '.join(entry['keys'])} | {used} | {alpha:.3g} | "
                   f"{beta:.3g} | {fmt_value(r2, 4)} |")
    r2s = [key[3] for key in distinct if key[3] is not None]
    if r2s:
        out += ["", f"- R² over the {len(r2s)} distinct fits: min {min(r2s):.4f}, median "
                    f"{sorted(r2s)[len(r2s) // 2]:.4f}; {sum(v >= 0.95 for v in r2s)} of {len(r2s)} at or above 0.95."]
    return out


def plot(report: Dict[str, Any], path: Path) -> Path:
    """One panel per case: median time per row (bars, p10–p90 whiskers) at each rate, with each row's link
    lower bound as a black tick; a second panel row shows the time relative to DeepSpeed's layer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(dict.fromkeys(g["case_label"] for g in report["groups"]))
    fig, axes = plt.subplots(2, len(cases), figsize=(1 + 5 * len(cases), 7.5), squeeze=False)
    for c, case in enumerate(cases):
        groups = [g for g in report["groups"] if g["case_label"] == case]
        labels = list(dict.fromkeys(label for g in groups for label in g["rows"]))
        width = 0.8 / max(len(labels), 1)
        for i, label in enumerate(labels):
            xs, med, lo, hi, lbs, rel = [], [], [], [], [], []
            for x, g in enumerate(groups):
                r = g["rows"].get(label)
                if r is None:
                    continue
                xs.append(x + (i - (len(labels) - 1) / 2) * width)
                med.append(r["median_ms"])
                lo.append(r["median_ms"] - r["p10_ms"])
                hi.append(r["p90_ms"] - r["median_ms"])
                lbs.append(r["link_lb_ms"])
                rel.append(r.get("vs_deepspeed"))
            axes[0][c].bar(xs, med, width, yerr=[lo, hi], capsize=3, label=label)
            for x, lb in zip(xs, lbs):
                if lb:
                    axes[0][c].hlines(lb, x - width / 2, x + width / 2, colors="black", linewidth=2)
            if any(v is not None for v in rel):
                axes[1][c].bar(xs, [v if v is not None else 0 for v in rel], width, label=label)
        for ax in axes[:, c]:
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels([g["rate"] for g in groups])
        axes[0][c].set_title(case, fontsize=9)
        axes[0][c].set_ylabel("fwd+bwd ms (median, p10–p90); black: link lower bound")
        axes[1][c].axhline(1.0, color="gray", linestyle="--", linewidth=1)
        axes[1][c].set_ylabel("time / DeepSpeed stock layer")
        axes[0][c].legend(fontsize=8)
    fig.suptitle(report["meta"]["title"], fontsize=10)
    notes = [line for line in report["meta"]["header_lines"] if line.startswith("note:")]
    if notes:
        import textwrap
        fig.text(0.5, 0.003, textwrap.fill(" ".join(notes), int(fig.get_figwidth() * 13)), ha="center", va="bottom", fontsize=7, color="darkred")
        fig.tight_layout(rect=(0, 0.05, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(report: Dict[str, Any], out_dir: Path, stem: str = "bench") -> List[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(markdown(report))
    plot(report, paths[2])
    return paths
