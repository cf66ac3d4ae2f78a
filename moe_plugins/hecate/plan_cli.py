"""``moe-plugins plan hecate``: what Hecate's Algorithm 1 copies where for one MoE layer under a given load, why,
and what it does to the bytes on the wire per training step against expert parallelism on the same homes
(moe_plugins/hecate/explain.py).

The load: ``--load`` (routes per expert over the FSSDP group, E integers: e.g. a layer's ``window_load()``), or
``--routes N --hot-share p`` (expert 0 takes p of N routes, the others share the rest evenly). The layout:
``--nodes`` x ``--ranks-per-node`` ranks, the FSSDP (EP) group; experts E = ``--E``, each an FFN ``--M`` ->
``--H`` -> ``--M`` with biases, ``--element-bytes`` per value. The plan's knobs as in the ``hecate`` section:
``--extra-experts`` (m, copies per rank; "auto": E / R) and ``--overlap`` (Algorithm 1's t; default E, as the
layer plans without ``prefetch``); ``--homes`` (the owners; default expert parallelism's).

Reads no profile: bytes, not seconds. The busiest node's inbound bytes (tokens plus the copies' spAG and spRS) are
what the step's exchange time follows on a link-bound cluster (docs/hecate.md, "Measured").
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List

from moe_plugins.hecate.explain import LayerShape, explain
from moe_plugins.hecate.plan import rank_nodes

SIZES = {"nodes": "nodes", "ranks_per_node": "ranks per node", "E": "experts", "M": "model dim",
         "H": "expert FFN hidden dim", "element_bytes": "bytes per value (fp32: 4)"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def register(sub) -> None:
    p = sub.add_parser("hecate", help="Hecate's copies for one layer under a load, and the bytes they save",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, help_ in SIZES.items():
        p.add_argument(_flag(name), dest=name, type=int, required=name not in ("element_bytes",),
                       default=4 if name == "element_bytes" else None, help=help_)
    p.add_argument("--load", type=int, nargs="+", default=None, help="routes per expert over the group (E ints)")
    p.add_argument("--routes", type=int, default=None, help="with --hot-share: routes over the group")
    p.add_argument("--hot-share", dest="hot_share", type=float, default=None,
                   help="with --routes: expert 0's share of the routes, in [0, 1]")
    p.add_argument("--extra-experts", dest="extra_experts", default="auto",
                   help='m: copies per rank beyond its own experts, an integer >= 0 or "auto" (E / R)')
    p.add_argument("--overlap", type=int, default=None, help="Algorithm 1's t (default: E)")
    p.add_argument("--homes", type=int, nargs="+", default=None, help="each expert's owner rank (E ints)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def load_of(args: argparse.Namespace) -> List[int]:
    """The load the flags give (checked by :func:`check_inputs` first)."""
    if args.load is not None:
        return list(args.load)
    hot = round(args.routes * args.hot_share)
    rest, extra = divmod(args.routes - hot, args.E - 1) if args.E > 1 else (0, 0)
    return [hot] + [rest + (1 if e < extra else 0) for e in range(args.E - 1)]


def check_inputs(args: argparse.Namespace) -> None:
    """Every bad flag at once, one line, each naming the flag, its value and what is allowed."""
    problems = [f"{_flag(n)} ({getattr(args, n)}) must be an integer >= 1" for n in SIZES if getattr(args, n) < 1]
    ranks = args.nodes * args.ranks_per_node
    if not problems and args.E % ranks:
        problems.append(f"--E ({args.E}) must be a multiple of the {ranks} ranks (--nodes x --ranks-per-node)")
    if (args.load is None) == (args.routes is None and args.hot_share is None):
        problems.append("give the load as --load (E integers) or as --routes with --hot-share, not both or neither")
    if args.load is not None and (len(args.load) != args.E or any(n < 0 for n in args.load)):
        problems.append(f"--load ({args.load}) must be {args.E} integers >= 0 (one per expert)")
    if args.load is None and (args.routes is None or args.hot_share is None):
        problems.append("--routes and --hot-share go together")
    elif args.load is None and (args.routes < 0 or not 0 <= args.hot_share <= 1):
        problems.append(f"--routes ({args.routes}) must be >= 0 and --hot-share ({args.hot_share}) in [0, 1]")
    m = args.extra_experts
    if not (m == "auto" or (isinstance(m, str) and m.isdigit())):
        problems.append(f'--extra-experts ({m!r}) must be an integer >= 0 or "auto"')
    if args.overlap is not None and args.overlap < 0:
        problems.append(f"--overlap ({args.overlap}) must be an integer >= 0")
    if args.homes is not None and (len(args.homes) != args.E or any(not 0 <= h < ranks for h in args.homes)):
        problems.append(f"--homes ({args.homes}) must be {args.E} ranks in [0, {ranks})")
    if problems:
        raise ValueError("invalid Hecate plan: " + "; ".join(problems))


def plan(args: argparse.Namespace) -> Dict[str, Any]:
    check_inputs(args)
    ranks = args.nodes * args.ranks_per_node
    extra: Any = args.extra_experts if args.extra_experts == "auto" else int(args.extra_experts)
    return explain(load_of(args), rank_nodes(ranks, args.ranks_per_node),
                   LayerShape(args.E, args.M, args.H, args.element_bytes), extra, args.overlap, args.homes)


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def render(out: Dict[str, Any]) -> List[str]:
    b, ep, hc = out["budget"], out["expert_parallelism"], out["hecate"]
    lines = [f"Hecate plan: {out['experts']} experts on {out['ranks']} ranks (nodes {out['nodes_R']}); one expert "
             f"{_mb(out['expert_bytes'])}, one token row {out['row_bytes']} B",
             f"budget: t = {b['t']} experts worth materialising, m = {b['m']} copies per rank"
             f"{' (t <= m: the top t on every rank)' if b['everywhere'] else ''}; {out['paying_experts']} experts "
             "would pay for their copies in bytes alone", ""]
    for row in out["per_expert"]:
        lines.append(f"  expert {row['expert']}: {row['routes']} routes ({100 * row['share']:.0f}%), home rank "
                     f"{row['home']}, copies on {row['copies']}: {row['why']}")
    lines += ["", "per training step                      expert parallelism    hecate",
              f"  token bytes                          {_mb(ep['token_bytes_per_step']):>18}    "
              f"{_mb(hc['token_bytes_per_step'])}",
              f"  token bytes to other nodes           {_mb(ep['inter_node_bytes_per_step']):>18}    "
              f"{_mb(hc['inter_node_bytes_per_step'])}",
              f"  copies' spAG + spRS bytes            {'-':>18}    {_mb(hc['copy_bytes_per_step'])} "
              f"({_mb(hc['copy_inter_node_bytes_per_step'])} to other nodes; Eq. 2: {_mb(hc['eq2_bytes'])})",
              f"  busiest node's inbound bytes         {_mb(ep['busiest_node_inbound_bytes']):>18}    "
              f"{_mb(hc['busiest_node_inbound_bytes'])} "
              f"({_ratio(hc['busiest_node_inbound_bytes'], ep['busiest_node_inbound_bytes'])})",
              "", "assumed: " + "; ".join(out["assumptions"])]
    return lines


def run(args: argparse.Namespace) -> int:
    out = plan(args)
    print(json.dumps(out) if args.json else "\n".join(render(out)))
    sys.stdout.flush()
    return 0
