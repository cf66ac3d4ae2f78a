"""``moe-plugins bench``: MoE layer cases x rows x link rates, side by side, on an emulated cluster.

Examples::

    moe-plugins bench --preset committed --out benchmarks/results
    moe-plugins bench --case S=512/1024,M=256,H=512,E=8,k=2,f=1,ep=4 --rows baseline deepspeed --rates 1gbit
    moe-plugins bench --remove-stale          # delete namespaces left by a run that was SIGKILLed

The training-step contention bench (Lina, issue #23; docs/benchmarks.md, "Training step"): a step of L MoE
blocks between dense layers, its dense gradients reduced four ways (sync, fifo, lina@kib=N, noreduce; and through the hosts)::

    moe-plugins bench --preset lina --out /tmp/lina --stem lina-step
    moe-plugins bench --step-model L=4,S=128,M=256,H=2048,E=4,k=2,F=384 --rows sync fifo lina@kib=128 noreduce \
        --rates 200mbit

Exit code 0 on success, 1 when a rank failed or the time limit passed, 2 on bad flags.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from moe_plugins.tools.bench.cluster import ClusterSpec


def register(sub) -> None:
    p = sub.add_parser("bench", help="time MoE layers side by side on an emulated multi-node cluster",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None,
                   help="a named plan (committed, smoke, lancet-2x1, lancet-2x2, lancet-smoke, ...; the training-step "
                        "bench: lina, lina-smoke); other flags override it")
    p.add_argument("--step-model", default=None, metavar="SPEC",
                   help="the training-step bench's network: L=,S=,M=,H=,E=,k=,f=,F= (F: dense width); with rows "
                        "sync, fifo, lina@kib=N (or @mb=X), noreduce, and the hosts deepspeed, deepspeed@lina,kib=N, "
                        "megatron, megatron@lina,kib=N")
    p.add_argument("--case", action="append", default=None, metavar="SPEC",
                   help="S=,M=,H=,E=,k=,f=,min_capacity=,drop=,mp=,ep=,esp=,skew= (a/b/c expands; skew: the share "
                        "of tokens whose first choice is expert 0); repeatable")
    p.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                   help="schedule names (with @r=N, @exchange=ragged), deepspeed (or "
                        "deepspeed@plugin=<schedule>[,r=N]: DeepSpeed's "
                        "layer swapped in by the plugin's adapter, one such row per run), megatron; the first row "
                        "is the output reference")
    p.add_argument("--rates", nargs="+", default=None, metavar="RATE", help="tc rates (200mbit, 1gbit) or unshaped")
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--iters", type=int, default=None, help="timed rounds (report medians over >= 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (>= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--mode", default="auto", choices=("auto", "netns", "loopback"),
                   help="netns: require the emulated cluster; loopback: no shaping; auto: netns when possible")
    p.add_argument("--tcp-cc", default=ClusterSpec.congestion_control, metavar="NAME",
                   help=f"TCP congestion control in the emulated nodes ({ClusterSpec.congestion_control}; "
                        f"see docs/benchmarks.md)")
    p.add_argument("--tbf-burst", default=ClusterSpec.burst, metavar="SIZE",
                   help=f"tbf bucket on every node link, in tc units ({ClusterSpec.burst}; see docs/benchmarks.md)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit for the whole run")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    p.add_argument("--stem", default="bench", help="output file names: STEM.json, STEM.md, STEM.png")
    p.add_argument("--note", default="", help="a line recorded in the report")
    p.add_argument("--timeline", type=Path, default=None, metavar="FILE",
                   help="also write every engine op of the plugin rows, per rank, as Chrome trace JSON "
                        "(Perfetto, chrome://tracing); the step bench always writes STEM-timeline.json")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--remove-stale", action="store_true",
                   help="only delete namespaces whose creating bench process is gone, then exit")
    p.set_defaults(run=run)


def is_step_bench(args: argparse.Namespace) -> bool:
    from moe_plugins.tools.bench.lina_plan import STEP_PRESETS
    return args.step_model is not None or args.preset in STEP_PRESETS


def step_plan_from_args(args: argparse.Namespace):
    """The training-step bench's plan from the flags (a step preset, overridden by explicit flags)."""
    from moe_plugins.tools.bench.lina_plan import STEP_PRESETS, StepPlan, parse_model, parse_step_row
    problems = [f"{flag} does not apply to the training-step bench" for flag, given in
                (("--case", args.case), ("--dtype " + args.dtype, args.dtype != "float32")) if given]
    if args.preset is not None and args.preset not in STEP_PRESETS:
        problems.append(f"preset ({args.preset!r}) is not a training-step preset ({', '.join(STEP_PRESETS)})")
    if problems:
        raise ValueError("; ".join(problems))
    base = dict(STEP_PRESETS[args.preset]) if args.preset else {}
    model_text = args.step_model or base.get("model")
    rows = args.rows or base.get("rows")
    rates = args.rates or base.get("rates")
    missing = [flag for flag, v in (("--step-model", model_text), ("--rows", rows), ("--rates", rates)) if not v]
    if missing:
        raise ValueError(f"{', '.join(missing)} needed (or a step --preset)")
    pick = lambda name, default: getattr(args, name) if getattr(args, name) is not None else base.get(name, default)
    return StepPlan(nodes=pick("nodes", 2), ranks_per_node=pick("ranks_per_node", 2), model=parse_model(model_text),
                    rows=tuple(parse_step_row(r) for r in rows), rates=tuple(rates), iters=pick("iters", 10),
                    warmup=pick("warmup", 2), seed=args.seed)


def plan_from_args(args: argparse.Namespace):
    from moe_plugins.tools.bench.lina_plan import STEP_PRESETS
    from moe_plugins.tools.bench.matrix import PRESETS, BenchPlan, parse_cases, parse_row
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"preset ({args.preset!r}) is unknown; allowed: {', '.join(list(PRESETS) + list(STEP_PRESETS))}")
    base = dict(PRESETS[args.preset]) if args.preset else {}
    cases_text = args.case or ([base["cases"]] if "cases" in base else None)
    rows = args.rows or base.get("rows")
    rates = args.rates or base.get("rates")
    missing = [flag for flag, v in (("--case", cases_text), ("--rows", rows), ("--rates", rates)) if not v]
    if missing:
        raise ValueError(f"{', '.join(missing)} needed (or a --preset)")
    cases = tuple(c for text in cases_text for c in parse_cases(text))
    pick = lambda name, default: getattr(args, name) if getattr(args, name) is not None else base.get(name, default)
    return BenchPlan(nodes=pick("nodes", 2), ranks_per_node=pick("ranks_per_node", 2), cases=cases,
                     rows=tuple(parse_row(r) for r in rows), rates=tuple(rates), iters=pick("iters", 10),
                     warmup=pick("warmup", 3), seed=args.seed, dtype=args.dtype)


def run(args: argparse.Namespace) -> int:
    from moe_plugins.tools.bench import cluster
    if args.remove_stale:
        removed = cluster.remove_stale()
        print(f"removed {len(removed)} stale namespace(s): {' '.join(removed) or '-'}")
        return 0
    from moe_plugins.tools.bench.harness import RunOptions, run_bench
    from moe_plugins.tools.bench.launch import RankFailure
    step = is_step_bench(args)
    plan = step_plan_from_args(args) if step else plan_from_args(args)
    if not re.fullmatch(r"[a-z0-9_]+", args.tcp_cc):
        raise ValueError(f"--tcp-cc ({args.tcp_cc!r}) must be a kernel congestion-control name, such as reno or bbr")
    if not re.fullmatch(r"[1-9][0-9]*(b|kb|k|mb|m)", args.tbf_burst):
        raise ValueError(f"--tbf-burst ({args.tbf_burst!r}) must be a size in tc units: a positive integer then "
                         f"b, k, kb, m or mb (such as 128kb)")
    opts = RunOptions(out_dir=args.out, mode=args.mode, timeout_s=args.timeout_s, note=args.note,
                      command="moe-plugins bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
                      if len(sys.argv) > 1 and sys.argv[1] == "bench" else "", progress=not args.no_progress,
                      stem=args.stem, congestion_control=args.tcp_cc,
                      tbf_burst=args.tbf_burst, timeline=args.timeline)
    try:
        if step:
            from moe_plugins.tools.bench.lina_report import run_step_bench
            report = run_step_bench(plan, opts)
        else:
            report = run_bench(plan, opts)
    except RankFailure as exc:
        print(f"moe-plugins bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moe-plugins bench: interrupted; ranks stopped and the emulated cluster torn down", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(report))
    elif step:
        from moe_plugins.tools.bench.lina_report import markdown_step
        print(markdown_step(report))
    else:
        from moe_plugins.tools.bench.report import markdown
        print(markdown(report))
        print("wrote " + ", ".join(report["files"]))
    return 0
