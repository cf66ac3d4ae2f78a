"""DeepSpeed itself, as the adapter sees it: the version checked against, the hook points it replaces, the
group registry it restores, and the one import of DeepSpeed's modules at enable (every missing hook point
named in one error). Also the two facts read from the environment at that boundary."""


from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, Optional, Tuple




from moe_plugins.core.patcher import Patch, Patcher

logger = logging.getLogger("moe_plugins.deepspeed")

SUPPORTED_VERSION = "0.19.8"

# Every function the adapter replaces: (module, class, attribute) -> the DeepSpeedPlugin method that builds the
# replacement from the original. Lina's micro-op gradient reduction adds its entries here
# (DeepSpeedEngine._reduce_non_expert_gradients, DeepSpeedZeroOptimizer.average_tensor; docs/deepspeed.md).
HOOKS: Dict[Tuple[str, str, str], str] = {
    ("deepspeed.moe.layer", "MoE", "_create_process_groups"): "_patched_create_process_groups",
    ("deepspeed.moe.sharded_moe", "MOELayer", "forward"): "_patched_forward",
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_distributed_model"): "_patched_configure",
}

# DeepSpeed's name-keyed registry of expert groups (deepspeed.utils.groups), restored on disable.
GROUP_REGISTRY = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
             "_EXPERT_DATA_PARALLEL_GROUP_RANKS")


# ---- the host's modules, imported once at enable -------------------------------------------------------

@dataclass(frozen=True)
class _DeepSpeed:
    version: str
    modules: Dict[str, Any]
    groups: Any
    bwc: Any

    def owner(self, hook: Tuple[str, str, str]):
        cls = getattr(self.modules[hook[0]], hook[1])
        return cls, cls.__dict__.get(hook[2])


def import_deepspeed() -> _DeepSpeed:
    import importlib
    try:
        import deepspeed
        modules = {name: importlib.import_module(name) for name, _, _ in HOOKS}
        groups = importlib.import_module("deepspeed.utils.groups")
        bwc = importlib.import_module("deepspeed.utils.bwc")
    except ImportError as exc:
        raise ValueError(f"moe_plugins' DeepSpeed adapter needs deepspeed=={SUPPORTED_VERSION} "
                         f"(pip install 'moe_plugins[deepspeed]'): {exc}") from exc
    ds = _DeepSpeed(version=deepspeed.__version__, modules=modules, groups=groups, bwc=bwc)
    missing = [f"{m}.{c}.{a}" for (m, c, a) in HOOKS if not callable(ds.owner((m, c, a))[1])]
    missing += [f"deepspeed.utils.groups.{attr}" for attr in GROUP_REGISTRY
                if not isinstance(getattr(groups, attr, None), dict)]
    if missing:
        raise ValueError(f"DeepSpeed {ds.version} lacks the hook points {', '.join(missing)}; moe_plugins' "
                         f"adapter was written against {SUPPORTED_VERSION}")
    if ds.version != SUPPORTED_VERSION:
        logger.warning("moe_plugins: DeepSpeed %s found; the adapter was checked against %s", ds.version,
                       SUPPORTED_VERSION)
    return ds


def default_ranks_per_node() -> Optional[int]:
    """LOCAL_WORLD_SIZE as torchrun and DeepSpeed's launcher set it, read once at enable (the boundary)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def cached_profile_dir() -> Optional[str]:
    """Where ``moe-plugins profile`` caches cost profiles (pipeline_degree "auto" or "tune"), read once at enable."""
    try:
        from moe_plugins.core.costmodel import default_cache_dir
    except ImportError:
        return None
    return str(default_cache_dir())


def init_deepspeed_comm(timeout: Optional[timedelta] = None) -> None:
    """``deepspeed.init_distributed`` over gloo (the existing group, or a new one from torchrun's variables, with
    ``timeout``), without JIT-building DeepSpeed's shm all-reduce op (45-60 s of both cores here, once per
    install; it serves only ``inference_all_reduce``, of DeepSpeed's injected inference layers, which nothing here
    uses: without it that call falls back to torch's all-reduce). The builder is replaced only
    while DeepSpeed's backend is created (CPU recipes, tools and tests; a GPU job calls
    ``deepspeed.init_distributed`` itself)."""
    import deepspeed
    from deepspeed import comm as ds_comm
    if getattr(ds_comm.comm, "cdb", None) is not None and ds_comm.comm.cdb.is_initialized():
        return
    ds_torch = importlib.import_module("deepspeed.comm.torch")   # `import deepspeed.comm.torch` gives torch
    with Patcher([Patch(ds_torch, "build_shm_op", lambda: None)], logger=logger):
        deepspeed.init_distributed(dist_backend="gloo", **({} if timeout is None else {"timeout": timeout}))
