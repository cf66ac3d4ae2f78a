"""``moe-plugins launch -- <command>``: run a DeepSpeed or Megatron-core job with the plugin on and no code change.

**Megatron-core** (``--megatron '<json or path>'``, or a ``--moe-plugins`` argument in the command, which is then
taken out of it): the section, and the command's Megatron-LM arguments when it sets ``--num-experts``, are checked
before anything starts (every problem listed, exit code 2). The command runs with the section in
``MOE_PLUGINS_MEGATRON`` and ``moe_plugins/tools/launch_shim`` first on PYTHONPATH, whose ``sitecustomize`` enables
``moe_plugins.patches.megatron`` in every rank right after ``megatron.core`` is imported (see
:mod:`moe_plugins.tools.cli.launch_megatron`). torchrun passes the environment to its workers; run the launcher on every
node.

**DeepSpeed** (otherwise):

The ds_config is found once, here: ``--config``, else the command's ``--deepspeed_config`` / ``--ds-config``
argument, else ``$MOE_PLUGINS_CONFIG``. Its ``moe_plugins`` section is validated before anything starts (every
problem listed, exit code 2). The command then replaces this process with ``MOE_PLUGINS_CONFIG`` set to the
file and ``moe_plugins/tools/launch_shim`` first on PYTHONPATH, whose ``sitecustomize`` enables the plugin in every
rank right after DeepSpeed is imported. DeepSpeed's launcher forwards PYTHON* variables to other nodes; for
``MOE_PLUGINS_CONFIG`` list it in ``.deepspeed_env`` or keep ``--deepspeed_config`` in the script's arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

from moe_plugins.plugins import default_registry
from moe_plugins.tools.launch_shim import CONFIG_ENV, MEGATRON_ENV, SHIM_DIR, config_path_from_argv
from moe_plugins.core.plugin_config import SECTION, load_ds_config, section_of
from moe_plugins.tools.cli import launch_megatron


def register(sub) -> None:
    p = sub.add_parser("launch", help="run a DeepSpeed or Megatron-core training command with the plugin enabled",
                       description="moe-plugins launch [--config DS_CONFIG] -- deepspeed train.py "
                                   "--deepspeed_config ds.json ...  |  moe-plugins launch --megatron "
                                   "'{\"schedule\": \"baseline\"}' -- torchrun pretrain_gpt.py ...")
    p.add_argument("--config", default=None, help="ds_config JSON holding the moe_plugins section (default: the "
                   "command's --deepspeed_config/--ds-config argument, else $MOE_PLUGINS_CONFIG)")
    p.add_argument("--megatron", default=None, metavar="JSON_OR_PATH",
                   help="Megatron-core job: the moe_plugins section as a JSON object or a JSON file (default: the "
                        "command's --moe-plugins argument, which is then taken out of the command)")
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
    if args.megatron is not None or launch_megatron.flag_from_argv(cmd)[0] is not None:
        return _run_megatron(args, cmd)
    config = args.config or config_path_from_argv(cmd) or os.environ.get(CONFIG_ENV)
    if not config:
        raise ValueError("no ds_config: pass --config, keep --deepspeed_config/--ds-config in the command, or set "
                         f"{CONFIG_ENV}; for Megatron-core pass --megatron")
    if not os.path.isfile(config):
        raise ValueError(f"ds_config ({config!r}) is not a file")
    from moe_plugins.patches.deepspeed_hecate import config_choices   # the DeepSpeed adapter's rules (Hecate)
    section = section_of(load_ds_config(config), **config_choices())
    if section is None:
        raise ValueError(f"ds_config {config!r} has no {SECTION!r} section: add one to turn the plugin on")
    env = launch_env(cmd, config, os.environ)
    print(f"moe-plugins launch: {SECTION} {section.to_dict()} from {env[CONFIG_ENV]}", file=sys.stderr)
    return _start(cmd, env, CONFIG_ENV, args.dry_run)


def _run_megatron(args: argparse.Namespace, cmd: List[str]) -> int:
    if args.config is not None:
        raise ValueError(f"--config ({args.config!r}) is a DeepSpeed ds_config; a Megatron-core job takes --megatron")
    plugin, cmd, notes = launch_megatron.prepare(args.megatron, cmd)
    print(f"moe-plugins launch: Megatron-core, {SECTION} {plugin.to_dict()}", file=sys.stderr)
    for note in notes:
        print(f"moe-plugins launch: {note}", file=sys.stderr)
    return _start(cmd, launch_megatron.megatron_env(plugin, os.environ), MEGATRON_ENV, args.dry_run)


def _start(cmd: List[str], env: dict, variable: str, dry_run: bool) -> int:
    """Print the environment and command (dry run), or replace this process with the command."""
    if dry_run:
        print(f"{variable}={env[variable]}\nPYTHONPATH={env['PYTHONPATH']}\n{' '.join(cmd)}")
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0   # not reached: exec replaces this process
