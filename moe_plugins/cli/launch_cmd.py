"""``moe-plugins launch -- <command>``: run a DeepSpeed job with the plugin on and no code change.

The ds_config is found once, here: ``--config``, else the command's ``--deepspeed_config`` / ``--ds-config``
argument, else ``$MOE_PLUGINS_CONFIG``. Its ``moe_plugins`` section is validated before anything starts (every
problem listed, exit code 2). The command then replaces this process with ``MOE_PLUGINS_CONFIG`` set to the
file and ``moe_plugins/launch_shim`` first on PYTHONPATH, whose ``sitecustomize`` enables the plugin in every
rank right after DeepSpeed is imported. DeepSpeed's launcher forwards PYTHON* variables to other nodes; for
``MOE_PLUGINS_CONFIG`` list it in ``.deepspeed_env`` or keep ``--deepspeed_config`` in the script's arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

from ..launch_shim import CONFIG_ENV, SHIM_DIR, config_path_from_argv
from ..plugin_config import SECTION, load_ds_config, section_of


def register(sub) -> None:
    p = sub.add_parser("launch", help="run a training command with the plugin enabled by its ds_config section",
                       description="moe-plugins launch [--config DS_CONFIG] -- deepspeed train.py "
                                   "--deepspeed_config ds.json ...")
    p.add_argument("--config", default=None, help="ds_config JSON holding the moe_plugins section (default: the "
                   "command's --deepspeed_config/--ds-config argument, else $MOE_PLUGINS_CONFIG)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the environment, start nothing")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command to run, after --")
    p.set_defaults(run=run)


def launch_env(cmd: List[str], config: str, environ: dict) -> dict:
    """The environment the command runs in: the shim first on PYTHONPATH, the ds_config path exported."""
    env = dict(environ)
    env[CONFIG_ENV] = os.path.abspath(config)
    env["PYTHONPATH"] = os.pathsep.join([SHIM_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else list(args.cmd)
    if not cmd:
        raise ValueError("give the command to run after --, e.g. moe-plugins launch -- deepspeed train.py "
                         "--deepspeed_config ds.json")
    config = args.config or config_path_from_argv(cmd) or os.environ.get(CONFIG_ENV)
    if not config:
        raise ValueError("no ds_config: pass --config, keep --deepspeed_config/--ds-config in the command, or set "
                         f"{CONFIG_ENV}")
    if not os.path.isfile(config):
        raise ValueError(f"ds_config ({config!r}) is not a file")
    section = section_of(load_ds_config(config))
    if section is None:
        raise ValueError(f"ds_config {config!r} has no {SECTION!r} section: add one to turn the plugin on")
    env = launch_env(cmd, config, os.environ)
    print(f"moe-plugins launch: {SECTION} {section.to_dict()} from {env[CONFIG_ENV]}", file=sys.stderr)
    if args.dry_run:
        print(f"{CONFIG_ENV}={env[CONFIG_ENV]}\nPYTHONPATH={env['PYTHONPATH']}\n{' '.join(cmd)}")
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0   # not reached: exec replaces this process
