"""The ``moe-plugins`` console script. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from moe_plugins.tools.cli import bench_cmd, launch_cmd, lina_profile_cmd, plan_cmd, profile_cmd, verify_cmd

SUBCOMMANDS = (verify_cmd, profile_cmd, plan_cmd, launch_cmd, bench_cmd, lina_profile_cmd)


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-plugins", description="MoE training speed-ups for DeepSpeed "
                                     "and Megatron-core, and the tools to check and plan them.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (UsageError, ValueError) as exc:
        print(f"moe-plugins {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(main())     # not interpreter finalization: see moe_plugins.core.rank_exit
