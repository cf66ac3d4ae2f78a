"""Pictures of the training-step contention bench (matplotlib, Agg):

- :func:`plot_step_summary`: per rate, the step time of every row (median, p10–p90) and the CDF of the
  backward all-to-all slowdowns (each op's time over ``noreduce``'s median time of the same op);
- :func:`plot_timelines`: one ``fifo`` step and one lina step per rate (the rounds nearest each row's median),
  every op a bar on its rank: the urgent lane (the MoE exchanges, and ``sync``'s all-reduce) above the
  background lane (gradient all-reduces), backward all-to-alls in red.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence

from moe_plugins.tools.bench.lina_plan import LINA, NO_PRIORITY, REFERENCE
from moe_plugins.tools.bench.lina_stats import CONTENTION_MIN, LINA_A2A_MAX, cdf, headline

MAIN_ROWS = ("sync", NO_PRIORITY, LINA, REFERENCE)
SLOWDOWN_AXIS_MAX = 10.0    # the CDF's x axis ends here; ops beyond it are counted on the plot
COLOURS = {"bwd a2a": "tab:red", "fwd a2a": "tab:orange", "urgent other": "tab:gray",
           "background": "tab:blue"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _category(r: Dict[str, Any]) -> str:
    if r.get("priority") == "background":
        return "background"
    if r["op"] == "all_to_all":
        return "bwd a2a" if r["phase"] == "backward" else "fwd a2a"
    return "urgent other"


def timeline_bars(per_rank: Sequence[Sequence[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Pure: one bar per timed op, ``{rank, lane (0 urgent, 1 background), start_ms, width_ms, category}``,
    times from the step's earliest issue over every rank."""
    timed = [r for records in per_rank for r in records if r.get("start_ns")]
    if not timed:
        return []
    t0 = min(r.get("issue_ns") or r["start_ns"] for r in timed)
    return [{"rank": rank, "lane": int(r.get("priority") == "background"), "start_ms": (r["start_ns"] - t0) / 1e6,
             "width_ms": max(r["end_ns"] - r["start_ns"], 0) / 1e6, "category": _category(r)}
            for rank, records in enumerate(per_rank) for r in records if r.get("start_ns")]


def plot_step_summary(report: Dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    groups = report["groups"]
    fig, axes = plt.subplots(2, len(groups), figsize=(1 + 6 * len(groups), 8), squeeze=False)
    for c, g in enumerate(groups):
        labels = list(g["rows"])
        ax = axes[0][c]
        med = [g["rows"][k]["median_ms"] for k in labels]
        err = [[m - g["rows"][k]["p10_ms"] for k, m in zip(labels, med)],
               [g["rows"][k]["p90_ms"] - m for k, m in zip(labels, med)]]
        ax.bar(range(len(labels)), med, yerr=err, capsize=3,
               color=["tab:blue" if g["rows"][k]["kind"] == LINA else "tab:gray" for k in labels])
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("step ms (median, p10–p90), slowest rank")
        ax.set_title(f"{g['rate']}: training step", fontsize=10)
        ax = axes[1][c]
        kinds = {k: r["kind"] for k, r in g["rows"].items()}
        main = {headline(kinds, kind) for kind in MAIN_ROWS}
        values = [v for r in g["rows"].values() for v in r["a2a_slowdowns"]]
        for label, r in g["rows"].items():
            if not r["a2a_slowdowns"]:
                continue
            xs, ys = cdf(r["a2a_slowdowns"])
            strong = label in main
            ax.step(xs, ys, where="post", label=label, linewidth=2 if strong else 0.8, alpha=1 if strong else 0.6,
                    linestyle="-" if strong else "--")
        for x, text in ((CONTENTION_MIN, "contention target"), (LINA_A2A_MAX, "lina target")):
            ax.axvline(x, color="black", linestyle=":", linewidth=1)
            ax.text(x, 0.02, text, rotation=90, fontsize=7, va="bottom")
        if values:
            ax.set_xscale("log")
            ax.set_xlim(min(values) / 1.1, min(max(values) * 1.1, SLOWDOWN_AXIS_MAX))
            beyond = sum(v > SLOWDOWN_AXIS_MAX for v in values)
            if beyond:
                ax.text(0.98, 0.5, f"{beyond} op(s) beyond {SLOWDOWN_AXIS_MAX:g}x, off the axis", ha="right",
                        transform=ax.transAxes, fontsize=7)
        ax.set_xlabel("backward all-to-all time / noreduce's median for the same op (log)")
        ax.set_ylabel("CDF over ops")
        ax.legend(fontsize=7)
    fig.suptitle(report["meta"]["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timelines(report: Dict[str, Any], traces: List[Dict[str, Any]], path: Path) -> Path:
    """``traces[i]`` is group i's ``{label: {"round", "per_rank"}}`` (kept out of the JSON report)."""
    plt = _pyplot()
    panels = []
    for g, group_traces in zip(report["groups"], traces):
        kinds = {label: r["kind"] for label, r in g["rows"].items()}
        for kind in (NO_PRIORITY, LINA):
            label = headline(kinds, kind)
            if label is not None:
                panels.append((g, label, group_traces[label]))
    fig, axes = plt.subplots(max(len(panels), 1), 1, figsize=(13, 1.2 + 2.2 * max(len(panels), 1)), squeeze=False)
    for ax, (g, label, trace) in zip(axes[:, 0], panels):
        bars = timeline_bars(trace["per_rank"])
        ranks = len(trace["per_rank"])
        for bar in bars:
            y = (ranks - 1 - bar["rank"]) * 3 + (1 - bar["lane"])
            ax.broken_barh([(bar["start_ms"], bar["width_ms"])], (y + 0.1, 0.8),
                           facecolors=COLOURS[bar["category"]], edgecolor="white", linewidth=0.3)
        ax.set_yticks([(ranks - 1 - r) * 3 + lane + 0.5 for r in range(ranks) for lane in (1, 0)])
        ax.set_yticklabels([f"rank {r} {name}" for r in range(ranks) for name in ("urgent", "background")],
                           fontsize=7)
        step = g["rows"][label]["times_s"][trace["round"]] * 1e3
        ax.set_title(f"{g['rate']}, {label}: timed round {trace['round']} (step {step:.0f} ms, "
                     f"median {g['rows'][label]['median_ms']:.0f} ms)", fontsize=9)
        ax.set_xlabel("ms from the step's first issue")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, list(COLOURS), loc="upper right", fontsize=8, ncol=len(COLOURS))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
