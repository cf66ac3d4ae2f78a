"""Megatron-core host adapter: Megatron's MoE layers run the project's schedules, with Megatron's own router
(routing stays Megatron's) and Megatron's own expert modules (state-dict keys and the expert parameters'
``allreduce=False`` stay Megatron's, so checkpoints load both ways and DDP keeps them in its expert buffers).

Checked against megatron-core 0.16.1 (layer specs are ``ModuleSpec`` objects) and 0.19.2 (from 0.18 they are
``functools.partial`` objects); :mod:`moe_plugins.patches.megatron_specs` reads and rewrites both styles. Two ways
in, both validated by the shared :class:`PluginConfig`:

1. **Spec provider** (no patching): pass :func:`get_moe_module_spec` where you pass Megatron's
   ``megatron.core.models.gpt.moe_module_specs.get_moe_module_spec``; with ``groups=build_megatron_groups(layout)``
   the node-aware process groups travel in the spec, and ``groups.pg_collection`` goes to the model, DDP, the
   optimizer and ``finalize_model_grads``.
2. **Megatron-LM flag**: ``initialize_megatron(extra_args_provider=extra_args_provider)`` adds
   ``--moe-plugins <json or path>``; :func:`enable_from_args` (or :func:`enable`) then patches the two names
   Megatron's GPT layer specs build MoE specs through (:data:`HOOKS`), so the unchanged model provider builds
   :class:`~moe_plugins.patches.megatron_layer.PluginMoELayer`. :func:`disable` puts the identical functions back.

The layer: :mod:`moe_plugins.patches.megatron_layer`; groups and ``ProcessGroupCollection``:
:mod:`moe_plugins.patches.megatron_groups`; settings and their checks: :mod:`moe_plugins.patches.megatron_config`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from moe_plugins.plugins import default_registry
from moe_plugins.core.ledger import CommLedger
from moe_plugins.core.patcher import Patch, Patcher, undo_all
from moe_plugins.core.plugin_config import SECTION, PluginConfig

from moe_plugins.patches.megatron_config import facts_from_args, plugin_problems, section_config
from moe_plugins.patches.megatron_groups import (MegatronGroups, build_megatron_groups, destroy_megatron_groups,
                              groups_from_pg_collection, megatron_groups, token_view)
from moe_plugins.patches.megatron_specs import TESTED_VERSIONS, spec_style, stock_moe_spec, with_layer_class

logger = logging.getLogger("moe_plugins.megatron")

SUPPORTED_VERSION = TESTED_VERSIONS[0]          # the version setup.py pins; TESTED_VERSIONS: every checked one
FLAG = "--moe-plugins"

# (module, name) of every binding the flag path replaces: Megatron's GPT layer specs call the second, and the
# first serves moe_module_specs.get_moe_module_spec and the experimental attention specs (looked up at call time).
HOOKS: Tuple[Tuple[str, str], ...] = (
    ("megatron.core.models.gpt.moe_module_specs", "get_moe_module_spec_for_backend"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_moe_module_spec_for_backend"),
)

_ACTIVE: Optional["MegatronPlugin"] = None   # the one enabled plugin, so that disable() can restore Megatron

PluginLike = Union[PluginConfig, Mapping[str, Any], str, os.PathLike]


# ---- the plugin config, from what users write ------------------------------------------------------------

def resolve_plugin(plugin: PluginLike, path: str = SECTION) -> PluginConfig:
    """A PluginConfig from: a PluginConfig; a dict (the section, or an object holding a ``moe_plugins`` key); a
    JSON object as text; or the path of a JSON file holding either. Every problem is reported at once."""
    if isinstance(plugin, PluginConfig):
        return plugin
    if isinstance(plugin, (str, os.PathLike)):
        text = os.fspath(plugin)
        if text.lstrip().startswith("{"):
            plugin = _json(text, path)
        elif os.path.isfile(text):
            path = f"{path} ({text})"
            with open(text, "r", encoding="utf-8") as fh:
                plugin = _json(fh.read(), path)
        else:
            raise ValueError(f"{path} ({text!r}) must be a JSON object or the path of a JSON file")
    if isinstance(plugin, Mapping) and SECTION in plugin:
        return section_config(plugin[SECTION], f"{path}.{SECTION}" if path != SECTION else SECTION)
    return section_config(plugin, path)


def _json(text: str, path: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


# ---- 1. the spec provider ----------------------------------------------------------------------------------

def plugin_spec(stock_spec: Any, plugin: PluginConfig, *, groups: Optional[MegatronGroups] = None,
                ranks_per_node: Optional[int] = None, ledger: Optional[CommLedger] = None, lina: Any = None,
                engines: Any = None, lancet: Any = None, hecate: Any = None) -> Any:
    """Megatron's MoE layer spec with the layer class swapped for PluginMoELayer (same submodules, so the same
    router, experts and shared experts), in the spec's own style (a ``ModuleSpec`` up to megatron-core 0.17, a
    ``functools.partial`` from 0.18). A disabled config returns the stock spec unchanged. ``lina``: the enabled
    plugin's Lina state (a ``lina`` section needs :func:`enable`, which also hooks Megatron's DDP). ``engines``:
    the :class:`~moe_plugins.patches.megatron_engines.LayoutEngines` pipelined layers run on. ``lancet``: the
    enabled plugin's :class:`~moe_plugins.patches.megatron_lancet.LancetState` (a ``lancet`` section needs it).
    ``hecate``: the enabled plugin's :class:`~moe_plugins.patches.megatron_hecate_reshard.MegatronResharding`
    (``reshard_every`` needs it)."""
    if not plugin.enabled:
        return stock_spec
    if plugin.lina is not None and lina is None:
        raise ValueError(f"{SECTION}.lina needs the plugin enabled (enable(), the {FLAG} flag or moe-plugins "
                         "launch), which hooks Megatron's DistributedDataParallel; the spec provider alone does not")
    from moe_plugins.hecate.config import reshard_interval
    every = reshard_interval(plugin)
    if every and hecate is None:
        raise ValueError(f"{SECTION}.hecate.reshard_every ({every}) needs the plugin enabled "
                         f"(enable(), the {FLAG} flag or moe-plugins launch), which hooks Megatron's optimizer and "
                         "dist_checkpointing; the spec provider alone does not")
    from moe_plugins.patches.megatron_lancet import lancet_or_none
    from moe_plugins.patches.megatron_layer import PluginMoELayer
    params = dict(plugin=plugin, groups=groups, ranks_per_node=ranks_per_node, ledger=ledger)
    if lancet_or_none(plugin, lancet) is not None:
        params["lancet"] = lancet
    if lina is not None:
        params["lina"] = lina
    if engines is not None:
        params["engines"] = engines
    if hecate is not None and every:
        params["resharding"] = hecate
    return with_layer_class(stock_spec, PluginMoELayer, params)


def get_moe_module_spec(use_te: Optional[bool] = True, num_experts: Optional[int] = None,
                        moe_grouped_gemm: Optional[bool] = False, moe_use_legacy_grouped_gemm: Optional[bool] = False,
                        *, plugin: PluginLike, groups: Optional[MegatronGroups] = None,
                        ranks_per_node: Optional[int] = None, ledger: Optional[CommLedger] = None,
                        engines: Any = None) -> Any:
    """Drop-in for ``megatron.core.models.gpt.moe_module_specs.get_moe_module_spec`` (same positional
    arguments; ``moe_use_legacy_grouped_gemm``, which megatron-core 0.18 dropped, must stay off there) plus the
    plugin: its ``moe_plugins`` section, the node-aware ``groups`` (else the layer uses the
    ``pg_collection`` it is given or Megatron's ``parallel_state``), ``ranks_per_node``, a ledger, and for a
    pipeline degree other than 1 the caller's ``engines``
    (:class:`~moe_plugins.patches.megatron_engines.LayoutEngines`, which the caller closes)."""
    config = resolve_plugin(plugin)
    megatron = _import_megatron(check_hooks=False)
    stock = stock_moe_spec(megatron["megatron.core.models.gpt.moe_module_specs"], use_te=use_te,
                           num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                           moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm)
    return plugin_spec(stock, config, groups=groups, ranks_per_node=ranks_per_node, ledger=ledger, engines=engines)


# ---- 2. the Megatron-LM flag --------------------------------------------------------------------------------

def _flag_value(value: str) -> str:
    """argparse ``type`` of the flag: validate now (every problem in one message), keep the text in ``args``
    (Megatron-LM saves its args in checkpoints; a string loads without moe_plugins installed)."""
    try:
        resolve_plugin(value, FLAG)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """For Megatron-LM's ``initialize_megatron(extra_args_provider=...)`` / ``parse_args``: adds ``--moe-plugins``."""
    group = parser.add_argument_group(title="moe_plugins")
    group.add_argument(FLAG, type=_flag_value, default=None, metavar="JSON_OR_PATH",
                       help="run Megatron's MoE layers with moe_plugins: the moe_plugins section as a JSON object, "
                            "or the path of a JSON file holding it (keys: docs/config.md)")
    return parser


def enable_from_args(args: argparse.Namespace, *, groups: Optional[MegatronGroups] = None,
                     ledger: Optional[CommLedger] = None) -> Optional["MegatronPlugin"]:
    """After Megatron-LM parsed its arguments: check the flag against them (all problems at once, nothing
    patched on failure) and enable the plugin. Returns None when the flag is absent or ``enabled`` is false."""
    value = getattr(args, "moe_plugins", None)
    if value is None:
        return None
    plugin = resolve_plugin(value, FLAG)
    rpn = plugin.ranks_per_node or _local_world_size()
    problems = plugin_problems(facts_from_args(args), plugin, world=getattr(args, "world_size", None),
                               ranks_per_node=rpn)
    if plugin.enabled and plugin.lina is not None:
        from moe_plugins.patches.megatron_lina import ddp_problems
        problems += ddp_problems(args, args=True)
    if problems:
        raise ValueError(f"{FLAG} cannot run this Megatron model: " + "; ".join(problems))
    if not plugin.enabled:
        logger.info("moe_plugins: %s has enabled=false; Megatron's MoE layers stay stock", FLAG)
        return None
    return enable(plugin, groups=groups, ranks_per_node=rpn, ledger=ledger)


class MegatronPlugin:
    """One :func:`enable`: the replaced spec builders and their originals. A context manager, or call
    :meth:`disable`. Layers built while it was enabled keep running the plugin after it is disabled, except
    those on its engines, which ``disable()`` closes: pipelined layers (``engines``:
    :class:`~moe_plugins.patches.megatron_engines.LayoutEngines`) and Lina's (``lina``: its state,
    :mod:`~moe_plugins.patches.megatron_lina`). Build and train such models inside the ``with``."""

    def __init__(self, plugin: PluginConfig, *, groups: Optional[MegatronGroups], ranks_per_node: Optional[int],
                 ledger: Optional[CommLedger], lina: Any = None, engines: Any = None, lancet: Any = None,
                 hecate: Any = None, early: Any = None):
        self.plugin, self.groups, self.ranks_per_node, self.ledger = plugin, groups, ranks_per_node, ledger
        self.lina, self.engines, self.lancet, self.hecate, self.early = lina, engines, lancet, hecate, early
        self.specs_built = 0
        self._patcher: Optional[Patcher] = None

    def _install(self, modules: Dict[str, Any]) -> None:
        """Replace the spec builder wherever Megatron's modules hold it (HOOKS), and with Lina its DDP hooks,
        with Lancet's and Hecate's re-sharding theirs, all or none."""
        replacement = self._wrap(getattr(modules[HOOKS[0][0]], HOOKS[0][1]))
        patches = [Patch(modules[module_name], attr, replacement) for module_name, attr in HOOKS]
        from moe_plugins.patches.megatron_compat import compat_patches
        owners = [o for o in (self.lina, self.lancet, self.hecate, self.early) if o is not None]
        self._patcher = Patcher(patches + compat_patches() + [p for o in owners for p in o.patches()],
                                logger=logger).apply()

    def _wrap(self, original: Callable) -> Callable:
        plugin = self

        def get_moe_module_spec_for_backend(*args, **kwargs):
            plugin.specs_built += 1
            return plugin_spec(original(*args, **kwargs), plugin.plugin, groups=plugin.groups,
                               ranks_per_node=plugin.ranks_per_node, ledger=plugin.ledger, lina=plugin.lina,
                               engines=plugin.engines, lancet=plugin.lancet, hecate=plugin.hecate)

        get_moe_module_spec_for_backend.__wrapped__ = original
        return get_moe_module_spec_for_backend

    def _restore(self) -> None:
        patcher, self._patcher = self._patcher, None
        try:
            if patcher is not None:
                patcher.restore()
        finally:
            undo_all([owner.close for owner in (self.early, self.lina, self.engines, self.lancet, self.hecate)
                      if owner is not None])

    @property
    def active(self) -> bool:
        return self._patcher is not None

    def disable(self) -> None:
        """Put Megatron's spec builders back (the identical function objects)."""
        global _ACTIVE
        if self._patcher is None:
            return
        try:
            self._restore()
        finally:
            if _ACTIVE is self:
                _ACTIVE = None
        if self.specs_built:
            logger.info("moe_plugins: Megatron restored; %d MoE spec(s) had been built with the plugin",
                        self.specs_built)
        else:
            logger.warning("moe_plugins: Megatron restored; no MoE layer spec was built while the plugin was enabled "
                           "(was the model built before enable(), or with a spec module other than "
                           "megatron.core.models.gpt?)")

    def __enter__(self) -> "MegatronPlugin":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()


def enable(plugin: PluginLike, *, groups: Optional[MegatronGroups] = None, ranks_per_node: Optional[int] = None,
           ledger: Optional[CommLedger] = None, record_timeline: bool = False) -> MegatronPlugin:
    """Make Megatron's GPT layer specs build PluginMoELayer for every MoE layer. The config is validated before
    anything is patched; the layer checks it against its TransformerConfig when it is built. With a ``lina``
    section, Megatron's DDP reduces the gradients of models over these layers as Lina's micro-ops
    (:mod:`~moe_plugins.patches.megatron_lina`; ``record_timeline``: its engines keep every op, read by
    ``handle.lina.timeline()``)."""
    global _ACTIVE
    config = resolve_plugin(plugin)
    if _ACTIVE is not None:
        raise ValueError("moe_plugins is already enabled for Megatron; call disable() first")
    modules = _import_megatron(check_hooks=True)
    from megatron.core import package_info
    lina = None
    if config.enabled and config.lina is not None:
        from moe_plugins.patches.megatron_lina import LinaState
        lina = LinaState.create(config, package_info.__version__, ledger=ledger, record_timeline=record_timeline)
    from moe_plugins.patches.megatron_lancet import LancetState, defers_dense, defers_wgrad, lancet_on, partition_count
    lancet = LancetState(record_timeline, dense=defers_dense(config), defer=defers_wgrad(config),
                         parts=partition_count(config)) if lancet_on(config) else None
    engines = None
    from moe_plugins.hecate.config import lane_on, pooled_slots, reshard_interval
    if config.enabled and lina is None and (default_registry().needs_lane(config.pipeline_degree) or lancet
                                            or lane_on(config)):
        from moe_plugins.patches.megatron_engines import LayoutEngines
        engines = LayoutEngines(ledger=ledger, record_timeline=record_timeline)
    from moe_plugins.patches.megatron_hecate_early import MegatronEarlyGather
    from moe_plugins.patches.megatron_hecate_reshard import MegatronResharding
    every = reshard_interval(config)
    hecate = MegatronResharding(every, pooled=pooled_slots(config)) if every else None
    handle = MegatronPlugin(config, groups=groups, ranks_per_node=ranks_per_node, ledger=ledger, lina=lina,
                            engines=engines, lancet=lancet, hecate=hecate,
                            early=MegatronEarlyGather() if lane_on(config) else None)
    handle._install(modules)
    _ACTIVE = handle
    logger.info("moe_plugins: Megatron-core %s spec builders patched (config %s)", package_info.__version__,
                config.to_dict())
    return handle


def disable() -> None:
    """Restore Megatron if the plugin is enabled (a no-op otherwise)."""
    if _ACTIVE is not None:
        _ACTIVE.disable()


def active() -> Optional[MegatronPlugin]:
    return _ACTIVE


# ---- Megatron, imported once per call, version and hook points checked ----------------------------------------

def _import_megatron(check_hooks: bool) -> Dict[str, Any]:
    try:
        from megatron.core import package_info
        modules = {name: importlib.import_module(name) for name, _ in HOOKS}
    except ImportError as exc:
        raise ValueError(f"moe_plugins' Megatron adapter needs megatron-core (tested: {', '.join(TESTED_VERSIONS)}; "
                         f"pip install 'moe_plugins[megatron]'): {exc}") from exc
    version = package_info.__version__
    if check_hooks:
        missing = [f"{m}.{a}" for m, a in HOOKS if not callable(modules[m].__dict__.get(a))]
        if missing:
            raise ValueError(f"megatron-core {version} lacks {', '.join(missing)}; moe_plugins' adapter hooks "
                             f"these names (tested: {', '.join(TESTED_VERSIONS)})")
    if version in TESTED_VERSIONS:
        logger.debug("moe_plugins: megatron-core %s (layer specs: %s)", version, spec_style(version))
    else:
        logger.warning("moe_plugins: megatron-core %s found (layer specs: %s); the adapter was tested with %s",
                       version, spec_style(version), ", ".join(TESTED_VERSIONS))
    return modules


def _local_world_size() -> Optional[int]:
    """LOCAL_WORLD_SIZE as torchrun sets it, read once at the boundary."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else None


__all__ = ["FLAG", "HOOKS", "SUPPORTED_VERSION", "TESTED_VERSIONS", "MegatronGroups", "MegatronPlugin", "active",
           "build_megatron_groups", "destroy_megatron_groups", "disable", "enable", "enable_from_args",
           "extra_args_provider", "get_moe_module_spec", "groups_from_pg_collection", "megatron_groups", "plugin_spec",
           "resolve_plugin", "token_view"]
