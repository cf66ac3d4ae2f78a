"""``moe-plugins verify``: check one MoE layer against the single-process reference.

Spawns ``--world`` gloo ranks on this machine, or, under torchrun (RANK and WORLD_SIZE set), runs as one
of the launched ranks on the cluster. Exit code 0 when every error is within tolerance, 1 on a mismatch,
2 on bad flags.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import List, Union

from moe_plugins.tools.verify import DTYPES, VerifySpec, run_rank, spec_problems


def register(sub) -> None:
    p = sub.add_parser("verify", help="check an MoE layer against the single-process reference")
    p.add_argument("--world", type=int, default=4, help="number of ranks (ignored under torchrun)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: world)")
    p.add_argument("--mp", type=int, default=1, help="tensor (model) parallel degree of the dense layers")
    p.add_argument("--ep", type=int, default=1, help="expert parallel degree")
    p.add_argument("--esp", type=int, default=1, help="expert-sharding degree (each expert split along H)")
    p.add_argument("--experts", type=int, default=4, help="E, number of experts")
    p.add_argument("--k", type=int, default=1, help="top-k")
    p.add_argument("--capacity-factor", type=float, default=1.0, help="f")
    p.add_argument("--min-capacity", type=int, default=0)
    p.add_argument("--drop", dest="drop", action="store_true", default=True, help="drop tokens over capacity")
    p.add_argument("--no-drop", dest="drop", action="store_false", help="dropless")
    p.add_argument("--tokens", type=int, default=16, help="B*L tokens per rank")
    p.add_argument("--hidden", type=int, default=8, help="M")
    p.add_argument("--ffn", type=int, default=16, help="H")
    p.add_argument("--schedule", default="baseline")
    p.add_argument("--pipeline-degree", type=_degree, default=1,
                   help="capacity chunks per layer, or a word ('auto', 'tune': picked from --cache-dir's profile)")
    p.add_argument("--exchange", default="padded", choices=("padded", "ragged"),
                   help="padded: the whole (E, C, M) capacity buffer travels; ragged: only occupied slots, in one "
                        "uneven all-to-all each way (schedule baseline, pipeline degree 1; docs/hecate.md)")
    p.add_argument("--dtype", default="float64", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=0.0, help="bias routing towards expert 0")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="cached cost profiles (`moe-plugins profile --cache-dir`): parm-auto / parm-tune and "
                        "--pipeline-degree auto / tune read the layout's; without it, no profile is read (the "
                        "schedules' documented defaults; degree words refused); core host only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeline", default=None, metavar="PATH",
                   help="write every rank's collectives as a Chrome trace (open in ui.perfetto.dev or "
                        "chrome://tracing); core host only")
    p.add_argument("--host", default="core", choices=("core", "deepspeed", "megatron"),
                   help="core: against the single-process reference; deepspeed: the plugin against DeepSpeed's "
                        "stock MoE layer in the same process groups (--esp equal to --mp turns on its expert "
                        "tensor parallelism); megatron: the plugin against Megatron-core's stock MoELayer "
                        "(alltoall dispatcher; --mp is its sequence-parallel TP, --esp its expert TP)")
    p.add_argument("--rts", action="store_true", help="deepspeed host: the gate's random token selection")
    p.add_argument("--jitter", action="store_true", help="deepspeed host: the gate's input jitter")
    p.add_argument("--top2-sampling", action="store_true", help="deepspeed host: top-2 second-expert sampling")
    p.add_argument("--no-expert-tp", action="store_true",
                   help="deepspeed host, --esp = --mp > 1: DeepSpeed's expert tensor parallelism off, the plugin "
                        "slices the plain FFN experts over ESP itself (Parm's setting); stock runs without expert TP")
    p.add_argument("--pad", action="store_true", help="megatron host: pad expert inputs to capacity (with --drop)")
    p.set_defaults(run=run)


def spec_from_args(args: argparse.Namespace, world: int) -> VerifySpec:
    return VerifySpec(world=world, ranks_per_node=args.ranks_per_node or world, mp=args.mp, ep=args.ep,
                      esp=args.esp, experts=args.experts, k=args.k, capacity_factor=args.capacity_factor,
                      min_capacity=args.min_capacity, drop=args.drop, tokens=args.tokens, hidden=args.hidden,
                      ffn=args.ffn, schedule=args.schedule, pipeline_degree=args.pipeline_degree,
                      exchange=args.exchange, dtype=args.dtype, seed=args.seed, skew=args.skew, timeline=args.timeline is not None,
                      profile_dir=args.cache_dir)


# the VerifySpec fields with a flag of the same name (drop and profile_dir have their own spelling)
_FLAG_FIELDS = ("world", "ranks_per_node", "mp", "ep", "esp", "experts", "k", "capacity_factor", "min_capacity",
                "tokens", "hidden", "ffn", "schedule", "pipeline_degree", "exchange", "dtype", "seed", "skew")


def _degree(text: str) -> Union[int, str]:
    """--pipeline-degree: an int when it is digits, else the word (checked by spec_problems)."""
    text = text.strip().lower()
    return int(text) if text.isdigit() else text


def verify_argv(spec: VerifySpec) -> List[str]:
    """The flags of ``moe-plugins verify`` that rebuild ``spec`` on the core host (the inverse of
    :func:`spec_from_args` under ``--world``; ``timeline`` names no path, so it is left out). A float prints
    as its repr, which parses back to the same number."""
    argv = [f"--{name.replace('_', '-')}={getattr(spec, name)}" for name in _FLAG_FIELDS]
    argv.append("--drop" if spec.drop else "--no-drop")
    return argv + ([f"--cache-dir={spec.profile_dir}"] if spec.profile_dir is not None else [])


def verify_command(spec: VerifySpec) -> str:
    """The shell command that re-runs ``spec`` (see :func:`verify_argv`)."""
    return shlex.join(["moe-plugins", "verify", *verify_argv(spec)])


def run(args: argparse.Namespace) -> int:
    if args.timeline is not None and args.host != "core":
        raise ValueError(f"--timeline needs --host core (got {args.host!r})")
    if args.host != "core" and (args.cache_dir is not None or not isinstance(args.pipeline_degree, int)):
        raise ValueError(f"--cache-dir and a --pipeline-degree word need --host core (got {args.host!r})")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world
    spec, rank_fn = spec_from_args(args, world), run_rank
    problems = spec_problems(spec)
    if args.host == "deepspeed":
        from moe_plugins.tools import verify_deepspeed as host
        spec = host.DeepSpeedVerifySpec(**asdict(spec), rts=args.rts, jitter=args.jitter,
                                        top2_sampling=args.top2_sampling, expert_tp=not args.no_expert_tp)
        problems, rank_fn = host.host_spec_problems(spec), host.run_rank
    if args.host == "megatron":
        from moe_plugins.tools import verify_megatron as megatron_host
        spec = megatron_host.MegatronVerifySpec(**asdict(spec), pad=args.pad)
        problems, rank_fn = megatron_host.host_spec_problems(spec), megatron_host.run_rank
    if problems:
        raise ValueError("; ".join(problems))
    if under_torchrun:
        report = _run_torchrun(spec, rank_fn)
        if report is None:
            return 0
    else:
        from moe_plugins.tools.pool import WorkerPool
        with WorkerPool(world) as pool:
            report = pool.run(rank_fn, spec)[0]
    trace = report.pop("timeline", None)
    if args.timeline is not None:
        Path(args.timeline).parent.mkdir(parents=True, exist_ok=True)
        Path(args.timeline).write_text(json.dumps(trace))
    _print(report, args.json)
    return 0 if report["ok"] else 1


def _run_torchrun(spec: VerifySpec, rank_fn=run_rank):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return rank_fn(spec)
    finally:
        dist.destroy_process_group()


def _print(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
        return
    status = "ok" if report["ok"] else "MISMATCH"
    s = report["spec"]
    print(f"{status}: schedule={s['schedule']} exchange={s.get('exchange', 'padded')} world={s['world']} mp={s['mp']} ep={s['ep']} esp={s['esp']} "
          f"k={s['k']} drop={s['drop']} dtype={s['dtype']} (tolerance {report['tolerance']:g})")
    for key in ("max_err_out", "max_err_grad_in", "max_err_grad_w", "max_err_aux"):
        print(f"  {key:16s} {report[key]:.3e}")
    print(f"  routing equal    {report['routing_equal']}  (dropped routes: {report['dropped_routes']})")
    if report.get("ran"):
        print(f"  ran              {', '.join(report['ran'])} at pipeline degree {report['degrees']}")
    if "bitwise_equal" in report:
        print(f"  bitwise equal    {report['bitwise_equal']}  (host {report['host']}; swapped: {report['swaps']})")
    for layer, ops in report["ledger"].items():
        print(f"  ledger [{layer}] rank 0:")
        for key, row in sorted(ops.items()):
            print(f"    {key:32s} x{row['count']}  {row['numel']:>10d} elems  {row['inter_node_bytes']:>10d} B inter-node")
    sys.stdout.flush()
