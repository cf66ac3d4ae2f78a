"""The Megatron-core half of ``moe-plugins launch``: find the ``moe_plugins`` section (``--megatron`` or a
``--moe-plugins`` argument of the command), check it and the Megatron-LM arguments the command carries, and
build the environment whose ``sitecustomize`` enables ``moe_plugins.patches.megatron`` in every rank once
``megatron.core`` is imported. Pure functions; nothing here imports Megatron.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import List, Optional, Sequence, Tuple

from moe_plugins.tools.launch_shim import CONFIG_ENV, MEGATRON_ENV, SHIM_DIR
from moe_plugins.patches.megatron import FLAG, resolve_plugin
from moe_plugins.patches.megatron_config import RANDOM_ROUTING, UNSUPPORTED, facts_from_args, plugin_problems
from moe_plugins.core.plugin_config import PluginConfig

# Megatron-LM arguments the check reads: (dest, type); flags (store_true) have type bool
_ARGS = (("tensor_model_parallel_size", int), ("expert_model_parallel_size", int),
         ("expert_tensor_parallel_size", int), ("num_experts", int), ("moe_router_topk", int),
         ("moe_expert_capacity_factor", float), ("moe_token_dispatcher_type", str),
         ("pipeline_model_parallel_size", int), ("context_parallel_size", int), ("cuda_graph_impl", str),
         ("moe_input_jitter_eps", float))
_FLAGS = tuple(name for name, fine, _ in UNSUPPORTED if fine is False) + tuple(
    name for name in RANDOM_ROUTING if name != "moe_input_jitter_eps")


def flag_from_argv(argv: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """The value of the command's ``--moe-plugins`` (the last one wins, as argparse does) and the command without
    it: unchanged Megatron-LM scripts reject flags they do not know, and the launcher enables the plugin itself."""
    value, rest, skip = None, [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == FLAG:
            if i + 1 >= len(argv):
                raise ValueError(f"{FLAG} in the command has no value")
            value, skip = argv[i + 1], True
        elif arg.startswith(FLAG + "="):
            value = arg[len(FLAG) + 1:]
        else:
            rest.append(arg)
    return value, rest


def megatron_args(cmd: Sequence[str]) -> Optional[argparse.Namespace]:
    """The Megatron-LM arguments of the command that the adapter depends on, with Megatron-LM's defaults; None
    when the command sets no ``--num-experts`` (a config file or a script's defaults: the layer checks them)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, kind in _ARGS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None)
    for name in _FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true")
    known, _ = parser.parse_known_args(list(cmd))
    if known.num_experts is None:
        return None
    defaults = {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 1, "moe_router_topk": 2,
                "moe_token_dispatcher_type": "allgather", "pipeline_model_parallel_size": 1,
                "context_parallel_size": 1, "cuda_graph_impl": "none"}
    for name, value in defaults.items():
        if getattr(known, name) is None:
            setattr(known, name, value)
    return known


def megatron_section(value: str, source: str, cmd: Sequence[str]) -> PluginConfig:
    """The validated section; with the command's Megatron-LM arguments, also every reason the plugin cannot run
    them (the world-dependent checks happen in the ranks). One ValueError lists every problem."""
    plugin = resolve_plugin(value, source)
    args = megatron_args(cmd)
    problems = plugin_problems(facts_from_args(args), plugin, world=None, ranks_per_node=None) if args else []
    if problems:
        raise ValueError(f"{source} cannot run the command's Megatron model: " + "; ".join(problems))
    return plugin


def megatron_env(plugin: PluginConfig, environ: dict) -> dict:
    """The shim first on PYTHONPATH and the validated section, as JSON, in ``MOE_PLUGINS_MEGATRON`` (a DeepSpeed
    ds_config variable is dropped: one host per job)."""
    env = {k: v for k, v in environ.items() if k != CONFIG_ENV}
    env[MEGATRON_ENV] = json.dumps(plugin.to_dict(), sort_keys=True)
    env["PYTHONPATH"] = os.pathsep.join([SHIM_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def prepare(option: Optional[str], cmd: List[str]) -> Tuple[PluginConfig, List[str], List[str]]:
    """(section, command to run, notes for the user) from ``--megatron`` or the command's ``--moe-plugins``."""
    value, stripped = flag_from_argv(cmd)
    if option is not None and value is not None:
        raise ValueError(f"the section is given twice: --megatron ({option!r}) and {FLAG} ({value!r}) in the "
                         "command; keep one")
    notes = []
    if value is not None:
        notes.append(f"{FLAG} taken out of the command: the launcher enables the plugin (unchanged Megatron-LM "
                     "scripts reject flags they do not know)")
        option, cmd, source = value, stripped, f"{FLAG} (in the command)"
    else:
        source = "--megatron"
    plugin = megatron_section(option, source, cmd)
    if megatron_args(cmd) is None:
        notes.append("the command sets no --num-experts: the section is checked against the model when each MoE "
                     "layer is built")
    if not plugin.enabled:
        notes.append("enabled is false: Megatron's MoE layers stay stock")
    return plugin, cmd, notes
