"""``moe-plugins profile``: measure GEMM and the collectives on the real groups, fit t = alpha + beta * x,
cache the profile as JSON and plot the fit against the measurements.

Spawns ``--world`` gloo ranks here, or, under torchrun (RANK and WORLD_SIZE set), runs as one of the
launched ranks (use that on a cluster or on the emulated one). The profile is written to ``--out``, else
to the cache: ``<cache dir>/profile-<key>.json`` where the key is world size, layout, backend and device,
and the cache dir is ``--cache-dir``, else ``$MOE_PLUGINS_CACHE``, else ``~/.cache/moe_plugins``.
``moe-plugins plan`` and ``pipeline_degree: "auto"`` read it from there.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from moe_plugins.core.costmodel import CostProfile, cache_path, default_cache_dir, runner_chunk_terms
from moe_plugins.core.layout import ParallelLayout, layout_problems
from moe_plugins.tools.profiler import COLLECTIVES, GROUP_KINDS, ProfileSpec, plot_profile, profile_rank

OPS = ("gemm",) + COLLECTIVES + ("saa", "chunk")


def register(sub) -> None:
    p = sub.add_parser("profile", help="measure and fit the cost model (alpha-beta) on this cluster",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="number of ranks (ignored under torchrun)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: world)")
    p.add_argument("--mp", type=int, default=1)
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: world / esp)")
    p.add_argument("--esp", type=int, default=1)
    p.add_argument("--min-bytes", type=int, default=1 << 14, help="smallest message per rank (bytes)")
    p.add_argument("--max-bytes", type=int, default=1 << 22, help="largest message per rank (bytes)")
    p.add_argument("--points", type=int, default=8, help="message sizes, geometric from min to max")
    p.add_argument("--gemm", default="2,256,512", help="E_l,M,H of the timed batched GEMM")
    p.add_argument("--gemm-rows", default="32,64,128,256,512,1024", help="rows per expert to time")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--groups", default="ep,esp,mp,ep_esp", help=f"comma list of {', '.join(GROUP_KINDS)}")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per size (median is fitted)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    p.add_argument("--cache-dir", default=None, help="cache directory (default: $MOE_PLUGINS_CACHE or "
                   "~/.cache/moe_plugins)")
    p.add_argument("--out", default=None, help="write the profile here instead of the cache")
    p.add_argument("--plot", default=None, help="PNG of fit vs measurements (default: next to the JSON)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the profile JSON")
    p.set_defaults(run=run)


def _ints(text: str, flag: str) -> tuple:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} ({text!r}) must be a comma list of integers") from None


def spec_from_args(args: argparse.Namespace, world: int) -> ProfileSpec:
    ep = args.ep if args.ep is not None else max(1, world // max(1, args.esp))
    rpn = args.ranks_per_node or world
    problems = layout_problems(world, rpn, args.mp, ep, args.esp)
    if args.points < 2:
        problems.append(f"--points ({args.points}) must be >= 2")
    if not 0 < args.min_bytes < args.max_bytes:
        problems.append(f"--min-bytes ({args.min_bytes}) must be > 0 and < --max-bytes ({args.max_bytes})")
    if problems:
        raise ValueError("; ".join(problems))
    ratio = (args.max_bytes / args.min_bytes) ** (1 / (args.points - 1))
    sizes = tuple(sorted({int(round(args.min_bytes * ratio ** i)) for i in range(args.points)}))
    gemm = _ints(args.gemm, "--gemm")
    return ProfileSpec(layout=ParallelLayout(world=world, ranks_per_node=rpn, mp=args.mp, ep=ep, esp=args.esp),
                       sizes_bytes=sizes, gemm_rows=_ints(args.gemm_rows, "--gemm-rows"),
                       gemm_shape=gemm if len(gemm) == 3 else (0, 0, 0),
                       ops=tuple(v.strip() for v in args.ops.split(",") if v.strip()),
                       groups=tuple(v.strip() for v in args.groups.split(",") if v.strip()),
                       warmup=args.warmup, repeats=args.repeats, dtype=args.dtype).check()


def run(args: argparse.Namespace) -> int:
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world
    spec = spec_from_args(args, world)
    source = "moe-plugins " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    progress = not args.no_progress
    if under_torchrun:
        profile = _run_torchrun(spec, source, progress)
        if profile is None:
            return 0
    else:
        from moe_plugins.tools.pool import WorkerPool
        with WorkerPool(world) as pool:
            profile = pool.run(profile_rank, spec, source=source, progress=progress)[0]
    out = Path(args.out) if args.out else cache_path(Path(args.cache_dir) if args.cache_dir else default_cache_dir(),
                                                       profile.key)
    profile.save(out)
    plot = None
    if not args.no_plot:
        plot = Path(args.plot) if args.plot else out.with_suffix(".png")
        plot_profile(profile, plot)
    _print(profile, out, plot, args.json)
    return 0


def _run_torchrun(spec: ProfileSpec, source: str, progress: bool):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        return profile_rank(spec, source=source, progress=progress)
    finally:
        dist.destroy_process_group()


def _print(profile: CostProfile, out: Path, plot, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"profile": str(out), "plot": str(plot) if plot else None,
                          "key": profile.key.slug(), **json.loads(profile.to_json())}))
        return
    print(f"profile {profile.key.slug()} ({profile.dtype}) -> {out}")
    if plot:
        print(f"plot -> {plot}")
    print(f"  {'op':24s} {'alpha (s)':>11s} {'beta (s/unit)':>14s} {'unit':>5s} {'R^2':>7s}")
    for key, m in sorted(profile.models.items()):
        clamped = [term for term in ("alpha", "beta") if getattr(m, f"{term}_clamped")]
        note = f"  ({' and '.join(clamped)} < 0 in the unbounded fit: pinned at 0)" if clamped else ""
        print(f"  {key:24s} {m.alpha:11.3e} {m.beta:14.3e} {m.unit:>5s} {m.r2:7.4f}{note}")
    if "chunk" in profile.measurements:
        step = runner_chunk_terms(profile.measurements["chunk"])[1]
        print(f"  chunk: the line is fitted to degrees >= 2; the step of turning the pipeline on (r = 1 -> 2, "
              f"beyond one chunk) is {step:.3e} s")
    sys.stdout.flush()
