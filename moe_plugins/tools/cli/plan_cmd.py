"""``moe-plugins plan <planner>``: what a technique would choose for a layer, from its cost model.

Planners come from the registry (each paper package registers its own, e.g. ``parm`` and ``pipemoe``). A
planner's ``register(subparsers)`` adds its sub-parser with ``run`` set; its module is imported only when
asked for, so one planner's missing dependency never breaks another's.
"""

from __future__ import annotations

import argparse

from moe_plugins.plugins import default_registry


def register(sub) -> None:
    p = sub.add_parser("plan", help="what a registered planner would choose for a layer (see `plan <planner> -h`)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("planner", choices=sorted(default_registry().planners()))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the planner's own flags")
    p.set_defaults(run=run)


def planner_parser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-plugins plan")
    default_registry().planners()[name](parser.add_subparsers(dest="planner", required=True))
    return parser


def run(args: argparse.Namespace) -> int:
    inner = planner_parser(args.planner).parse_args([args.planner] + list(args.rest))
    return int(inner.run(inner) or 0)
