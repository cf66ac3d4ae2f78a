"""``moe-plugins plan <planner>``: what a technique would choose for a layer, from its cost model.

Planners: ``parm`` (Parm's schedule choice, moe_plugins/parm/plan.py) and ``pipemoe`` (PipeMoE's
pipeline degree, moe_plugins/pipemoe/plan.py). Each planner module has ``register(subparsers)``, which
adds its own sub-parser with ``run`` set; it is imported only when asked for, so one planner's missing
dependency never breaks another's.
"""

from __future__ import annotations

import argparse
import importlib

PLANNERS = {"parm": "moe_plugins.parm.plan", "pipemoe": "moe_plugins.pipemoe.plan"}


def register(sub) -> None:
    p = sub.add_parser("plan", help="what Parm / PipeMoE would choose for a layer (see `plan <planner> -h`)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("planner", choices=sorted(PLANNERS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the planner's own flags")
    p.set_defaults(run=run)


def planner_parser(name: str) -> argparse.ArgumentParser:
    module = importlib.import_module(PLANNERS[name])
    parser = argparse.ArgumentParser(prog="moe-plugins plan")
    module.register(parser.add_subparsers(dest="planner", required=True))
    return parser


def run(args: argparse.Namespace) -> int:
    inner = planner_parser(args.planner).parse_args([args.planner] + list(args.rest))
    return int(inner.run(inner) or 0)
