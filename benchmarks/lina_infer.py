"""Lina's inference scheduling against DeepSpeed: per-batch latency of a trained GPT-2-MoE on held-out text.

    python benchmarks/lina_infer.py --out benchmarks/results --stem lina-infer-2x2            # ~15-25 min
    python benchmarks/lina_infer.py --rounds 20 --rates 1gbit --train-steps 50 --out /tmp/li  # a short run
    python benchmarks/lina_infer.py --ckpt-dir runs/ckpt --skew 2 ...     # reuse a checkpoint; + a skewed case

1. Trains the recipe's tiny GPT-2-MoE (2 MoE layers of E = 4 experts, top-1) on Shakespeare with
   ``moe_plugins.recipes.train_deepspeed`` (``--train-steps``, 4 gloo ranks, EP 2, the first 600,000
   characters) into a temporary folder, unless ``--ckpt-dir`` names one.
2. Profiles its routing with ``moe-plugins lina-profile`` on the ``--profile-chars`` characters after the
   training text: the popularity table (path length 3; with 2 MoE layers layer 1's path is layer 0's expert;
   ``--start-layer 0``, the default, estimates layer 0 from its profiled marginal, so both layers are scheduled).
3. Per case (``real``; ``skew=S`` for each ``--skew S``: the synthetic second case, the same checkpoint with
   MoE layer j's logits biased by S towards expert j mod E, profiled again with the same bias) and per link
   rate: 2 emulated nodes x 2 ranks (network namespaces, tbf-shaped links; loopback, labelled, where they are
   unavailable) run the rows ``deepspeed``, ``ideal``, ``baseline``, ``lina-infer``, ``lina-infer-noest`` side
   by side (moe_plugins/tools/bench/lina_infer_rank.py): EP 4, dropless gate, batches of ``--batch-size``
   sequences of 64 tokens per rank from the text after the profiled part, rows interleaved per round.

Writes ``<stem>.json`` (the bench format: ``groups[].rows[name]`` with p50/p95/p99, skew, accuracy),
``<stem>.md`` and ``<stem>.png`` (latency CDFs) into ``--out``. Needs root for the emulated cluster.
"""

from __future__ import annotations

import argparse
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
TRAIN_CHARS = 600_000


def _run(cmd: List[str], what: str, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def train(workdir: Path, steps: int, ranks: int, ep: int, timeout: float) -> Dict[str, Any]:
    """The recipe's checkpoint after ``steps`` steps (config recipes/configs/gpt2_moe_tiny.json)."""
    ckpt, out = workdir / "ckpt", workdir / "train"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "moe_plugins.recipes.train_deepspeed", "--model", "gpt2-moe", "--size", "tiny",
           "--ds-config", str(ROOT / "recipes" / "configs" / "gpt2_moe_tiny.json"), "--ep", str(ep),
           "--steps", str(steps), "--max-chars", str(TRAIN_CHARS), "--ckpt-dir", str(ckpt),
           "--save-every", str(steps), "--out", str(out)]
    t0 = time.monotonic()
    _run(cmd, "training", timeout)
    summary = json.loads((out / "report.json").read_text())["summary"]
    return {"ckpt_dir": str(ckpt), "steps": steps, "ranks": ranks, "ep": ep, "train_chars": TRAIN_CHARS,
            "loss_first10_mean": summary.get("first10_mean"), "loss_last10_mean": summary.get("last10_mean"),
            "wall_s": round(time.monotonic() - t0, 1), "command": " ".join(shlex.quote(c) for c in cmd[1:])}


def profile(ckpt: str, table: Path, chars: int, batch_tokens_blocks: int, skew: float, start_layer: Optional[int],
            timeout: float) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "moe_plugins.tools.cli", "lina-profile", "--ckpt-dir", ckpt, "--skip-chars",
           str(TRAIN_CHARS), "--chars", str(chars), "--batch-size", str(batch_tokens_blocks), "--out", str(table)]
    if start_layer is not None:
        cmd += ["--start-layer", str(start_layer)]
    if skew:
        cmd += ["--skew", str(skew)]
    _run(cmd, "lina-profile", timeout)
    obj = json.loads(table.read_text())
    return {"table": str(table), "start_layer": obj["start_layer"], "path_length": obj["path_length"],
            "profile_accuracy": obj["meta"]["accuracy"]["value"],
            "profile_accuracy_marginal_only": obj["meta"]["accuracy"]["marginal_only"],
            "busiest_expert_share": obj["meta"]["busiest_expert_share"]}


def _follow(path: Path, total: int, stop: threading.Event, label: str) -> None:
    from tqdm import tqdm
    bar, seen = tqdm(total=total, desc=label, unit="round", file=sys.stderr), 0
    while not stop.wait(0.5):
        if path.exists():
            n = len(path.read_text().splitlines())
            bar.update(n - seen)
            seen = n
    bar.close()


def launch(cfg: Dict[str, Any], cluster: Any, workdir: Path, label: str) -> Dict[str, Any]:
    from moe_plugins.tools.bench.launch import run_script_ranks
    progress = workdir / f"progress-{label.replace(' ', '_').replace(',', '')}.jsonl"
    cfg = {**cfg, "progress": str(progress)}
    Path(cfg["result"]).unlink(missing_ok=True)          # no result of an earlier launch can stand in
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(progress, cfg["rounds"], stop, label), daemon=True)
    follower.start()
    try:
        return run_script_ranks(__file__, cfg, cluster, workdir)
    finally:
        stop.set()
        follower.join()


def _meta_lines(args, transport: str, trained: Dict[str, Any], tables: Dict[str, Dict[str, Any]], wall: float,
                load: List[Any]) -> List[str]:
    from importlib.metadata import version
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                         text=True).stdout.strip() or "unknown"
    lines = [f"transport: {transport}",
             f"model: the recipe's tiny GPT-2-MoE (2 MoE layers, E 4, top-1), trained {trained['steps']} steps "
             f"({trained['ranks']} ranks, EP {trained['ep']}, first {trained['train_chars']} characters of "
             f"Shakespeare; loss {_f(trained.get('loss_first10_mean'))} -> {_f(trained.get('loss_last10_mean'))}, "
             f"first / last 10 steps)",
             f"inference: EP 4 over 2 x 2 ranks, dropless gate (capacity = the largest count), {args.batch_size} "
             f"sequences x 64 tokens per rank per batch, trunk only (no LM head), ZeRO 0, fp32, 1 thread per rank",
             f"timing: {args.rounds} timed rounds after {args.warmup} warm-up rounds; round i serves batch i to every "
             f"row, rows in a seeded random order per round; latency = barrier, forward, slowest rank"]
    for case, t in tables.items():
        lines.append(f"table ({case}): `moe-plugins lina-profile` on characters {TRAIN_CHARS}-"
                     f"{TRAIN_CHARS + args.profile_chars}, start_layer {t['start_layer']}, path length "
                     f"{t['path_length']}; its own held-out accuracy {t['profile_accuracy']:.1%} (marginal only "
                     f"{t['profile_accuracy_marginal_only']:.1%}); inference text starts at character "
                     f"{TRAIN_CHARS + args.profile_chars}")
    lines += [f"machine: {os.cpu_count()} CPUs; load average before {load[0]}, after {load[1]}; wall {wall:.0f} s",
              f"versions: python {sys.version.split()[0]}, torch {version('torch')}, deepspeed {version('deepspeed')}; "
              f"git {git}",
              "reproduce: `python benchmarks/lina_infer.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]) + "`"]
    return lines


def _f(v: Optional[float]) -> str:
    return "?" if v is None else f"{v:.3f}"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank-config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--stem", default="lina-infer-2x2")
    p.add_argument("--rates", nargs="+", default=["200mbit", "1gbit"])
    p.add_argument("--rows", nargs="+", default=None, help="default: deepspeed ideal baseline lina-infer lina-infer-noest")
    p.add_argument("--rounds", type=int, default=60, help="timed rounds (batches per row)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per batch")
    p.add_argument("--ckpt-dir", default=None, help="a recipe checkpoint to use (default: train one)")
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--profile-chars", type=int, default=200_000)
    p.add_argument("--skew", type=float, nargs="*", default=[], help="synthetic cases: logit bias S per case")
    p.add_argument("--start-layer", type=int, default=0,
                   help="the table's first MoE layer (default 0: layer 0 from its profiled marginal, layer 1 from "
                        "the path; -1: lina-profile's default, the paper's path length, here layer 1)")
    p.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit per launch of the ranks")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/moe_plugins"))
    p.add_argument("--from-json", type=Path, default=None,
                   help="no run: re-summarize a stored <stem>.json (groups, targets, .md, .png) into --out")
    return p.parse_args(argv)


def arg_problems(args: argparse.Namespace) -> List[str]:
    from moe_plugins.tools.bench.lina_infer_rank import ROWS, row_problems
    from moe_plugins.tools.bench.matrix import parse_rate
    problems = [f"{flag} ({v}) must be an integer >= {low}" for flag, v, low in
                (("--rounds", args.rounds, 2), ("--warmup", args.warmup, 1), ("--batch-size", args.batch_size, 1),
                 ("--train-steps", args.train_steps, 1), ("--profile-chars", args.profile_chars, 10_000),
                 ("--start-layer", args.start_layer, -1)) if v < low]
    problems += row_problems(list(args.rows or ROWS))
    problems += [f"--skew ({s}) must be a non-zero number of logits" for s in args.skew if not s or s != s]
    for rate in args.rates:
        try:
            parse_rate(rate)
        except ValueError as exc:
            problems.append(f"--rates: {exc}")
    return problems


def run(args: argparse.Namespace) -> Dict[str, Any]:
    from moe_plugins.tools.bench import lina_infer_report as rep
    from moe_plugins.tools.bench.cluster import ClusterSpec, emulated_cluster, netns_unavailable_reason, set_rate
    from moe_plugins.tools.bench.lina_infer_rank import LINA_ROWS, ROWS
    rows = list(args.rows or ROWS)
    if any(r in LINA_ROWS for r in rows):
        try:
            from moe_plugins.lina import inference_stats  # noqa: F401  (the layer must exist before anything runs)
        except ImportError:
            raise SystemExit("lina_infer: this moe_plugins has no Lina inference layer yet; run with --rows "
                             "deepspeed ideal baseline") from None
    reason = None if args.mode == "loopback" else netns_unavailable_reason()
    if args.mode == "netns" and reason:
        raise SystemExit(f"lina_infer: the emulated cluster is unavailable: {reason}")
    load0, t0 = tuple(round(x, 2) for x in os.getloadavg()), time.monotonic()
    groups, tables = [], {}
    with tempfile.TemporaryDirectory(prefix="lina-infer-") as tmp:
        work = Path(tmp)
        trained = ({"ckpt_dir": args.ckpt_dir, "steps": "?", "ranks": "?", "ep": "?", "train_chars": TRAIN_CHARS}
                   if args.ckpt_dir else train(work, args.train_steps, 4, 2, args.timeout_s))
        cases = [("real", 0.0)] + [(f"skew={s:g}", s) for s in args.skew]
        for case, skew in cases:
            tables[case] = profile(trained["ckpt_dir"], work / f"table-{case}.json", args.profile_chars,
                                   4 * args.batch_size, skew,
                                   args.start_layer if args.start_layer >= 0 else None, args.timeout_s)
        base = {"world": 4, "ranks_per_node": 2, "rows": rows, "size": "tiny", "ckpt_dir": trained["ckpt_dir"],
                "batch_size": args.batch_size, "rounds": args.rounds, "warmup": args.warmup, "seed": args.seed,
                "skip_chars": TRAIN_CHARS + args.profile_chars, "cache_dir": args.cache_dir,
                "timeout_s": args.timeout_s, "result": str(work / "result.json")}

        def one(cluster, rate_label: str) -> None:
            for case, skew in cases:
                cfg = {**base, "skew": skew, "inference": {"table": tables[case]["table"],
                                                            "start_layer": tables[case]["start_layer"]}}
                result = launch(cfg, cluster, work, f"{case}, {rate_label}")
                groups.append(rep.make_group(case, rate_label, result["rows"]))
                print(rep.markdown({"meta": {"title": f"{case}, {rate_label}"}, "groups": groups[-1:]}), flush=True)
        if reason is None:
            transport = ("emulated cluster: 2 network namespaces x 2 ranks joined by a bridge, every node link "
                         "tbf-shaped in both directions to the group's rate (TCP reno, tbf burst 128kb)")
            with emulated_cluster(ClusterSpec(nodes=2)) as cluster:
                for rate in args.rates:
                    set_rate(cluster, rate)
                    one(cluster, rate)
        else:
            transport = f"LOOPBACK ONLY, NOT an emulated cluster ({reason}): 4 ranks on 127.0.0.1, unshaped"
            one(None, "unshaped")
    load1 = tuple(round(x, 2) for x in os.getloadavg())
    meta = {"title": "Lina inference latency, 2 emulated nodes x 2 ranks" if reason is None else
            "Lina inference latency, LOOPBACK ONLY", "netns": reason is None, "fallback_reason": reason,
            "header_lines": _meta_lines(args, transport, trained, tables, time.monotonic() - t0, [load0, load1]),
            "training": trained, "tables": tables, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "plan": {k: v for k, v in vars(args).items() if k != "rank_config"} | {"out": str(args.out)}}
    return write(args, {"meta": meta, "groups": groups})


def write(args: argparse.Namespace, report: Dict[str, Any]) -> Dict[str, Any]:
    from moe_plugins.tools.bench import lina_infer_report as rep
    from moe_plugins.tools.bench.outputs import write_report
    return write_report(report, args.out, args.stem, problems=rep.report_problems, markdown=rep.markdown,
                        plot=rep.plot)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.rank_config:
        from moe_plugins.tools.bench.lina_infer_rank import rank_main
        from moe_plugins.tools.bench.outputs import run_rank_config
        return run_rank_config(args.rank_config, rank_main)
    problems = arg_problems(args)
    if problems:
        print("lina_infer: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.from_json:
        from moe_plugins.tools.bench.lina_infer_report import make_group
        stored = json.loads(args.from_json.read_text())
        write(args, {"meta": stored["meta"], "groups": [make_group(g["case"], g["rate"], g["rows"])
                                                         for g in stored["groups"]]})
        return 0
    from moe_plugins.tools.bench.launch import signals_raise
    with signals_raise():        # SIGTERM/SIGHUP unwind: the ranks are stopped and the namespaces removed
        run(args)
    return 0


if __name__ == "__main__":
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(main())     # not interpreter finalization: see moe_plugins.core.rank_exit
