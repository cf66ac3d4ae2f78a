"""DeepSpeed host adapter: ``deepspeed.moe.layer.MoE`` layers run the project's schedules, with DeepSpeed's gate
weights and routing (reproduced exactly by ``core/fastgate.py``) and expert modules (state_dict keys, ``allreduce``
and ``group_name`` stay DeepSpeed's).

Shapes: S tokens, M model dim, E experts (E_l local), K routes per token, C capacity, P = N_EP sources.

Hook points, checked against DeepSpeed 0.19.8 (docs/deepspeed.md lists what each one does there):

- ``deepspeed.moe.layer.MoE._create_process_groups``: called once per layer by ``set_deepspeed_parallelism``
  from ``DeepSpeedEngine._configure_distributed_model``. Stock looks up or creates the ``ep_size_<n>`` groups via
  ``groups._create_expert_and_data_parallel`` / ``_create_expert_data_and_model_parallel``. Patched: build the
  project's node-aware :class:`~moe_plugins.core.groups.MoEProcessGroups`, register its EP and expert-DP groups under
  the same name in DeepSpeed's registry (which the engine's gradient reduction, ZeRO-1/2 and checkpointing
  read), give the EP group to the gate, and swap the layer to its schedule.
- ``deepspeed.moe.sharded_moe.MOELayer.forward``: patched to run the schedule for swapped layers (its
  ``_AllToAll``, ``drop_tokens`` and ``gather_tokens`` are then unused); layers not swapped run the original.
- ``deepspeed.runtime.engine.DeepSpeedEngine._configure_distributed_model``: wrapped so that the engine's own
  ds_config ``moe_plugins`` section decides what is on while its layers are set up.

:func:`enable` patches after validating; :meth:`DeepSpeedPlugin.disable` restores the identical functions and
DeepSpeed's group registry.
"""

from __future__ import annotations

import logging
import os
import weakref
from functools import lru_cache, partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist

from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import Group, MoEProcessGroups, build_process_groups, world_timeout
from moe_plugins.core.layout import ParallelLayout, layout_problems
from moe_plugins.core.ledger import CommLedger
from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.core.plugin_config import (SECTION, PluginConfig, degree_needs_profile, profile_problems, resolve,
                                            settled_degree)
from moe_plugins.core.profile_ops import cached_profile
from moe_plugins.core.schedule import with_exchange
from moe_plugins.hecate.config import lane_on
from moe_plugins.plugins import default_registry
from moe_plugins.patches.deepspeed_hecate import HecateBlockHooks, config_choices, hecate_class, hecate_config
from moe_plugins.patches.deepspeed_host import (GROUP_REGISTRY, HOOKS, SUPPORTED_VERSION, cached_profile_dir,
                                                default_ranks_per_node, import_deepspeed)
from moe_plugins.patches.deepspeed_lancet import LancetHooks
from moe_plugins.patches.deepspeed_lina import LinaHooks
from moe_plugins.patches.deepspeed_lina_infer import LinaInferenceHooks
from moe_plugins.patches.deepspeed_layer import (HostGroups, HostLayerFacts, SwappedLayer, common_value,
                                                 expert_ffn_width, ffn_activation, layer_problems, moe_config,
                                                 replica_groups, routing_from_gate)

# what callers of the adapter import from it (the pure parts live in deepspeed_layer / deepspeed_host)
__all__ = ["DeepSpeedPlugin", "HOOKS", "SUPPORTED_VERSION", "HostLayerFacts", "active", "disable", "enable",
           "expert_ffn_width", "ffn_activation", "layer_problems", "replica_groups", "routing_from_gate"]

logger = logging.getLogger("moe_plugins.deepspeed")

_ACTIVE: Optional["DeepSpeedPlugin"] = None   # the one enabled plugin, so that disable() can restore DeepSpeed


# ---- the plugin ----------------------------------------------------------------------------------------

class DeepSpeedPlugin:
    """The state of one :func:`enable` (originals, swapped layers, groups built): a context manager, or disable()."""

    def __init__(self, config: Optional[PluginConfig], *, ledger: Optional[CommLedger], ranks_per_node: Optional[int],
                 profile_dir: Optional[str]):
        self.config, self.ledger, self.ranks_per_node, self.profile_dir = config, ledger, ranks_per_node, profile_dir
        self.swaps: List[Dict[str, Any]] = []                    # one record per swapped layer, in setup order
        self.swapped_layers: "weakref.WeakKeyDictionary[torch.nn.Module, SwappedLayer]" = weakref.WeakKeyDictionary()
        self._patcher: Optional[Patcher] = None
        self._built: Dict[ParallelLayout, MoEProcessGroups] = {}
        self._groups: Dict[Tuple[ParallelLayout, bool], HostGroups] = {}
        self._lanes: Dict[Tuple[ParallelLayout, bool, bool], Any] = {}   # (layout, pipeline, background) -> engine
        self._singletons: Optional[List[Any]] = None
        self._own_pgs: List[Any] = []                           # process groups built here that this rank is in
        self._registered, self._names = [], {}                  # DeepSpeed group names; layer id -> its name
        self._etp_before: Optional[int] = None
        self._engine_config: Optional[PluginConfig] = None
        self._ds: Any = None
        self.lina, self.lancet, self.hecate = LinaHooks(), LancetHooks(), HecateBlockHooks()   # their model hooks
        self.infer = LinaInferenceHooks(config)                  # Lina's inference schedule (reads the table now)

    # -- patching --------------------------------------------------------------------------------------

    def _install(self, ds) -> None:
        """Replace every hook (the table in HOOKS) at once; if one fails, none stays replaced."""
        patches = []
        for hook, factory in HOOKS.items():
            cls, original = ds.owner(hook)
            patches.append(Patch(cls, hook[2], getattr(self, factory)(original)))
        self._patcher = Patcher(patches, logger=logger).apply()
        self._ds = ds

    def _restore_registry(self) -> None:
        groups = self._ds.groups
        try:
            for name in self._registered:
                for attr in GROUP_REGISTRY:
                    getattr(groups, attr).pop(name, None)
            if self._etp_before is not None:
                groups.expert_tensor_parallel_world_size = self._etp_before
        finally:
            self._registered, self._etp_before = [], None

    def disable(self) -> None:
        """Restore DeepSpeed's functions and group registry; destroy the plugin's process groups (collective when
        it built some). An engine set up under the plugin needs it enabled for as long as it trains."""
        global _ACTIVE
        if self._ds is None:
            return
        try:
            try:
                for hooks in (self.lina, self.lancet, self.hecate, self.infer):     # in this order
                    hooks.remove()
            finally:
                self._patcher.restore()             # idempotent; set whenever _ds is
        finally:
            try:
                self._restore_registry()
            finally:
                self._free_groups()
                self.swapped_layers.clear()
                self._ds = None
                if _ACTIVE is self:
                    _ACTIVE = None
        if self.swaps:
            logger.info("moe_plugins: DeepSpeed restored; %d MoE layer(s) had run the plugin", len(self.swaps))
        else:
            logger.warning("moe_plugins: DeepSpeed restored; the plugin matched no MoE layer while enabled (were "
                           "the layers set up before enable(), or did the ds_config lack a %r section?)", SECTION)

    def built_process_groups(self) -> List[Any]:
        """The process groups of this rank that the plugin built (layouts', expert-DP replicas, singletons; not
        the lanes'). :meth:`disable` destroys them."""
        pgs = [g.pg for groups in self._built.values() for g in groups.by_kind().values() if g.pg is not None]
        return list({id(pg): pg for pg in pgs + self._own_pgs}.values())

    def _free_groups(self) -> None:
        """Close the engines' lanes, destroy the plugin's process groups (in build order on every rank)."""
        for lane in self._lanes.values():
            lane.close()
        if dist.is_initialized():                    # the job may have torn down the default group already
            for pg in self.built_process_groups():
                dist.destroy_process_group(pg)
        for held in (self._lanes, self._groups, self._built, self._own_pgs):
            held.clear()
        self._singletons = None

    active = property(lambda self: self._ds is not None)

    def __enter__(self) -> "DeepSpeedPlugin":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    # -- the replacements ------------------------------------------------------------------------------

    def _patched_configure(self, original: Callable) -> Callable:
        plugin = self

        def _configure_distributed_model(engine, model):
            section = getattr(engine._config, "_param_dict", {}).get(SECTION)
            found = None if section is None else PluginConfig.from_dict(section, SECTION, **config_choices())
            if plugin.config is not None and found is not None and found != plugin.config:
                raise ValueError(f"the ds_config {SECTION!r} section {found.to_dict()} conflicts with the config "
                                 f"given to moe_plugins.enable {plugin.config.to_dict()}")
            names = {id(m): n or "<root>" for n, m in model.named_modules()}
            previous = (plugin._engine_config, plugin._names, plugin.lina.current, plugin.infer.current)
            cfg = plugin.config if plugin.config is not None else found
            lina, infer = plugin.lina.begin(engine, model, cfg), plugin.infer.begin(model, cfg)
            plugin.hecate.begin(engine, cfg)
            plugin._engine_config, plugin._names, plugin.lina.current, plugin.infer.current = found, names, lina, infer
            try:
                result = original(engine, model)
                plugin.lina.install(lina, engine, model, plugin)
                plugin.lancet.install_model(engine, model, plugin.swapped_layers, plugin.profile_dir or None)
                plugin.hecate.install(model, plugin.swapped_layers, engine)
                return result
            finally:
                plugin._engine_config, plugin._names, plugin.lina.current, plugin.infer.current = previous

        _configure_distributed_model.__wrapped__ = original
        return _configure_distributed_model

    def _patched_create_process_groups(self, original: Callable) -> Callable:
        plugin = self

        def _create_process_groups(moe, use_data_before_expert_parallel_: bool = False) -> None:
            cfg = plugin.config if plugin.config is not None else plugin._engine_config
            if cfg is None or not cfg.enabled:
                logger.info("moe_plugins: DeepSpeed MoE layer %s stays stock (%s)", plugin._name(moe),
                            "no moe_plugins section" if cfg is None else "moe_plugins.enabled is false")
                return original(moe, use_data_before_expert_parallel_)
            plugin._swap(moe, hecate_config(cfg, moe, plugin._name(moe)), use_data_before_expert_parallel_)

        _create_process_groups.__wrapped__ = original
        return _create_process_groups

    def _patched_forward(self, original: Callable) -> Callable:
        plugin = self

        def forward(layer, *inputs, **kwargs):
            swapped = plugin.swapped_layers.get(layer)
            if swapped is None:
                return original(layer, *inputs, **kwargs)
            return swapped.forward(layer, inputs[0], inputs[1] if len(inputs) > 1 else None)

        forward.__wrapped__ = original
        return forward

    # -- swapping one layer ----------------------------------------------------------------------------

    def _name(self, moe) -> str:
        return self._names.get(id(moe), f"#{len(self.swaps)} ({moe.expert_group_name})")

    def _facts(self, moe) -> HostLayerFacts:
        ds = self._ds
        mpu = ds.groups.mpu
        tp = ds.bwc.bwc_tensor_model_parallel_world_size(mpu)
        tp_ranks: Tuple[int, ...] = ()
        if mpu is not None and tp > 1:
            tp_ranks = tuple(dist.get_process_group_ranks(ds.bwc.bwc_tensor_model_parallel_group(mpu)))
        layer, gate = moe.deepspeed_moe, moe.deepspeed_moe.gate
        expert_tp = mpu is not None and bool(moe.enable_expert_tensor_parallelism)
        hidden = int(gate.wg.in_features)
        return HostLayerFacts(
            name=self._name(moe), hidden=hidden, num_experts=int(moe.num_experts), ep=int(moe.ep_size), k=int(gate.k),
            capacity_factor=float(gate.capacity_factor), min_capacity=int(gate.min_capacity),
            drop_tokens=bool(gate.drop_tokens), expert_tp=expert_tp, tp=int(tp),
            pp=int(ds.bwc.bwc_pipeline_parallel_world_size(mpu)), tp_ranks=tp_ranks,
            use_tutel=bool(layer.use_tutel),
            ffn=expert_ffn_width(layer.experts.deepspeed_experts[0], hidden, tp if expert_tp else 1),
            ffn_activation=common_value([ffn_activation(e, hidden) for e in layer.experts.deepspeed_experts]))

    def _swap(self, moe, cfg: PluginConfig, use_data_before_expert_parallel: bool) -> None:
        """Validate, build (or reuse) the layout's groups, register them with DeepSpeed, swap the layer."""
        facts = self._facts(moe)
        world, rank = dist.get_world_size(), dist.get_rank()
        rpn = cfg.ranks_per_node or self.ranks_per_node or world
        problems = layer_problems(facts, cfg, world, rank, rpn, use_data_before_expert_parallel)
        esp = cfg.esp if cfg.esp is not None else facts.host_esp
        read_profile = lru_cache(maxsize=1)(partial(self._cached_profile, moe=moe))   # read once per layer build
        if not layout_problems(world, rpn, facts.tp, facts.ep, esp):   # the profile is read before any group
            layout = ParallelLayout(world=world, ranks_per_node=rpn, mp=facts.tp, ep=facts.ep, esp=esp)
            asked, cfg = cfg.pipeline_degree, settled_degree(cfg, layout)     # a word is 1 where nothing is exchanged
            problems += profile_problems(cfg, layout, read_profile,
                                         profiled=default_registry().is_profiled(cfg.schedule))
            problems += self.lina.profile_problems(layout, read_profile)
            problems += self.infer.layer_problems(cfg, facts, layout, moe)
        if problems:            # layer_problems lists the layout's problems too: past here the layout is set
            raise ValueError(f"moe_plugins cannot run DeepSpeed MoE layer {facts.name}: " + "; ".join(problems))
        sliced, overlap = esp != facts.host_esp, self.lancet.overlap(cfg)   # overlap: Lancet's, else None
        host = self.host_groups(layout, sliced)
        lanes = self.lancet.needs_lane(overlap) or lane_on(cfg)     # Lancet's, Hecate's early (re-)gathers
        degree, lane, comm = self._pipeline(cfg.pipeline_degree, layout, host.groups, read_profile, lanes)
        ep_pg = self.register_groups(moe.expert_group_name, host)
        if facts.expert_tp:
            if self._etp_before is None:
                self._etp_before = self._ds.groups.expert_tensor_parallel_world_size
            self._ds.groups.expert_tensor_parallel_world_size = esp
        moe.deepspeed_moe._set_ep_group(ep_pg)
        cls = with_exchange(self._schedule_class(cfg.schedule, layout, moe, read_profile), cfg.exchange, degree)
        cls = hecate_class(cfg, cls, moe)               # Hecate's options and activation (else cls itself)
        schedule = cls(moe_config(facts), host.groups, Recorder(self.ledger, facts.name, comm, cls.name, overlap))
        self.swapped_layers[moe.deepspeed_moe] = self.lancet.attach(SwappedLayer(
            name=facts.name, schedule=schedule, groups=host.groups, pipeline_degree=degree, lane=lane,
            slice_activation=facts.ffn_activation if sliced else None, expert_weights=self.hecate.weights(cls),
            inference=self.infer.attach(moe, facts.name, cfg, host.groups, schedule.rec)), moe)
        self.swaps.append({"layer": facts.name, "schedule": cfg.schedule, "exchange": cls.exchange_mode,
                           "pipeline_degree": cfg.pipeline_degree, "mp": layout.mp, "ep": layout.ep, "esp": layout.esp,
                           "num_experts": facts.num_experts, "k": facts.k, "experts_sliced_by_plugin": sliced,
                           "expert_dp_ranks": list(host.expert_dp_ranks)})
        log = logger.info if rank == 0 else logger.debug
        log("moe_plugins: DeepSpeed MoE layer %s (E=%d, k=%d) runs schedule %r, %s exchange, pipeline_degree %s, on "
            "layout mp=%d ep=%d esp=%d ranks_per_node=%d%s", facts.name, facts.num_experts, facts.k, cfg.schedule,
            cls.exchange_mode, cfg.pipeline_degree if asked == cfg.pipeline_degree else f"1 ({asked!r}: this layout "
            "exchanges nothing)", layout.mp, layout.ep, layout.esp, rpn,
            " (the plugin slices DeepSpeed's FFN experts along H)" if sliced else "")

    def _cached_profile(self, layout: ParallelLayout, moe):
        """The cost profile ``moe-plugins profile`` cached for this layout, backend and device (or None)."""
        return cached_profile(self.profile_dir or None, layout, dist.get_backend(), next(moe.parameters()).device)

    def _schedule_class(self, name: str, layout: ParallelLayout, moe, read_profile):
        """The schedule's class; ``parm-auto`` / ``parm-tune`` read the profile cached for this layout."""
        registry = default_registry()
        profile = read_profile(layout) if registry.is_profiled(name) else None
        return registry.host_schedule_class(name, profile, next(moe.parameters()).element_size(), layout.mp, logger)

    def _pipeline(self, value: Union[int, str], layout: ParallelLayout, groups: MoEProcessGroups, read_profile, overlap):
        """PipeMoE's degree (``"auto"`` or ``"tune"``: from the cost profile cached for this layout and device),
        its executor and the layer's engine: one per layout and lanes (collective to build), with a pipeline lane
        when the degree or Lancet's ``overlap`` needs it and a background lane for Lina, shared with its reducer."""
        background, pipeline = self.lina.current is not None, value != 1 or overlap
        if not (pipeline or background):
            return 1, None, None
        from moe_plugins.pipemoe.runner import build_executor
        comm = self.lane_engine(groups, pipeline, background)
        if background:
            self.lina.layer(layout, groups, comm, partial(read_profile, layout))
        if value == 1:
            return 1, None, comm
        profile = read_profile(layout) if degree_needs_profile(value) else None
        executor = build_executor(value, profile, comm)
        return executor.degree, executor, comm

    def lane_engine(self, groups: MoEProcessGroups, pipeline: bool, background: bool) -> Any:
        """The layout's shared engine with these lanes (collective the first time; closed at disable)."""
        key = (groups.layout, pipeline, background)
        if key not in self._lanes:
            from moe_plugins.core.engine import build_engine
            self._lanes[key] = build_engine(groups, pipeline=pipeline, background=background,
                                            ledger=self.ledger if background else None)
        return self._lanes[key]

    def host_groups(self, layout: ParallelLayout, sliced: bool) -> HostGroups:
        """Collective the first time a layout is seen: every rank sets up the same layers in the same order.
        DeepSpeed's expert-DP group is the ranks holding the same expert parameters: the layout's expert-DP
        group when each rank holds its own shard, the ESP x expert-DP replicas when the plugin slices full
        experts."""
        if (layout, sliced) not in self._groups:
            if layout not in self._built:
                self._built[layout] = build_process_groups(layout)
            groups = self._built[layout]
            if sliced:
                rank, made = dist.get_rank(), None
                for ranks in replica_groups(layout):
                    pg = dist.new_group(list(ranks), timeout=world_timeout())      # collective, even at size 1
                    made = (pg, ranks) if rank in ranks else made
                edp_pg, edp_ranks = made
                self._own_pgs.append(edp_pg)
            else:
                edp_pg, edp_ranks = self._real_pg(groups.expert_dp), groups.expert_dp.ranks
            self._groups[(layout, sliced)] = HostGroups(groups=groups, ep_pg=self._real_pg(groups.ep),
                                                         expert_dp_pg=edp_pg, expert_dp_ranks=tuple(edp_ranks))
        return self._groups[(layout, sliced)]

    def _real_pg(self, group: Group):
        if group.pg is not None:
            return group.pg
        if self._singletons is None:   # collective: the same layouts, hence the same decision, on every rank
            self._singletons = [dist.new_group([r]) for r in range(dist.get_world_size())]
            self._own_pgs.append(self._singletons[dist.get_rank()])
        return self._singletons[dist.get_rank()]

    def register_groups(self, name: str, host: HostGroups):
        """Put the layout's EP and expert-DP groups in DeepSpeed's registry under ``name``; an entry already
        there must hold the same ranks (it is then kept: the engine may hold it)."""
        groups = self._ds.groups
        ep_ranks, edp_ranks = list(host.groups.ep.ranks), list(host.expert_dp_ranks)
        if name in groups._EXPERT_PARALLEL_GROUP:
            have_ep = list(groups._EXPERT_PARALLEL_GROUP_RANKS.get(name, ()))
            have_edp = list(groups._EXPERT_DATA_PARALLEL_GROUP_RANKS.get(name, ()))
            if (have_ep, have_edp) != (ep_ranks, edp_ranks):
                raise ValueError(f"DeepSpeed already has expert groups named {name!r} with EP ranks {have_ep} and "
                                 f"expert-DP ranks {have_edp}; the plugin's layout needs {ep_ranks} and {edp_ranks}")
            return groups._EXPERT_PARALLEL_GROUP[name]
        groups._EXPERT_PARALLEL_GROUP[name] = host.ep_pg
        groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ep_ranks
        groups._EXPERT_DATA_PARALLEL_GROUP[name] = host.expert_dp_pg
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = edp_ranks
        self._registered.append(name)
        return host.ep_pg


def enable(config: Union[None, PluginConfig, str, os.PathLike, Mapping[str, Any]] = None, *,
           ledger: Optional[CommLedger] = None) -> DeepSpeedPlugin:
    """Patch DeepSpeed so that its MoE layers run the project's schedules; returns the handle (a context
    manager). ``config``: a ds_config (dict or JSON path) with a ``moe_plugins`` section, the section itself,
    a PluginConfig, or None to let each engine's ds_config section decide. Everything is validated before
    anything is patched; a failed enable leaves DeepSpeed untouched."""
    global _ACTIVE
    resolved = resolve(config, **config_choices())
    if _ACTIVE is not None:
        raise ValueError("moe_plugins is already enabled for DeepSpeed; call moe_plugins.disable() first")
    ds = import_deepspeed()
    plugin = DeepSpeedPlugin(resolved, ledger=ledger, ranks_per_node=default_ranks_per_node(),
                             profile_dir=cached_profile_dir())
    plugin._install(ds)
    _ACTIVE = plugin
    logger.info("moe_plugins: DeepSpeed %s patched (%s)", ds.version,
                "config: " + str(resolved.to_dict()) if resolved is not None else "each engine's ds_config decides")
    return plugin


def disable() -> None:
    """Restore DeepSpeed if the plugin is enabled (a no-op otherwise)."""
    if _ACTIVE is not None:
        _ACTIVE.disable()


def active() -> Optional[DeepSpeedPlugin]:
    return _ACTIVE
