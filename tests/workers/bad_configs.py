"""Helpers for tests/test_bad_configs.py: the host state a refused config must leave as it was, and the job that
refuses a config inside ``deepspeed.initialize`` on pool ranks.

:class:`HostState` captures, by identity, every function object the adapters replace (DeepSpeed's hook points
in ``patches.deepspeed_host.HOOKS`` and the ``deepspeed.comm`` collectives Lina's DeepSpeed hook swaps; with
Megatron, ``patches.megatron.HOOKS`` and the two DDP names ``patches.megatron_lina`` replaces), DeepSpeed's
expert-group registry (``deepspeed.utils.groups``: the dicts themselves and their contents, the expert-TP size,
the mpu) and both adapters' ``active()``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

DS_COMM_SWAPPED = ("all_reduce", "reduce")    # patches/deepspeed_lina.py swaps these while it reduces
EXPERT_REGISTRY = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                   "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP")
REGISTRY_SCALARS = ("expert_tensor_parallel_world_size", "mpu")


def _class_attr(module: str, cls: str, attr: str) -> Any:
    return vars(getattr(importlib.import_module(module), cls))[attr]


def deepspeed_functions() -> Dict[str, Any]:
    """Every DeepSpeed function the DeepSpeed adapter replaces, by dotted name, as bound now."""
    from moe_plugins.patches.deepspeed_host import HOOKS
    found = {".".join(hook): _class_attr(*hook) for hook in HOOKS}
    ds_comm = importlib.import_module("deepspeed.comm")
    found.update({f"deepspeed.comm.{name}": getattr(ds_comm, name) for name in DS_COMM_SWAPPED})
    return found


def megatron_functions() -> Dict[str, Any]:
    """Every Megatron name the Megatron adapter replaces (spec builders; with Lina, DDP's two hooks)."""
    from moe_plugins.patches.megatron import HOOKS
    found = {f"{module}.{attr}": vars(importlib.import_module(module))[attr] for module, attr in HOOKS}
    for hook in (("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel", "__init__"),
                 ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup", "start_grad_sync")):
        found[".".join(hook)] = _class_attr(*hook)
    return found


def expert_registry() -> Dict[str, Tuple[Any, Optional[Dict[Any, Any]]]]:
    """DeepSpeed's expert-group registry: each module global with (the object, a copy of a dict's items)."""
    groups = importlib.import_module("deepspeed.utils.groups")
    state = {name: (getattr(groups, name), dict(getattr(groups, name))) for name in EXPERT_REGISTRY}
    state.update({name: (getattr(groups, name), None) for name in REGISTRY_SCALARS})
    return state


def active_adapters(megatron: bool) -> Dict[str, Any]:
    from moe_plugins.patches import deepspeed as ds_adapter
    found = {"moe_plugins.patches.deepspeed.active()": ds_adapter.active()}
    if megatron:
        from moe_plugins.patches import megatron as mg_adapter
        found["moe_plugins.patches.megatron.active()"] = mg_adapter.active()
    return found


@dataclass(frozen=True)
class HostState:
    functions: Dict[str, Any]
    registry: Dict[str, Tuple[Any, Optional[Dict[Any, Any]]]]
    active: Dict[str, Any]

    @staticmethod
    def capture(megatron: bool) -> "HostState":
        functions = deepspeed_functions()
        if megatron:
            functions.update(megatron_functions())
        return HostState(functions=functions, registry=expert_registry(), active=active_adapters(megatron))

    def differences(self, now: "HostState") -> List[str]:
        """What differs in ``now``, by name (empty: the host is as it was). Functions and registry objects are
        compared with ``is``, dict contents key by key with ``is``; no adapter may be active."""
        changed = [name for name, fn in self.functions.items() if now.functions.get(name) is not fn]
        for name, (obj, items) in self.registry.items():
            now_obj, now_items = now.registry[name]
            same_items = items is None or (now_items is not None and now_items.keys() == items.keys()
                                           and all(now_items[k] is v for k, v in items.items()))
            if now_obj is not obj or not same_items:
                changed.append(f"deepspeed.utils.groups.{name}")
        return changed + [f"{name} is {value!r}" for name, value in now.active.items() if value is not None]


# ---- a job on pool ranks -----------------------------------------------------------------------------------

def refused_engine(section: Dict[str, Any], given: Optional[Dict[str, Any]], extra: Dict[str, Any],
                   cache_dir: str, ep: int) -> Dict[str, Any]:
    """``deepspeed.initialize`` of a tiny MoE model whose ds_config holds ``section`` (plus ``extra`` top-level
    keys), under ``moe_plugins.enable(given)`` with ``$MOE_PLUGINS_CACHE`` = ``cache_dir`` at enable. Returns the
    ValueError's message (None if nothing was refused) and what differs in this rank's host after the ``with``."""
    import deepspeed

    import moe_plugins
    from moe_plugins.tools.verify_deepspeed import init_deepspeed_comm
    from tests.workers.deepspeed import TinyMoEModel, cache_dir_env, ds_config
    init_deepspeed_comm()
    before = HostState.capture(megatron=False)
    message = None
    try:
        with cache_dir_env(cache_dir), moe_plugins.enable(given):
            torch.manual_seed(0)
            model = TinyMoEModel(ep, k=1)
            deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                 config={**ds_config(0, section), **extra})
    except ValueError as exc:
        message = str(exc)
    return {"message": message, "changed": before.differences(HostState.capture(megatron=False))}
