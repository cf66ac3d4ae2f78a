"""Summary, targets, Markdown and plot of Lancet's model-level bench (rank side: :mod:`.lancet_model_rank`).

Per case and row, over the timed rounds (warm-up rounds left out):

- ``step_ms``: the median over rounds of the slowest rank's step (forward + backward + optimizer step);
  ``step_p25_ms`` / ``step_p75_ms`` beside it;
- ``exposed_ms``: the median over rounds of the ranks' mean time blocked in exchanges
  (:mod:`.lancet_model_meter`); ``a2a_ms``: the same for the union of the all_to_all calls' intervals (any
  thread); ``hidden``: 1 - exposed / a2a (0 when nothing flew off the main thread), clipped to [0, 1];
- ``a2a_bytes``: all ranks' all-to-all bytes to other nodes per step (the meter's count from every call's input
  and split sizes); ``ledger_bytes``: the same from the plugin's ledger (0 for the stock row); ``nic_bytes``: what
  the nodes' NICs sent per step (headers, acks and DeepSpeed's gradient reductions included; None on loopback);
  ``link_use``: the busiest node's NIC bytes of a step at the case's rate, as a share of that step's time (the
  median over rounds; above 1 the tbf bucket or timing noise; None on loopback);
- ``loss_final``: the ranks' mean loss at the last round (every row trained the same batches from the same
  weights); ``loss_max_abs_diff``: the largest |loss - the deepspeed row's loss| over every rank and round;
- ratios to the best PipeMoE degree (the fastest ``baseline@r=N`` row, N >= 2): step, exposed, bytes; and the
  step ratio to the ``deepspeed`` row.

The case's bound as measured: ``link`` when the ``deepspeed`` row is blocked in exchanges for at least half its
step, else ``compute``; the target applied is the case's declared one, and the Markdown says when they differ.

Targets (issue #26), judged for every ``lancet`` row: exposed <= 0.5x the best PipeMoE degree's; step <= 0.87x
(``link``-bound case) or <= 1.05x (``compute``-bound); bytes: equal for the padded rows, and for batch
partitions reported as what they are (the ragged layout sends only kept routes, so fewer bytes).
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence

from moe_plugins.tools.bench.lancet_model import EXPOSED_TARGET, REFERENCE, STEP_TARGET, ModelCase, parse_row
from moe_plugins.tools.bench.matrix import UNSHAPED, parse_rate

MS = 1e6
MEASURED_LINK_SHARE = 0.5      # a case is link-bound as measured when stock DeepSpeed is blocked >= half its step
TABLE = ("row", "step ms (p25-p75)", "x best PipeMoE", "x deepspeed", "exposed a2a ms", "x best PipeMoE ",
         "a2a ms", "hidden", "a2a MB/step", "NIC MB/step", "link use", "loss after N", "max |dloss|", "notes")


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]) if ordered else float("nan")


def row_summary(label: str, per_rank: List[List[Dict[str, Any]]], reference: Optional[List[List[Dict[str, Any]]]],
                ranks_per_node: int, rate_bps: Optional[int] = None) -> Dict[str, Any]:
    """One row's figures from every rank's steps (``per_rank[rank][round]``; see the module docstring)."""
    rounds = len(per_rank[0])
    timed = [i for i in range(rounds) if per_rank[0][i]["timed"]]
    step = [max(r[i]["step_s"] for r in per_rank) * 1e3 for i in timed]

    def mean_ranks(key: str, i: int) -> float:
        return sum(r[i][key] for r in per_rank) / len(per_rank)

    def sum_ranks(key: str, i: int, ranks: Optional[Sequence[int]] = None) -> Optional[int]:
        values = [per_rank[r][i][key] for r in (ranks if ranks is not None else range(len(per_rank)))]
        return None if any(v is None for v in values) else int(sum(values))
    exposed = _median([mean_ranks("blocked_ns", i) / MS for i in timed])
    a2a = _median([mean_ranks("union_ns", i) / MS for i in timed])
    heads = range(0, len(per_rank), ranks_per_node)          # one rank per node reads the node's NIC
    nics = [sum_ranks("nic_tx_bytes", i, heads) for i in timed]
    busiest = [None if n is None else max(per_rank[r][i]["nic_tx_bytes"] for r in heads) for i, n in zip(timed, nics)]
    link_use = None if rate_bps is None or any(b is None for b in busiest) else \
        _median([8 * b / rate_bps / (s / 1e3) for b, s in zip(busiest, step)])
    shares = [r[i].get("hot_share") for r in per_rank for i in timed]
    peaks = [[r[i].get("copy_peak_bytes") for r in per_rank] for i in timed]
    diff = None
    if reference is not None:
        diff = max(abs(mine["loss"] - ref["loss"]) for r, rr in zip(per_rank, reference) for mine, ref in zip(r, rr))
    return {"row": label, "timed_rounds": len(timed), "step_ms": _median(step), "step_p25_ms": _quantile(step, 0.25),
            "step_p75_ms": _quantile(step, 0.75), "step_ms_per_round": step,
            "exposed_ms": exposed, "calls_blocked_ms": _median([mean_ranks("blocked_calls_ns", i) / MS for i in timed]),
            "waits_blocked_ms": _median([mean_ranks("blocked_waits_ns", i) / MS for i in timed]),
            "other_wait_ms": _median([mean_ranks("other_wait_ns", i) / MS for i in timed]),
            "a2a_ms": a2a, "hidden": min(1.0, max(0.0, 1.0 - exposed / a2a)) if a2a > 0 else 0.0,
            "a2a_calls": _median([mean_ranks("calls", i) for i in timed]),
            "a2a_bytes": _median([sum_ranks("inter_node_bytes", i) for i in timed]),
            "ledger_bytes": _median([sum_ranks("ledger_inter_node_bytes", i) for i in timed]),
            "nic_bytes": None if any(n is None for n in nics) else _median(nics), "link_use": link_use,
            "loss_per_round": [sum(r[i]["loss"] for r in per_rank) / len(per_rank) for i in range(rounds)],
            "loss_final": sum(r[-1]["loss"] for r in per_rank) / len(per_rank), "loss_max_abs_diff": diff,
            "hot_share": None if not shares or None in shares else sum(shares) / len(shares),
            "copy_peak_bytes": None if any(None in p for p in peaks) else _median([max(p) for p in peaks])}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def judge(row: Dict[str, Any], ref: Dict[str, Any], bound: str) -> Dict[str, Any]:
    """The issue's targets for one lancet row against the best PipeMoE degree's figures (pure)."""
    padded = parse_row(row["row"]).padded
    step, exposed = _ratio(row["step_ms"], ref["step_ms"]), _ratio(row["exposed_ms"], ref["exposed_ms"])
    bytes_ratio = _ratio(row["a2a_bytes"], ref["a2a_bytes"])
    return {"exposed_ratio": exposed, "exposed_target": EXPOSED_TARGET,
            "exposed_met": exposed is not None and exposed <= EXPOSED_TARGET,
            "step_ratio": step, "step_target": STEP_TARGET[bound],
            "step_met": step is not None and step <= STEP_TARGET[bound],
            "bytes_ratio": bytes_ratio,
            "bytes": ("equal" if row["a2a_bytes"] == ref["a2a_bytes"] else "DIFFERENT") if padded else
                     f"ragged: {bytes_ratio:.2f}x (only kept routes are sent)" if bytes_ratio is not None else "?"}


def summarize_case(raw: Dict[str, Any]) -> Dict[str, Any]:
    """One case's group: the rows' figures, the reference, the ratios and the targets (pure)."""
    case, rpn = ModelCase(**raw["case"]), raw["ranks_per_node"]
    per_row = {label: [r[label] for r in raw["steps_per_rank"]] for label in raw["rows"]}
    ref_steps = per_row.get(REFERENCE)
    rate = None if case.rate == UNSHAPED else parse_rate(case.rate)
    rows = {label: row_summary(label, steps, ref_steps, rpn, rate) for label, steps in per_row.items()}
    for label, row in rows.items():
        row["facts"] = raw["facts_per_rank"][0][label]
        row["facts_agree_across_ranks"] = all(f[label] == row["facts"] for f in raw["facts_per_rank"])
    candidates = [r for r in raw["rows"] if parse_row(r).pipemoe_candidate]
    best = min(candidates, key=lambda r: rows[r]["step_ms"])
    any_degree = min([r for r in raw["rows"] if parse_row(r).kind == "baseline"], key=lambda r: rows[r]["step_ms"])
    stock = rows.get(REFERENCE)
    for label, row in rows.items():
        row["step_vs_best_pipemoe"] = _ratio(row["step_ms"], rows[best]["step_ms"])
        row["exposed_vs_best_pipemoe"] = _ratio(row["exposed_ms"], rows[best]["exposed_ms"])
        row["bytes_vs_best_pipemoe"] = _ratio(row["a2a_bytes"], rows[best]["a2a_bytes"])
        row["step_vs_deepspeed"] = _ratio(row["step_ms"], stock["step_ms"] if stock else None)
        if parse_row(label).kind == "lancet":
            row["targets"] = judge(row, rows[best], case.bound)
    losses = [r["loss_max_abs_diff"] for r in rows.values() if r["loss_max_abs_diff"] is not None]
    share = _ratio(stock["exposed_ms"], stock["step_ms"]) if stock else None
    return {"case": raw["case"], "describe": case.describe(), "bound": case.bound, "rate": case.rate,
            "world": raw["world"], "ranks_per_node": rpn, "warmup": raw["warmup"], "iters": raw["iters"],
            "best_pipemoe": best, "best_baseline_any_degree": any_degree,
            "stock_blocked_share": share,
            "measured_bound": None if share is None else "link" if share >= MEASURED_LINK_SHARE else "compute",
            "loss_max_abs_diff": max(losses) if losses else None, "profile": raw.get("profile"),
            "setup_s": raw.get("setup_s"), "rows": rows}


def _f(v: Optional[float], spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _mb(v: Optional[float]) -> str:
    return "-" if v is None else f"{v / 1e6:.2f}"


def _notes(row: Dict[str, Any]) -> str:
    facts, out = row["facts"], []
    if facts["chosen_partitions"]:
        out.append(f"partitions run {facts['chosen_partitions']}")
    if facts.get("tuned_partitions"):
        out.append(f"tune chose {facts['tuned_partitions']}")
    if facts["dw_behind_exchange_calls"]:
        out.append(f"dW behind {facts['dw_behind_exchange_calls']} exchanges")
    out += [n.replace("|", "/") for n in facts.get("schedule_notes", [])]
    if facts.get("regathers"):
        out.append("re-gathers " + ", ".join(f"{why} {n}" for why, n in sorted(facts["regathers"].items())))
    if row.get("copy_peak_bytes") is not None:
        out.append(f"expert copies alive at most {row['copy_peak_bytes'] / 1e3:.1f} kB (busiest rank, median step)")
    if row.get("hot_share") is not None:
        out.append(f"expert 0 takes {100 * row['hot_share']:.0f}% of the routes")
    if row.get("other_wait_ms"):
        out.append(f"other waits {row['other_wait_ms']:.1f} ms")
    return "; ".join(out)


def _bound_words(group: Dict[str, Any]) -> str:
    measured, declared = group.get("measured_bound"), group["bound"]
    if measured is None:
        return f"the {declared}-bound target applies (declared; no stock row to measure it)"
    if measured == declared:
        return (f"{measured}-bound as measured (link when stock DeepSpeed is blocked in exchanges for >= "
                f"{MEASURED_LINK_SHARE:.0%} of its step), as declared")
    return (f"{measured}-bound as measured, NOT the declared {declared}-bound (the {declared}-bound target is "
            "applied anyway)")


def case_markdown(group: Dict[str, Any]) -> List[str]:
    lines = [f"### {group['case']['name']} @ {group['rate']}", "", group["describe"], "",
             f"Best fixed PipeMoE degree (reference): `{group['best_pipemoe']}`; fastest plugin baseline at any "
             f"degree: `{group['best_baseline_any_degree']}`. Stock DeepSpeed was blocked in exchanges "
             f"{_f(100 * group['stock_blocked_share'] if group['stock_blocked_share'] is not None else None)}% of "
             f"its step: {_bound_words(group)}. Largest |loss - deepspeed's| over every rank and round: "
             f"{_f(group['loss_max_abs_diff'], '.2e')}.", "",
             "| " + " | ".join(TABLE) + " |", "|" + "---|" * len(TABLE)]
    if group.get("profile"):
        p = group["profile"]
        lines[5:5] = ["", f"`partitions=auto` priced from the cost profile measured at the start of this case's run "
                          f"(all-to-all on EP at {p['sizes_bytes']} bytes, the experts' GEMM {p['gemm_shape']} at "
                          f"rows {p['gemm_rows']}; {p['seconds']} s); the partition counts it ran are in the notes."]
    for row in group["rows"].values():
        lines.append("| " + " | ".join([
            f"`{row['row']}`", f"{row['step_ms']:.1f} ({row['step_p25_ms']:.0f}-{row['step_p75_ms']:.0f})",
            _f(row["step_vs_best_pipemoe"], ".2f"), _f(row["step_vs_deepspeed"], ".2f"), _f(row["exposed_ms"]),
            _f(row["exposed_vs_best_pipemoe"], ".2f"), _f(row["a2a_ms"]), f"{100 * row['hidden']:.0f}%",
            _mb(row["a2a_bytes"]), _mb(row["nic_bytes"]),
            "-" if row["link_use"] is None else f"{100 * row['link_use']:.0f}%", f"{row['loss_final']:.6f}",
            _f(row["loss_max_abs_diff"], ".1e"), _notes(row)]) + " |")
    lines += ["", "Targets (against the best PipeMoE degree):", ""]
    for row in group["rows"].values():
        t = row.get("targets")
        if t:
            lines.append(f"- `{row['row']}`: exposed {_f(t['exposed_ratio'], '.2f')}x (target <= "
                         f"{t['exposed_target']}: {'met' if t['exposed_met'] else 'MISSED'}); step "
                         f"{_f(t['step_ratio'], '.2f')}x (target <= {t['step_target']}: "
                         f"{'met' if t['step_met'] else 'MISSED'}); bytes {t['bytes']}")
    return lines + [""]


def markdown(report: Dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"# {meta['title']}", ""] + [f"- {line}" for line in meta["header_lines"]] + [""]
    for group in report["groups"]:
        lines += case_markdown(group)
    return "\n".join(lines) + "\n"


def plot(report: Dict[str, Any], path) -> None:
    """One panel per case: each row's median step (bar) with its exposed all-to-all time (dark part)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = report["groups"]
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.6), squeeze=False)
    for ax, group in zip(axes[0], groups):
        rows = list(group["rows"].values())
        x = range(len(rows))
        ax.bar(x, [r["step_ms"] for r in rows], color="lightsteelblue", label="step (median, slowest rank)")
        ax.bar(x, [r["exposed_ms"] for r in rows], color="firebrick", label="exposed all-to-all (blocked)")
        best = group["rows"][group["best_pipemoe"]]["step_ms"]
        ax.axhline(best, color="black", lw=0.8, ls="--", label=f"best PipeMoE ({group['best_pipemoe']})")
        ax.set_xticks(list(x))
        ax.set_xticklabels([r["row"] for r in rows], rotation=40, ha="right", fontsize=8)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{group['case']['name']} @ {group['rate']} ({group['bound']}-bound target)", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(report["meta"]["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_problems(report: Dict[str, Any]) -> List[str]:
    """What a written report must hold (empty: fine)."""
    problems = [f"meta lacks {k!r}" for k in ("title", "header_lines") if k not in report.get("meta", {})]
    for group in report.get("groups", []):
        for label, row in group["rows"].items():
            problems += [f"{group['case']['name']}/{label}: {k} missing" for k in
                         ("step_ms", "exposed_ms", "a2a_bytes", "loss_final", "step_vs_best_pipemoe") if k not in row]
    if not report.get("groups"):
        problems.append("no groups")
    return problems
