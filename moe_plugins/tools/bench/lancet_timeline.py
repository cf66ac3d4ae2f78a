"""The parent side of Lancet's one-step timeline (``benchmarks/lancet_timeline.py``; the rank side is
:mod:`.lancet_step`): run it on the emulated cluster (:func:`.harness.run_jobs`), summarise, and write
``<stem>.json`` (every round's per-rank figures, the kept step's per-rank trace) and ``<stem>.png`` (the kept
step of every variant at every rate: one row per rank, its all-to-alls above its compute, the overlap figures in
the titles).

Summary per (rate, variant): the step's median (slowest rank) and, per rank, the medians over the timed rounds of
``overlap`` = |all-to-all ∩ compute| / |all-to-all| (exchanges from their issue; :func:`.lancet_step.overlap_figures`),
the same from the lane thread's start, the backward exchanges' overlap, the exposed and total all-to-all time.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Sequence

from moe_plugins.tools.bench.harness import RunOptions, run_jobs
from moe_plugins.tools.bench.lancet_step import REFERENCE, TimelineJob, TimelinePlan, timeline_plan_problems
from moe_plugins.tools.bench.lina_plan import exchange_bytes

FIGURES = ("overlap", "overlap_from_start", "bwd_overlap", "dw_hidden", "a2a_ms", "exposed_ms", "dw_ms")
COLOURS = {"a2a fwd": "tab:orange", "a2a bwd": "tab:red", "experts fwd": "silver", "experts bwd": "dimgray",
           "dW experts": "tab:green", "dW dense": "tab:blue"}


def model_lines(plan: TimelinePlan) -> List[str]:
    m = plan.model
    return [f"model: {m.label}: {m.blocks} MoE layers (schedule baseline, EP {plan.world} over every rank) between "
            f"{m.blocks + 1} dense pairs; each all-to-all moves a {exchange_bytes(m) / 1e3:.0f} kB dispatch buffer "
            f"per rank; {2 * m.blocks} backward all-to-alls per step",
            "step: forward + backward (no reduction, no optimizer), slowest rank; compute = the experts' forward and "
            "backward and the deferred dW, on the rank's compute thread; all-to-all intervals from their issue"]


def summarize_variant(raw: Dict[str, Any]) -> Dict[str, Any]:
    """Pure: step statistics and per-rank medians of every figure over the timed rounds."""
    times = [t * 1e3 for t in raw["times_s"]]
    per_rank = [{k: statistics.median(r[k] for r in rounds) for k in FIGURES} for rounds in raw["rounds_per_rank"]]
    kept = raw["kept_round"]
    return {"about": raw["about"], "step_ms_median": statistics.median(times), "step_ms": times,
            "kept_round": kept, "kept_step_ms": times[kept],
            "grad_max_abs_diff_vs_baseline": raw["grad_max_abs_diff_vs_baseline"], "queue_empty": raw["queue_empty"],
            "median_per_rank": per_rank, "kept_per_rank": [rounds[kept] for rounds in raw["rounds_per_rank"]],
            "mean_over_ranks": {k: statistics.mean(r[k] for r in per_rank) for k in FIGURES},
            "trace_per_rank": raw["trace_per_rank"]}


def summarize(records: List[Dict[str, Any]], plan: TimelinePlan, meta: Dict[str, Any]) -> Dict[str, Any]:
    meta = {**meta, "header_lines": list(meta["header_lines"]) + model_lines(plan)}
    groups = []
    for record in records:
        variants = {name: summarize_variant(raw) for name, raw in record["variants"].items()}
        ref = variants.get(REFERENCE)
        for v in variants.values():
            v["step_vs_baseline"] = v["step_ms_median"] / ref["step_ms_median"] if ref else None
            v["exposed_vs_baseline"] = (v["mean_over_ranks"]["exposed_ms"] / ref["mean_over_ranks"]["exposed_ms"]
                                        if ref and ref["mean_over_ranks"]["exposed_ms"] else None)
        groups.append({"rate": record["rate"], "variants": variants})
    return {"meta": meta, "groups": groups}


def _figures(per_rank: Sequence[Dict[str, float]], key: str, digits: int = 2) -> str:
    return ", ".join(f"{r[key]:.{digits}f}" for r in per_rank)


def text_lines(report: Dict[str, Any]) -> List[str]:
    """A few lines per (rate, variant): what the PNG's titles say, for the terminal."""
    out = [f"# Lancet one-step timeline: {report['meta']['title']}"] + [f"- {h}" for h in report["meta"]["header_lines"]]
    for g in report["groups"]:
        for name, v in g["variants"].items():
            means = v["mean_over_ranks"]
            ratio = "" if v["step_vs_baseline"] is None else f" ({v['step_vs_baseline']:.2f}x baseline)"
            out.append(f"{g['rate']} {name}: step {v['step_ms_median']:.1f} ms{ratio}; overlap per rank "
                       f"{_figures(v['median_per_rank'], 'overlap')} (from the lane's start "
                       f"{_figures(v['median_per_rank'], 'overlap_from_start')}); exposed a2a "
                       f"{means['exposed_ms']:.1f} of {means['a2a_ms']:.1f} ms; dW {means['dw_ms']:.1f} ms, "
                       f"{100 * means['dw_hidden']:.0f}% of it inside an exchange; max|Δgrad| vs baseline "
                       f"{v['grad_max_abs_diff_vs_baseline']:.1e}; queue empty after backward: {v['queue_empty']}")
    return out


def timeline_bars(trace_per_rank: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Pure: one bar per all-to-all (lane 0, from its issue) and per compute span (lane 1), ``{rank, lane,
    start_ms, width_ms, category}``, times from the step's earliest stamp over every rank."""
    stamps = [r["issue_ns"] for t in trace_per_rank for r in t["records"]]
    stamps += [s["start_ns"] for t in trace_per_rank for s in t["spans"]]
    if not stamps:
        return []
    t0, bars = min(stamps), []
    for rank, trace in enumerate(trace_per_rank):
        for r in trace["records"]:
            if r["op"] == "all_to_all":
                bars.append({"rank": rank, "lane": 0, "start_ms": (r["issue_ns"] - t0) / 1e6,
                             "width_ms": (r["end_ns"] - r["issue_ns"]) / 1e6,
                             "category": "a2a bwd" if r["phase"] == "backward" else "a2a fwd"})
        for s in trace["spans"]:
            kind = s["kind"]
            category = kind if kind in COLOURS else "dW experts"       # dW experts.<layer>
            bars.append({"rank": rank, "lane": 1, "start_ms": (s["start_ns"] - t0) / 1e6,
                         "width_ms": (s["end_ns"] - s["start_ns"]) / 1e6, "category": category})
    return bars


def plot(report: Dict[str, Any], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(g, name, v) for g in report["groups"] for name, v in g["variants"].items()]
    ranks = max((len(v["trace_per_rank"]) for _, _, v in panels), default=1)
    fig, axes = plt.subplots(max(len(panels), 1), 1, figsize=(14, 1.0 + (0.55 * ranks + 0.9) * max(len(panels), 1)),
                             squeeze=False)
    for ax, (g, name, v) in zip(axes[:, 0], panels):
        for bar in timeline_bars(v["trace_per_rank"]):
            y = (ranks - 1 - bar["rank"]) * 2.5 + (1 - bar["lane"])
            ax.broken_barh([(bar["start_ms"], max(bar["width_ms"], 1e-3))], (y + 0.1, 0.8),
                           facecolors=COLOURS[bar["category"]], edgecolor="none")
        ax.set_yticks([(ranks - 1 - r) * 2.5 + lane + 0.5 for r in range(ranks) for lane in (1, 0)])
        ax.set_yticklabels([f"rank {r} {lane}" for r in range(ranks) for lane in ("a2a", "compute")], fontsize=7)
        kept = v["kept_per_rank"]
        ax.set_title(f"{g['rate']}, {name}: timed round {v['kept_round']} (step {v['kept_step_ms']:.0f} ms, median "
                     f"{v['step_ms_median']:.0f} ms); overlap |a2a ∩ compute| / |a2a| per rank: "
                     f"{_figures(kept, 'overlap')}; exposed a2a {_figures(kept, 'exposed_ms', 0)} ms", fontsize=8)
        ax.set_xlabel("ms from the step's first stamp (all-to-alls from their issue)", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, list(COLOURS), loc="upper right", fontsize=8, ncol=len(COLOURS))
    fig.suptitle(f"Lancet one-step timeline: {report['meta']['title']}", fontsize=10, x=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(report: Dict[str, Any], out_dir: Path, stem: str) -> List[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    plot(report, paths[1])
    return paths


def run_timeline(plan: TimelinePlan, opts: RunOptions) -> Dict[str, Any]:
    """Run the timeline on the emulated cluster (or loopback, labelled) and write its outputs."""
    problems = timeline_plan_problems(plan)
    if problems:
        raise ValueError("invalid Lancet timeline plan: " + "; ".join(problems))
    records, plan, meta = run_jobs(plan, lambda p, cluster, progress_path: TimelineJob(
        plan=p, cluster=cluster, progress_path=progress_path), len(plan.rates), opts)
    report = summarize(records, plan, meta)
    report["files"] = [str(p) for p in write_outputs(report, opts.out_dir, opts.stem)]
    return report
