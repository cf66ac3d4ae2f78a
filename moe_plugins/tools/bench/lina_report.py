"""The parent side of the training-step contention bench: run it (:func:`run_step_bench`), and write its
report: ``<stem>.json`` (everything but the timelines), ``<stem>.md`` (tables, ratios, targets, the micro-op
sweep), ``<stem>.png`` (step times and the backward all-to-all slowdown CDF), ``<stem>-timeline.png`` (one
``fifo`` and one lina step per rate, each op a bar per rank) and ``<stem>-timeline.json`` (the kept steps of
those rows and of ``sync`` and ``noreduce`` as a Chrome trace, for Perfetto)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from moe_plugins.core.timeline import chrome_trace
from moe_plugins.tools.bench.harness import RunOptions, run_jobs
from moe_plugins.tools.bench.lina_plan import (HOSTS, LINA, NO_PRIORITY, REFERENCE, StepPlan, dense_bytes,
                                               exchange_bytes, micro_op_bytes_of, parse_step_row, step_plan_problems)
from moe_plugins.tools.bench.lina_stats import headline, summarize_rate
from moe_plugins.tools.bench.report import fmt_paired, fmt_value, header

TRACE_KINDS = ("sync", NO_PRIORITY, LINA, REFERENCE)     # the rows whose kept step goes into the trace file
HOST_MODEL_LINES = {
    "deepspeed": "deepspeed rows: the same network, weights and tokens, its MoE layers DeepSpeed's own (deterministic "
                 "gate: no RTS, no second-expert sampling; swapped by the plugin), ZeRO 0; gradients averaged by "
                 "DeepSpeed, multiplied by DP to compare with sync's sums",
    "megatron": "megatron rows: the same shapes, weights and tokens in Megatron's [s, 1, M] layout, routed by "
                "Megatron's router (the same experts and weights; over capacity it drops by probability, not by "
                "position; its switch aux loss x 0.01 via its auto-scaler), so the closest Megatron network, not the "
                "same: megatron@lina's gradients are compared with megatron's, not sync's",
}


def model_lines(plan: StepPlan) -> List[str]:
    m = plan.model
    a2a = exchange_bytes(m)
    return [f"model: {m.label}: {m.blocks} MoE layers (baseline schedule, EP {plan.world} over every rank) "
            f"between {m.blocks + 1} dense pairs; dense parameters {dense_bytes(m) / 1e6:.2f} MB (fp32), "
            f"reduced over DP {plan.world}; each all-to-all moves a {a2a / 1e3:.0f} kB dispatch buffer per rank; "
            f"{2 * m.blocks} backward all-to-alls per step",
            "step: forward + backward + the row's reduction finished (no optimizer), slowest rank"] + [
        line for name, line in HOST_MODEL_LINES.items() if any(r.name == name for r in plan.rows)]


def summarize_step(records: List[Dict[str, Any]], plan: StepPlan, meta: Dict[str, Any]) -> Dict[str, Any]:
    meta = {**meta, "header_lines": list(meta["header_lines"]) + model_lines(plan)}
    return {"meta": meta, "groups": [summarize_rate(r, plan.ranks_per_node) for r in records]}


def run_step_bench(plan: StepPlan, opts: RunOptions) -> Dict[str, Any]:
    """Run the step bench and write its outputs into ``opts.out_dir`` (see the module docstring)."""
    from moe_plugins.tools.bench.lina_step import StepJob
    problems = step_plan_problems(plan)
    if problems:
        raise ValueError("invalid step bench plan: " + "; ".join(problems))
    records, plan, meta = run_jobs(plan, lambda p, cluster, progress_path: StepJob(
        plan=p, cluster=cluster, progress_path=progress_path), len(plan.rates), opts)
    report = summarize_step(records, plan, meta)
    report["files"] = [str(p) for p in write_step_outputs(report, opts.out_dir, opts.stem)]
    return report


def _range(r: Dict[str, Any], key: str, digits: int = 1) -> str:
    """``median (p10–p90)`` of the step time (``key`` "step") or of the backward all-to-all times ("a2a")."""
    med, lo, hi = (("median_ms", "p10_ms", "p90_ms") if key == "step" else
                   ("a2a_ms_median", "a2a_ms_p10", "a2a_ms_p90"))
    if r[med] is None:
        return "–"
    return f"{r[med]:.{digits}f} ({r[lo]:.{digits}f}–{r[hi]:.{digits}f})"


def _paired(r: Dict[str, Any]) -> str:
    return fmt_paired(r.get("paired_vs_fifo"))


def markdown_step(report: Dict[str, Any]) -> str:
    out = header(report, "moe-plugins bench, training step (Lina)")
    out += ["", "Columns: step = forward + backward + reduction of the slowest rank (median, p10–p90 over the "
            "timed rounds); t/t_noreduce = step median over noreduce's; speed-up vs fifo = fifo's step median "
            "over this row's; paired t/t_fifo = median of the per-round ratios with its bootstrap 90% interval; "
            "bwd a2a = time of each backward all-to-all from the last rank entering to the last rank leaving "
            "(median, p10–p90 over every op of every timed step); slowdown = an op's time over noreduce's median "
            "time of the same op (median, p90); NIC MB/node = bytes that left the busiest node's NIC in one step "
            "(median over steps); reduce ms = time the step's gradient all-reduces ran, slowest rank (median); "
            "model MB/node = the engine's inter-node bytes of the step; max|Δgrad| = "
            "reduced dense gradients against sync's after the first step (megatron@lina: against megatron's).", ""]
    hosts = {label: r["notes"] for g in report["groups"][:1] for label, r in g["rows"].items()
             if r["kind"] in HOSTS}
    if hosts:
        out += ["Host rows (the same network through the real host):", ""]
        out += [f"- `{label}`: " + "; ".join(notes) for label, notes in hosts.items()] + [""]
    head = ["row", "step ms (p10–p90)", "t/t_noreduce", "speed-up vs fifo", "paired t/t_fifo (90% CI)",
            "bwd a2a ms (p10–p90)", "slowdown median (p90)", "reduce ms", "NIC MB/node", "model MB/node", "max|Δgrad|"]
    for g in report["groups"]:
        out += [f"## {g['rate']}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for label, r in g["rows"].items():
            diff = r["grad_max_abs_diff_vs_sync"]
            out.append("| " + " | ".join([
                label, _range(r, "step"), fmt_value(r.get("step_vs_noreduce")), fmt_value(r.get("step_speedup_vs_fifo")),
                _paired(r), _range(r, "a2a"),
                f"{fmt_value(r['a2a_slowdown_median'])} ({fmt_value(r['a2a_slowdown_p90'])})", fmt_value(r["reduce_ms_median"], 1),
                fmt_value(r["nic_MB_per_node"], 3), fmt_value(r["model_MB_per_node"], 3),
                "–" if diff is None else f"{diff:.1e}"]) + " |")
        out += ["", "Targets (issue #23):", ""]
        out += [f"- {'met' if t['met'] else '**MISSED**'}: {t['name']}: {t['value']:.3f} (target {t['target']})"
                for t in g["targets"]] or ["- (no fifo and noreduce rows: nothing to judge)"]
        split = g.get("contention_split")
        if split is not None:
            out.append(f"- where fifo's contention landed: its backward all-to-alls ran {split['a2a_slowdown']:.2f}x "
                       f"noreduce's (median per op), its all-reduces {split['reduce_slowdown']:.2f}x as long as "
                       f"sync's, which moved the same bytes alone")
            out.append(f"- noise floor: sync's backward all-to-alls, with no reduction beside them, ran "
                       f"{fmt_value(split['noise_floor'])}x noreduce's (median per op)")
        wire = g["wire"]
        if wire["reference"] is None:
            out.append("- bytes on the wire: no NIC counter (loopback)")
        elif wire["flagged"]:
            out.append(f"- **bytes on the wire differ** by more than {wire['tolerance']:.0%} from "
                       f"{wire['reference']}'s: " + ", ".join(f"{k} {wire['ratios'][k]:.3f}x" for k in wire["flagged"]))
        else:
            out.append(f"- bytes on the wire: every reducing row within {wire['tolerance']:.0%} of "
                       f"{wire['reference']}'s (ratios {min(wire['ratios'].values()):.3f}–"
                       f"{max(wire['ratios'].values()):.3f})")
        out.append("")
    return "\n".join(out + sweep_lines(report)) + "\n"


def sweep_lines(report: Dict[str, Any]) -> List[str]:
    """The lina rows side by side by micro-op size, per rate."""
    entries = []
    for g in report["groups"]:
        for label, r in g["rows"].items():
            if r["kind"] == LINA:
                entries.append((g["rate"], micro_op_bytes_of(parse_step_row(label)), label, r))
    if len({size for _, size, _, _ in entries}) < 2:
        return []
    out = ["## Micro-op size sweep", "", "| rate | micro-op | step ms (p10–p90) | speed-up vs fifo | "
           "bwd a2a slowdown median (p90) | NIC MB/node |", "|---|---|---|---|---|---|"]
    for rate, size, label, r in sorted(entries, key=lambda e: (e[0], e[1])):
        out.append(f"| {rate} | {size / 1024:g} KiB ({label}) | {_range(r, 'step')} | "
                   f"{fmt_value(r.get('step_speedup_vs_fifo'))} | {fmt_value(r['a2a_slowdown_median'])} "
                   f"({fmt_value(r['a2a_slowdown_p90'])}) | {fmt_value(r['nic_MB_per_node'], 3)} |")
    return out + [""]


def trace_file(report: Dict[str, Any], traces: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One Chrome trace of the kept steps of the ``sync``, ``fifo``, headline lina and ``noreduce`` rows of
    every rate: one process per (rate, row, rank), each step starting at 0."""
    events: List[Dict[str, Any]] = []
    block = 0
    for g, group_traces in zip(report["groups"], traces):
        kinds = {label: r["kind"] for label, r in g["rows"].items()}
        for kind in TRACE_KINDS:
            label = headline(kinds, kind)
            if label is None:
                continue
            per_rank = group_traces[label]["per_rank"]
            for e in chrome_trace(per_rank)["traceEvents"]:
                e = {**e, "pid": block * len(per_rank) + e["pid"]}
                if e["name"] == "process_name":
                    e["args"] = {"name": f"{g['rate']} {label} {e['args']['name']}"}
                events.append(e)
            block += 1
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_step_outputs(report: Dict[str, Any], out_dir: Path, stem: str = "lina-step") -> List[Path]:
    """Write the files named in the module docstring; the timelines leave ``report`` for their own files."""
    from moe_plugins.tools.bench.lina_plots import plot_step_summary, plot_timelines
    out_dir.mkdir(parents=True, exist_ok=True)
    traces = [g.pop("traces") for g in report["groups"]]
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png",
             out_dir / f"{stem}-timeline.png", out_dir / f"{stem}-timeline.json"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(markdown_step(report))
    plot_step_summary(report, paths[2])
    plot_timelines(report, traces, paths[3])
    paths[4].write_text(json.dumps(trace_file(report, traces)))
    return paths
