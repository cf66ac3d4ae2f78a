"""Lancet's timeline of one training step, with and without Lancet, on the emulated cluster (issue #26).

    python benchmarks/lancet_timeline.py --out benchmarks/results --stem lancet-timeline-2x2     # ~3 min
    python benchmarks/lancet_timeline.py --model L=2,S=64,M=64,H=128,E=4,k=2,F=64 --iters 2 --warmup 1 \\
        --out /tmp/lancet-tl --stem smoke                                                          # the path, ~1 min

2 emulated nodes x 2 ranks (network namespaces joined by a tbf-shaped link, moe_plugins/tools/bench/cluster.py;
loopback, labelled, where they are unavailable). One network of core layers, L blocks of (dense pair, MoE
layer) and a dense head, EP over every rank, run forward + backward as ``baseline`` (the core MoELayer),
``lancet`` (LancetMoELayer: expert dW behind the dispatch-gradient all-to-all) and ``lancet+dense`` (also the
dense Linears' dW, behind the combine-gradient all-to-all), on the same weights and tokens; rank side in
moe_plugins/tools/bench/lancet_step.py, outputs in moe_plugins/tools/bench/lancet_timeline.py.

Per rank it reads the engine's timeline (every all-to-all's issue, start and end) and the compute spans (the
experts' forward and backward, the queue's dW spans), and computes overlap = |all-to-all ∩ compute| /
|all-to-all| with moe_plugins.lancet.overlap. Writes ``<stem>.json`` (every timed round's per-rank figures, the
trace of the round nearest each variant's median step) and ``<stem>.png`` (that step: one row per rank,
all-to-alls above compute; the overlap figures in the titles), and prints the figures. Needs root for the
emulated cluster.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

DEFAULT_MODEL = "L=2,S=512,M=256,H=1024,E=4,k=2,f=1,F=512"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="SPEC",
                   help=f"L=,S=,M=,H=,E=,k=,f=,F= (F: dense width; default {DEFAULT_MODEL})")
    p.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                   help="baseline, lancet, lancet+dense (default: all three; baseline is the gradient reference)")
    p.add_argument("--rates", nargs="+", default=["200mbit", "1gbit"], metavar="RATE",
                   help="tc rates (default: 200mbit, where the link dominates, and 1gbit)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--iters", type=int, default=8, help="timed rounds (the picture shows the one nearest the median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first, the check round included (>= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default="auto", choices=("auto", "netns", "loopback"))
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--stem", default="lancet-timeline-2x2")
    p.add_argument("--note", default="")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from moe_plugins.tools.bench.harness import RunOptions
    from moe_plugins.tools.bench.lancet_step import VARIANTS, TimelinePlan
    from moe_plugins.tools.bench.lancet_timeline import run_timeline, text_lines
    from moe_plugins.tools.bench.launch import RankFailure
    from moe_plugins.tools.bench.lina_plan import parse_model
    plan = TimelinePlan(model=parse_model(args.model), nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                        variants=tuple(args.variants or VARIANTS), rates=tuple(args.rates), iters=args.iters,
                        warmup=args.warmup, seed=args.seed)
    command = "python benchmarks/lancet_timeline.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    opts = RunOptions(out_dir=args.out, mode=args.mode, timeout_s=args.timeout_s, note=args.note, command=command,
                      progress=not args.no_progress, stem=args.stem)
    try:
        report = run_timeline(plan, opts)
    except RankFailure as exc:
        print(f"lancet_timeline: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"lancet_timeline: {exc}", file=sys.stderr)
        return 2
    print("\n".join(text_lines(report)))
    print("wrote " + ", ".join(report["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
