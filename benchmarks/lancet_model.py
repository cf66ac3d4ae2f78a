"""Lancet's model-level bench (issue #26): the recipes' GPT-2-MoE trained through DeepSpeed on the emulated cluster,
stock DeepSpeed, the plugin's baseline, fixed PipeMoE degrees and Lancet's rows side by side in one run.

    python benchmarks/lancet_model.py --layout 2x2 --out benchmarks/results               # lancet-model-2x2.*
    python benchmarks/lancet_model.py --layout 2x1 --out benchmarks/results               # lancet-model-2x1.*
    python benchmarks/lancet_model.py --layout 2x1 --cases tiny --warmup 1 --iters 2 --out /tmp/lm   # smoke

Per case (``--cases``: presets ``link``, ``compute``, ``tiny`` of moe_plugins/tools/bench/lancet_model.py, with
``preset:key=value,...`` overrides, e.g. ``link:rate=200mbit,hidden=64``): the link of every node is shaped to
the case's rate (tbf, both directions), then N nodes x R ranks (``--layout NxR``) run every row
(moe_plugins/tools/bench/lancet_model_rank.py): one DeepSpeed engine per row over the same weights (EP = world,
ZeRO ``--zero``, fp32), ``--warmup`` untimed rounds then ``--iters`` timed ones, round i training every row on
batch i, rows in a seeded random order per round. A step is forward + backward + optimizer step.

Per row: the median step (slowest rank), the exposed all-to-all time (the main thread's time blocked in
exchanges; moe_plugins/tools/bench/lancet_model_meter.py says what that does and does not count), the all-to-all
bytes to other nodes and the NICs' bytes per step, the loss after the last round and its largest difference from
stock DeepSpeed's, and the ratios to the best fixed PipeMoE degree (the fastest ``baseline@r=N``, N >= 2).
Writes ``<stem>.json`` (every rank's every step, and the summary), ``<stem>.md`` and ``<stem>.png`` into
``--out``. Needs root for the emulated cluster (else ``--mode loopback``, labelled).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from moe_plugins.tools.bench.lancet_model import DEFAULT_ROWS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank-config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layout", default="2x2", help="NxR: N emulated nodes x R ranks per node (default 2x2)")
    p.add_argument("--cases", nargs="+", default=["link", "compute"], metavar="CASE",
                   help="presets link, compute, tiny; overrides as preset:key=value,...")
    p.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), metavar="ROW")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15, help="timed rounds")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2), help="ZeRO stage (0: Hecate's reshard rows)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--stem", default=None, help="default lancet-model-<layout>")
    p.add_argument("--timeout-s", type=float, default=900.0, help="limit per case (one launch of the ranks)")
    p.add_argument("--from-json", type=Path, default=None,
                   help="no run: re-summarize a stored <stem>.json's raw results into --out")
    return p.parse_args(argv)


def arg_problems(args: argparse.Namespace) -> List[str]:
    from moe_plugins.tools.bench.lancet_model import case_problems, parse_case, parse_layout, parse_row, rows_problems
    problems = [f"{flag} ({v}) must be an integer >= {low}" for flag, v, low in
                (("--warmup", args.warmup, 1), ("--iters", args.iters, 1)) if v < low]
    try:
        nodes, per_node = parse_layout(args.layout)
    except ValueError as exc:
        return problems + [f"--layout: {exc}"]
    problems += rows_problems(list(args.rows))
    rows = [parse_row(r) for r in args.rows] if not rows_problems(list(args.rows)) else []
    for text in args.cases:
        try:
            problems += case_problems(parse_case(text), nodes * per_node, rows)
        except ValueError as exc:
            problems.append(f"--cases: {exc}")
    return problems


def _follow(path: Path, total: int, stop: threading.Event, label: str) -> None:
    """A progress bar of rank 0's rounds (one line per round in ``path``)."""
    from tqdm import tqdm
    bar, seen = tqdm(total=total, desc=label, unit="round", file=sys.stderr), 0
    while not stop.wait(0.5):
        n = len(path.read_text().splitlines()) if path.exists() else 0
        bar.update(n - seen)
        seen = n
    bar.close()


def _meta(args, transport: str, wall: float, load: List[Any], nodes: int, per_node: int) -> Dict[str, Any]:
    from importlib.metadata import version
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                         text=True).stdout.strip() or "unknown"
    lines = [f"transport: {transport}",
             f"model: the recipes' GPT-2-MoE (recipes/models.py build_gpt2_moe) with DeepSpeed's MoE, EP = world = "
             f"{nodes * per_node}, top-k gates without RTS or second-expert sampling, dropout 0, use_cache off; "
             f"deepspeed.initialize, ZeRO {args.zero}, fp32, Adam lr {args.lr:g} (torch's); 1 thread per rank",
             f"timing: {args.iters} timed rounds after {args.warmup} warm-up rounds; round i trains every row on batch "
             "i (the same token ids), rows in a seeded random order per round; step = engine(ids) + 0.01 aux, "
             "engine.backward, engine.step, from a barrier, slowest rank",
             "exposed all-to-all: the main thread's time blocked in exchanges (inline all_to_all_single calls and "
             "Handle.wait on the plugin's exchange ops and PipeMoE's exchange stages), mean over ranks; compute that "
             "runs meanwhile (Lancet's dW, the partitions' attention and dense blocks) is not counted; waiting for a "
             "slower peer is",
             "a2a MB/step: all ranks' all-to-all bytes to other nodes (counted per call; the plugin ledger's agree); "
             "NIC MB/step: what the node NICs sent (DeepSpeed's gradient reduction and ZeRO's gathers included); link "
             "use: the busiest node's NIC bytes at the case's rate over the step time",
             f"machine: {os.cpu_count()} CPUs; load average before {load[0]}, after {load[1]}; wall {wall:.0f} s",
             f"versions: python {sys.version.split()[0]}, torch {version('torch')}, deepspeed "
             f"{version('deepspeed')}, transformers {version('transformers')}; git {git}",
             "reproduce: `python benchmarks/lancet_model.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]) + "`"]
    return {"title": f"Lancet model-level bench, {nodes} emulated nodes x {per_node} ranks" if "LOOPBACK" not in
            transport else f"Lancet model-level bench, LOOPBACK ONLY ({nodes * per_node} ranks)",
            "header_lines": lines, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "plan": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "rank_config"}}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    from moe_plugins.tools.bench import lancet_model_report as rep
    from moe_plugins.tools.bench.cluster import ClusterSpec, emulated_cluster, netns_unavailable_reason, set_rate
    from moe_plugins.tools.bench.lancet_model import parse_case, parse_layout
    from moe_plugins.tools.bench.launch import run_script_ranks
    nodes, per_node = parse_layout(args.layout)
    reason = "loopback requested (--mode loopback)" if args.mode == "loopback" else netns_unavailable_reason()
    if args.mode == "netns" and reason:
        raise SystemExit(f"lancet_model: the emulated cluster is unavailable: {reason}")
    load0, t0 = tuple(round(x, 2) for x in os.getloadavg()), time.monotonic()
    raws: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lancet-model-") as tmp:
        work = Path(tmp)
        base = {"world": nodes * per_node, "ranks_per_node": per_node, "rows": list(args.rows),
                "warmup": args.warmup, "iters": args.iters, "zero": args.zero, "lr": args.lr, "seed": args.seed,
                "timeout_s": args.timeout_s, "collective_timeout_s": min(300.0, args.timeout_s),
                "result": str(work / "result.json")}

        def one(cluster, rate: Optional[str], case) -> None:
            if cluster is not None:
                set_rate(cluster, rate)
            profile_dir = work / f"profiles-{len(raws)}"
            profile_dir.mkdir()
            cfg = {**base, "case": dataclasses.asdict(case), "profile_dir": str(profile_dir),
                   "ifname": cluster.ifname if cluster is not None else None,
                   "progress": str(work / f"progress-{len(raws)}.jsonl")}
            Path(cfg["result"]).unlink(missing_ok=True)      # no result of an earlier case can stand in
            started, stop = time.monotonic(), threading.Event()
            follower = threading.Thread(target=_follow, args=(Path(cfg["progress"]), args.warmup + args.iters, stop,
                                                              f"{case.name} @ {case.rate}"), daemon=True)
            follower.start()
            try:
                raws.append(run_script_ranks(__file__, cfg, cluster, work))
            finally:
                stop.set()
                follower.join()
            group = rep.summarize_case(raws[-1])
            print(f"lancet_model: case {case.name} @ {case.rate} done in {time.monotonic() - started:.0f} s",
                  flush=True)
            print("\n".join(rep.case_markdown(group)), flush=True)
        cases = [parse_case(c) for c in args.cases]
        if reason is None:
            transport = (f"emulated cluster: {nodes} network namespaces x {per_node} ranks joined by a bridge, every "
                         "node link tbf-shaped in both directions to the case's rate (TCP reno, tbf burst 128kb)")
            with emulated_cluster(ClusterSpec(nodes=nodes)) as cluster:
                for case in cases:
                    one(cluster, case.rate, case)
        else:
            transport = f"LOOPBACK ONLY, NOT an emulated cluster ({reason}): every rank on 127.0.0.1, unshaped"
            for case in cases:
                one(None, None, dataclasses.replace(case, rate="unshaped"))
    load1 = tuple(round(x, 2) for x in os.getloadavg())
    meta = _meta(args, transport, time.monotonic() - t0, [load0, load1], nodes, per_node)
    return write(args, {"meta": meta, "raw": raws})


def write(args: argparse.Namespace, stored: Dict[str, Any]) -> Dict[str, Any]:
    from moe_plugins.tools.bench import lancet_model_report as rep
    from moe_plugins.tools.bench.outputs import write_report
    report = {"meta": stored["meta"], "groups": [rep.summarize_case(raw) for raw in stored["raw"]],
              "raw": stored["raw"]}
    return write_report(report, args.out, args.stem or f"lancet-model-{args.layout}", problems=rep.report_problems,
                        markdown=rep.markdown, plot=rep.plot)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.rank_config:
        from moe_plugins.tools.bench.lancet_model_rank import rank_main
        from moe_plugins.tools.bench.outputs import run_rank_config
        return run_rank_config(args.rank_config, rank_main)
    if args.from_json:
        stored = json.loads(args.from_json.read_text())
        write(args, {"meta": stored["meta"], "raw": stored["raw"]})
        return 0
    problems = arg_problems(args)
    if problems:
        print("lancet_model: " + "; ".join(problems), file=sys.stderr)
        return 2
    from moe_plugins.tools.bench.launch import signals_raise
    with signals_raise():        # SIGTERM/SIGHUP unwind: the ranks are stopped and the namespaces removed
        run(args)
    return 0


if __name__ == "__main__":
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(main())     # not interpreter finalization: see moe_plugins.core.rank_exit
