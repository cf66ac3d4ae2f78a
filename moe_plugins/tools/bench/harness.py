"""The parent side of ``moe-plugins bench``: check the plan, bring up the emulated cluster (or fall back to
loopback, labelled), run the ranks with a progress bar, always tear down, and write the report.

Modes:

- ``netns``: the emulated cluster is required; if it is unavailable the run stops with the reason;
- ``loopback``: no namespaces, no shaping; the rate axis becomes ``unshaped`` and the report says so;
- ``auto`` (default): ``netns`` when available, otherwise ``loopback`` with the reason printed and recorded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from moe_plugins.tools.bench.cluster import ClusterSpec, emulated_cluster, netns_unavailable_reason
from moe_plugins.tools.bench.launch import RankFailure, run_ranks, signals_raise
from moe_plugins.tools.bench.matrix import UNSHAPED, BenchPlan, plan_problems
from moe_plugins.tools.bench.rows import row_problems, rows_problems
from moe_plugins.tools.bench.report import summarize, write_outputs
from moe_plugins.core.timeline import write_chrome_trace
from moe_plugins.tools.bench.runner import RankJob

MODES = ("auto", "netns", "loopback")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    out_dir: Path
    mode: str = "auto"
    timeout_s: float = 1800.0
    note: str = ""                 # recorded in the report (e.g. "taken on a shared, busy machine")
    command: str = ""              # the command line, recorded in the report
    progress: bool = True
    stem: str = "bench"
    congestion_control: str = ClusterSpec.congestion_control   # TCP congestion control in the node namespaces
    tbf_burst: str = ClusterSpec.burst     # tbf bucket on every node link (tc units)
    timeline: Optional[Path] = None        # layer bench: write the plugin rows' engine ops here (Chrome trace)


@dataclass(frozen=True)
class Decision:
    use_netns: bool
    reason: Optional[str]          # why netns is not used (None when it is)


def choose_mode(mode: str, unavailable: Optional[str]) -> Decision:
    """Pure: which transport to use, given the requested mode and why netns is unavailable (or None)."""
    if mode not in MODES:
        raise ValueError(f"mode ({mode!r}) must be one of {', '.join(MODES)}")
    if mode == "loopback":
        return Decision(False, "loopback requested (--mode loopback)")
    if unavailable is None:
        return Decision(True, None)
    if mode == "netns":
        raise ValueError(f"mode 'netns' needs network namespaces, which are unavailable: {unavailable}")
    return Decision(False, unavailable)


def _versions() -> Dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {"python": platform.python_version()}
    for pkg in ("torch", "deepspeed", "megatron-core"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[3]     # the repository
        return subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _meta(plan: BenchPlan, opts: RunOptions, decision: Decision, load_before, load_after, wall_s) -> Dict[str, Any]:
    if decision.use_netns:
        transport = (f"emulated cluster: {plan.nodes} network namespaces x {plan.ranks_per_node} ranks, joined by "
                     f"a bridge; every node link tbf-shaped in both directions to the listed rate; TCP congestion "
                     f"control {opts.congestion_control} in every node; tbf burst {opts.tbf_burst}")
        title = f"{plan.nodes} emulated nodes x {plan.ranks_per_node} ranks"
    else:
        transport = (f"LOOPBACK ONLY, NOT an emulated cluster ({decision.reason}): all {plan.world} ranks on "
                     f"127.0.0.1, nothing shaped; 'inter-node' bytes are those that would cross nodes of "
                     f"{plan.ranks_per_node} ranks")
        title = f"LOOPBACK ONLY ({plan.world} ranks, unshaped)"
    lines = [f"transport: {transport}",
             f"timing: {plan.iters} timed rounds after {plan.warmup} warm-up rounds; rows interleaved, in a seeded random order per round",
             f"machine: {os.cpu_count()} CPUs; load average before {load_before}, after {load_after}; "
             f"wall {wall_s:.0f} s",
             f"versions: {', '.join(f'{k} {v}' for k, v in _versions().items())}; git {_git_commit()}",
             f"reproduce: `{opts.command}`" if opts.command else "reproduce: (called from Python)"]
    if opts.note:
        lines.append(f"note: {opts.note}")
    lines += [f"note: {n}" for n in plan.notes]
    return {"title": title, "header_lines": lines, "netns": decision.use_netns, "fallback_reason": decision.reason,
            "plan": dataclasses.asdict(plan), "versions": _versions(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_before": load_before, "load_after": load_after}


class _Progress:
    """Follows rank 0's progress file with a tqdm bar."""

    def __init__(self, path: Path, total: int, enabled: bool):
        from tqdm import tqdm
        self.path, self.seen = path, 0
        self.bar = tqdm(total=total, desc="bench", unit="group", disable=not enabled, file=sys.stderr)

    def poll(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        for line in lines[self.seen:]:
            event = json.loads(line)
            self.bar.set_postfix_str(f"{event['case']} @ {event['rate']}")
            self.bar.update(1)
        self.seen = len(lines)

    def close(self) -> None:
        self.poll()
        self.bar.close()


def run_bench(plan: BenchPlan, opts: RunOptions) -> Dict[str, Any]:
    """Run the plan and write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` into ``opts.out_dir``."""
    problems = plan_problems(plan, row_problems) + rows_problems(plan.rows)
    if problems:
        raise ValueError("invalid bench plan: " + "; ".join(problems))
    with tempfile.TemporaryDirectory(prefix="moe-bench-timeline-") as tmp:
        prefix = str(Path(tmp) / "timeline") if opts.timeline is not None else None
        records, plan, meta = run_jobs(plan, lambda p, cluster, progress_path: RankJob(
            plan=p, cluster=cluster, progress_path=progress_path, timeline_prefix=prefix),
            len(plan.cases) * len(plan.rates), opts)
        report = summarize(records, plan, meta)
        report["files"] = [str(p) for p in write_outputs(report, opts.out_dir, opts.stem)]
        if prefix is not None:
            per_rank = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(plan.world)]
            report["files"].append(str(write_chrome_trace(opts.timeline, per_rank)))
    return report


def run_jobs(plan, make_job: Callable[[Any, Any, str], Any], groups: int, opts: RunOptions
             ) -> Tuple[List[Dict[str, Any]], Any, Dict[str, Any]]:
    """Bring up the emulated cluster (or fall back to loopback, labelled), run ``make_job(plan, cluster,
    progress_path)`` on every rank, always tear down. ``plan``: a dataclass with ``nodes``,
    ``ranks_per_node``, ``world``, ``rates``, ``iters``, ``warmup`` and ``notes`` (a :class:`BenchPlan` or the
    step bench's plan); ``groups``: how many progress events the ranks emit. Returns rank 0's records, the plan
    as run (rates ``unshaped`` on loopback) and the report's meta."""
    decision = choose_mode(opts.mode, None if opts.mode == "loopback" else netns_unavailable_reason())
    if not decision.use_netns:
        print(f"moe-plugins bench: LOOPBACK ONLY ({decision.reason}); no link is shaped, so timings do not "
              f"represent a multi-node cluster", file=sys.stderr)
        plan = dataclasses.replace(plan, rates=(UNSHAPED,))
    load_before, t0 = tuple(round(x, 2) for x in os.getloadavg()), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp, signals_raise():
        work = Path(tmp)
        progress = _Progress(work / "progress.jsonl", groups, opts.progress)
        try:
            if decision.use_netns:
                spec = ClusterSpec(nodes=plan.nodes, congestion_control=opts.congestion_control, burst=opts.tbf_burst)
                with emulated_cluster(spec) as cluster:
                    _launch(plan, make_job(plan, cluster, str(work / "progress.jsonl")), work, opts, progress)
            else:
                _launch(plan, make_job(plan, None, str(work / "progress.jsonl")), work, opts, progress)
        finally:
            progress.close()
        records = json.loads((work / "result.json").read_text())
    load_after = tuple(round(x, 2) for x in os.getloadavg())
    return records, plan, _meta(plan, opts, decision, load_before, load_after, time.monotonic() - t0)


def _launch(plan, job, work: Path, opts: RunOptions, progress: _Progress) -> None:
    job_path = work / "job.pkl"
    job_path.write_bytes(pickle.dumps(job))
    try:
        run_ranks(world=plan.world, ranks_per_node=plan.ranks_per_node, cluster=job.cluster, job_path=job_path,
                  workdir=work, timeout_s=opts.timeout_s, on_poll=progress.poll)
    except RankFailure as exc:      # keep every rank's log: the work directory is about to be deleted
        logs = opts.out_dir / f"{opts.stem}-logs"
        logs.mkdir(parents=True, exist_ok=True)
        for log in work.glob("rank*.log"):
            shutil.copy(log, logs / log.name)
        raise RankFailure(f"{exc}\n(all rank logs copied to {logs})") from None
