"""Megatron-core's ``MoELayer`` running the project's schedules: Megatron's router decides the routing, Megatron's
expert modules compute (same parameters, names and attributes), and a schedule moves the tokens.

Shapes: S tokens of this rank, M model dim, E experts (E_l local), K routes per token, C capacity, N rows per
local expert, R rows. ``probs_SE`` / ``map_SE`` are Megatron's router outputs (``probs``, ``routing_map``).

How the stage methods map (megatron-core 0.16.1 and 0.19.2; see docs/megatron.md)::

    MoELayer stage            Megatron's alltoall dispatcher        here (pipeline degree 1)
    route                     TopKRouter                            TopKRouter (unchanged)
    preprocess                permute + split sizes                 Routing from probs/map; schedule.prepare
    dispatch                  EP all-to-all                         schedule.exchange_in
    routed_experts_compute    ETP all-gather, experts, ETP RS       schedule.expert (experts + ESP reduction)
    combine                   EP all-to-all                         schedule.exchange_out
    postprocess               unpermute (+ shared experts)          schedule.finish (+ shared experts)

With a pipeline degree r > 1 steps 2-4 run chunked in ``routed_experts_compute`` (PipeMoE's runner; dispatch and
combine pass their input through).

Exactness: Megatron's experts scale their hidden activation by the routing weight (``per_token_scale``); here
they get a scale of one and the schedule's combine multiplies by the same weight, so the forward differs only in
rounding and the gradients reach the router's ``probs`` (and its aux-loss hooks) the same way. (Megatron 0.16.1
allows expert biases only with expert-TP 1, so the ESP reduction never sums a bias.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, List, Optional, Type

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_capacity
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from moe_plugins.core import comm
from moe_plugins.core.comm import Recorder
from moe_plugins.core.costmodel import CostProfile, default_cache_dir
from moe_plugins.core.gating import Routing
from moe_plugins.core.groups import Group, MoEProcessGroups
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.ledger import CommLedger
from moe_plugins.core.engine import CommEngine
from moe_plugins.pipemoe.runner import build_executor, needs_lane, run_pipelined
from moe_plugins.core.plugin_config import PluginConfig, degree_needs_profile, settled_degree
from moe_plugins.core.profile_ops import cached_profile
from moe_plugins.core.router import uniform_capacity
from moe_plugins.core.schedule import LayerParams, Schedule, with_exchange
from moe_plugins.hecate.config import lane_on
from moe_plugins.plugins import default_registry
from moe_plugins.patches import megatron_hecate
from moe_plugins.patches.megatron_config import ProfileLookup, facts_from_config, moe_config, plugin_problems
from moe_plugins.patches.megatron_groups import (MegatronGroups, groups_from_pg_collection, parallel_state_collection,
                              pg_collection_problems, token_view)

logger = logging.getLogger("moe_plugins.megatron")


# ---- Megatron's routing as the core's Routing -------------------------------------------------------------

def routing_from_megatron(probs_SE: torch.Tensor, map_SE: torch.Tensor, capacity: int) -> Routing:
    """Megatron's ``(probs, routing_map)`` as a Routing with ``capacity`` slots per expert.

    Every entry of the map is a route, in token order per expert (its slot), weighted by its probability; this
    includes the zero-probability entries Megatron adds with ``moe_pad_expert_input_to_capacity``, which it
    also sends through the experts. K is the most entries any token has; a token with fewer has -1 slots."""
    counts_E = map_SE.sum(0)
    if map_SE.numel() and int(counts_E.max()) > capacity:
        raise ValueError(f"routing has {int(counts_E.max())} tokens for one expert, above the capacity ({capacity})")
    k = max(1, int(map_SE.sum(1).max())) if map_SE.numel() else 1
    expert_SK = map_SE.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :k]
    kept_SK = map_SE.gather(1, expert_SK)
    position_SE = map_SE.long().cumsum(0) - 1
    slot_SK = torch.where(kept_SK, position_SE.gather(1, expert_SK), torch.full_like(expert_SK, -1))
    weight_SK = probs_SE.gather(1, expert_SK) * kept_SK.to(probs_SE.dtype)
    return Routing(expert_SK=expert_SK, slot_SK=slot_SK, weight_SK=weight_SK, capacity=int(capacity),
                   aux_loss=probs_SE.new_zeros(()), exp_counts_E=counts_E.long())


def block_capacity(map_SE: torch.Tensor, config: Any, groups: MoEProcessGroups, rec: Recorder) -> int:
    """Slots per expert: Megatron's capacity with token dropping (its router already dropped), else the largest
    expert count made uniform over the ranks whose buffers must match (EP&ESP; MP is 1 here)."""
    if config.moe_expert_capacity_factor is not None:
        return get_capacity(map_SE.shape[0] * config.moe_router_topk, config.num_moe_experts,
                            config.moe_expert_capacity_factor)
    local_max = int(map_SE.sum(0).max()) if map_SE.numel() else 0
    return uniform_capacity(local_max, groups, rec)


@dataclass(frozen=True)
class MegatronRouting:
    """``LayerParams.router`` for one forward. This rank's token block gets the routing Megatron's router made
    in the ``route`` stage (gradients and aux-loss hooks attached). Another block (a schedule may gate its ESP
    group's blocks) goes through the same router under ``no_grad``, which skips Megatron's side effects (aux and
    z losses, their trackers, expert-bias counts) and, with no random router option on, gives exactly the
    routing the block's owner made."""

    router: torch.nn.Module
    x_SM: torch.Tensor
    own: Routing

    def __call__(self, x_SM: torch.Tensor) -> Routing:
        if x_SM is self.x_SM or (x_SM.shape == self.x_SM.shape and torch.equal(x_SM, self.x_SM)):
            return self.own
        with torch.no_grad():
            probs_SE, map_SE = self.router(x_SM.unsqueeze(1))
        return routing_from_megatron(probs_SE, map_SE, self.own.capacity)


# ---- Megatron's experts as the core's experts callable ----------------------------------------------------

def _run_experts(experts: torch.nn.Module, x_ElNM: torch.Tensor) -> torch.Tensor:
    """Megatron's expert module (SequentialMLP, GroupedMLP, TEGroupedMLP) on rows grouped per local expert,
    with a per-token scale of one (the schedule's combine applies the routing weights)."""
    e_l, n, m = x_ElNM.shape
    x_RM = x_ElNM.reshape(e_l * n, m)
    tokens_per_expert = torch.full((e_l,), n, dtype=torch.long)      # host tensor, as Megatron's dispatchers pass it
    y_RM, bias = experts(x_RM, tokens_per_expert, x_RM.new_ones(e_l * n))
    if bias is not None:
        raise ValueError("Megatron's experts returned a separate bias; the plugin supports experts that add it")
    return y_RM.reshape(e_l, n, y_RM.shape[-1])


def _run_expert_rows(experts: torch.nn.Module, x_RM: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """Megatron's expert module on rows grouped per local expert with ``counts`` rows each (no padding), as
    its dispatchers call it: the ragged exchange's kept rows only."""
    y_RM, bias = experts(x_RM, torch.tensor(counts, dtype=torch.long), x_RM.new_ones(x_RM.shape[0]))
    if bias is not None:
        raise ValueError("Megatron's experts returned a separate bias; the plugin supports experts that add it")
    return y_RM


def megatron_experts(x_ElNM: torch.Tensor, *, experts: torch.nn.Module, esp: Group, rec: Recorder,
                     run: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = _run_experts) -> torch.Tensor:
    """The core's experts contract: this rank's expert shard (``run(experts, x_ElNM)``: Megatron's expert module, or
    Lancet's deferred form of it), ESP partial sums all-reduced (input gradient all-reduced in backward). Megatron's
    expert linears do no communication here (``explicit_expert_comm``)."""
    return comm.all_reduce(run(experts, comm.copy_to(x_ElNM, esp, rec)), esp, rec)


@dataclass(frozen=True)
class HostLayerParams(LayerParams):
    """LayerParams plus the un-reduced expert partials, for schedules that reduce over ESP themselves (Parm)."""

    partial_experts: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


# ---- the dispatcher: Megatron's stage interface over a schedule --------------------------------------------

@dataclass(frozen=True)
class _Pass:
    """One forward's state, from preprocess to postprocess (Megatron's dispatchers keep theirs on self too)."""

    hidden_shape: torch.Size
    params: LayerParams
    dispatched: Any          # schedules.Dispatched at degree 1, else None


def find_profile(profile_dir: Optional[str], layout: ParallelLayout) -> Optional[CostProfile]:
    """The cost profile ``moe-plugins profile`` cached for ``layout`` on this backend and device (or None)."""
    if profile_dir is None:
        return None
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return cached_profile(profile_dir, layout, dist.get_backend(), device)


def schedule_class(name: str, profile: Optional[CostProfile], dtype: torch.dtype, mp: int) -> Type[Schedule]:
    """The schedule's class (:meth:`Registry.host_schedule_class`, logged on this host's logger)."""
    return default_registry().host_schedule_class(name, profile, torch.empty((), dtype=dtype).element_size(), mp,
                                                  logger)


class ScheduleTokenDispatcher(MoETokenDispatcher):
    """Megatron's token-dispatcher interface run by a project schedule (see the module docstring)."""

    def __init__(self, config: Any, pg_collection: Any, *, groups: MoEProcessGroups, plugin: PluginConfig,
                 router: torch.nn.Module, experts: torch.nn.Module, ledger: Optional[CommLedger], name: str,
                 profile: Optional[CostProfile] = None, engine: Optional[CommEngine] = None, lancet: Any = None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.groups, self.plugin, self.ledger, self.stock_groups = groups, plugin, ledger, groups
        self.router, self.experts = router, experts
        self.moe_config = moe_config(facts_from_config(config))
        self.engine = engine               # pipelined: the caller's (PluginMoELayer checked there is one)
        self.lane = build_executor(plugin.pipeline_degree, profile, self.engine)
        self.degree = self.lane.degree
        cls = with_exchange(schedule_class(plugin.schedule, profile, config.params_dtype, groups.mp.size),
                            plugin.exchange, plugin.pipeline_degree)
        problems = megatron_hecate.expert_problems(config, experts, name) if cls.needs_expert_weights else []
        if lancet is not None:
            from moe_plugins.patches.megatron_lancet import expert_problems
            problems += expert_problems(config, experts, name, groups.esp.size)
        if problems:                       # what Hecate's copies or Lancet's deferral cannot run, all at once
            raise ValueError("; ".join(problems))
        cls = megatron_hecate.hecate_class(plugin, cls, config)
        self.lancet = lancet               # megatron_lancet.LancetState: the experts' dW deferred, run behind exchanges
        self.overlap = lancet.overlap(name) if lancet is not None else None
        self.rec = Recorder(ledger, name, self.engine, schedule=cls.name, while_in_flight=self.overlap)
        self.schedule: Schedule = cls(self.moe_config, groups, self.rec)
        self._pass: Optional[_Pass] = None
        self.expert_weights = partial(megatron_hecate.layer_weights, experts)   # Hecate's (pooled: set by the layer)

    @property
    def _pipelined(self) -> bool:
        return self.degree != 1

    def rename(self, name: str) -> None:
        """Ledger name of the layer (Megatron numbers layers after building them). The schedule object stays
        the same: PipeMoE's lane keeps one twin per schedule object."""
        self.rec = self.schedule.rec = Recorder(self.ledger, name, self.engine, schedule=type(self.schedule).name,
                                                while_in_flight=self.overlap)

    def expert_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The core's experts contract on Megatron's experts (their dW deferred with Lancet), ESP reduction included."""
        run = _run_experts
        if self.lancet is not None:
            from moe_plugins.patches.megatron_lancet import deferred_local_experts
            run = partial(deferred_local_experts, config=self.config, queue=self.lancet.queue, layer=self.rec.layer)
        return partial(megatron_experts, experts=self.experts, esp=self.groups.esp, rec=self.rec, run=run)

    def _params(self, x_SM: torch.Tensor, own: Routing) -> LayerParams:
        esp = self.groups.esp
        experts = self.expert_call()
        rows = partial(_run_expert_rows, self.experts) if esp.size == 1 and self.lancet is None else None
        weights = self.expert_weights() if self.schedule.needs_expert_weights else None
        return HostLayerParams(router=MegatronRouting(self.router, x_SM, own), experts=experts,
                               partial_experts=partial(_run_experts, self.experts), row_experts=rows,
                               expert_weights=weights)

    def routing(self, probs_SE: torch.Tensor, map_SE: torch.Tensor) -> Routing:
        """Megatron's router outputs for this rank's tokens as the core's Routing (its capacity agreed if dropless,
        over the stock EP group: Lina's packing keeps it when the schedule moves to a packed layout's groups)."""
        return routing_from_megatron(probs_SE, map_SE, block_capacity(map_SE, self.config, self.stock_groups,
                                                                      self.rec))

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        x_SM = hidden_states.reshape(-1, hidden_states.shape[-1])
        own = self.routing(probs, routing_map)
        params = self._params(x_SM, own)
        if self._pipelined:
            self._pass = _Pass(hidden_states.shape, params, None)
            return x_SM, probs
        dispatched = self.schedule.prepare(x_SM, params)
        self._pass = _Pass(hidden_states.shape, params, dispatched)
        return dispatched.d, probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self._pipelined:
            return hidden_states, probs
        return self.schedule.exchange_in(hidden_states), probs

    def expert_stage(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Between dispatch and combine: the schedule's expert step, or at degree r > 1 the whole pipelined
        chunk loop (prepare, r x (exchange_in, expert, exchange_out), finish)."""
        st = self._pass
        if self._pipelined:
            y_SM, _ = run_pipelined(self.schedule, hidden_states, st.params, self.degree, self.lane)
            return y_SM
        return self.schedule.expert(hidden_states, st.params)

    def token_combine(self, hidden_states: torch.Tensor):
        if self._pipelined:
            return hidden_states
        return self.schedule.exchange_out(hidden_states)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        st, self._pass = self._pass, None
        y_SM = hidden_states if self._pipelined else self.schedule.mark_combine(
            self.schedule.finish(hidden_states, st.dispatched))
        return y_SM.view(st.hidden_shape)

    def dispatch_postprocess(self, hidden_states, probs):
        raise RuntimeError("the plugin's expert step runs in PluginMoELayer.routed_experts_compute")

    def combine_preprocess(self, hidden_states):
        raise RuntimeError("the plugin's expert step runs in PluginMoELayer.routed_experts_compute")


# ---- the layer ---------------------------------------------------------------------------------------------

def host_layer_kwargs(is_mtp_layer: bool, name: Optional[str]) -> dict:
    """The keywords of megatron-core >= 0.18's ``MoELayer`` that were given (0.16.1's takes neither; its
    TransformerLayer passes neither)."""
    return {**({"is_mtp_layer": True} if is_mtp_layer else {}), **({"name": name} if name is not None else {})}


class PluginMoELayer(MoELayer):
    """Megatron's ``MoELayer`` (router, experts, shared experts, parameter names and attributes unchanged) whose
    token movement is a project schedule. Build it from :func:`moe_plugins.patches.megatron.get_moe_module_spec`.

    Process groups: ``pg_collection`` when given (Megatron 0.16.1's TransformerLayer passes it only to the exact
    MoELayer class, so the spec carries it in ``groups``; 0.19.2's passes it to every MLP builder), else
    ``groups.pg_collection``, else Megatron's ``parallel_state`` groups, as the stock layer does. ``is_mtp_layer``
    and ``name`` (megatron-core >= 0.18's TransformerLayer passes them) go to Megatron's ``MoELayer`` as given.
    Everything is validated before anything is built.
    Engines: the layer never builds process groups. A pipeline degree other than 1 needs an engine with a
    pipeline lane: ``engine``, or ``engines`` (:class:`~moe_plugins.patches.megatron_engines.LayoutEngines`, one
    per layout, which :func:`~moe_plugins.patches.megatron.enable` owns), or ``lina``: the enabled plugin's
    :class:`~moe_plugins.patches.megatron_lina.LinaState`, whose engine (one per layout, shared with the gradient
    reducer) the layer's exchanges then go through. ``resharding``: the enabled plugin's
    :class:`~moe_plugins.patches.megatron_hecate_reshard.MegatronResharding`, which the layer joins."""

    def __init__(self, config: Any, submodules: Optional[MoESubmodules] = None, layer_number: Optional[int] = None,
                 pg_collection: Any = None, *, plugin: PluginConfig, groups: Optional[MegatronGroups] = None,
                 ranks_per_node: Optional[int] = None, ledger: Optional[CommLedger] = None,
                 profile_dir: Optional[str] = None, engine: Optional[CommEngine] = None, lina: Any = None,
                 engines: Any = None, is_mtp_layer: bool = False, name: Optional[str] = None, lancet: Any = None,
                 resharding: Any = None):
        plugin = megatron_hecate.hecate_plugin(plugin)       # an enabled hecate section: schedule 'hecate'
        if pg_collection is None:
            pg_collection = groups.pg_collection if groups is not None else parallel_state_collection()
        profile_dir = profile_dir if profile_dir is not None else str(default_cache_dir())
        lookup = partial(find_profile, profile_dir)
        early = lane_on(plugin)       # Hecate's early gather and re-gather, Lancet's exchanges: on the pipeline lane
        lane = needs_lane(plugin.pipeline_degree) or lancet is not None or early
        layout = self._check(config, plugin, pg_collection, groups, ranks_per_node, lookup, lane=lane,
                             has_engine=engine is not None or engines is not None or lina is not None)
        plugin = settled_degree(plugin, layout)          # a degree word is 1 where the layout exchanges nothing
        lane = needs_lane(plugin.pipeline_degree) or lancet is not None or early
        layout_groups = groups_from_pg_collection(pg_collection, layout)
        if lina is not None and engine is None:      # Lina (patches/megatron_lina.py): the layout's shared engine
            engine = lina.engine_for(layout_groups, token_view(layout_groups), lookup)
        elif engines is not None and engine is None and lane:
            engine = engines.engine_for(token_view(layout_groups))
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                         **host_layer_kwargs(is_mtp_layer, name))
        self.plugin = plugin
        self.lancet_parts = lancet.partitions if lancet is not None else None      # Lancet's batch partitions
        if lancet is not None and not lancet.defer:
            lancet = None                  # partitions only: the experts' dW stay stock
        self.moe_groups = token_view(layout_groups)
        self.token_dispatcher = ScheduleTokenDispatcher(
            config, pg_collection, groups=self.moe_groups, plugin=plugin, router=self.router, experts=self.experts,
            ledger=ledger, name=self._ledger_name(layer_number), engine=engine, lancet=lancet,
            profile=lookup(self.moe_groups.layout)
            if degree_needs_profile(plugin.pipeline_degree) or default_registry().is_profiled(plugin.schedule)
            else None)
        log = logger.info if dist.get_rank() == 0 else logger.debug
        log("moe_plugins: Megatron MoE layer %s runs schedule %r (%s exchange, pipeline degree %s) on tp=%d ep=%d "
            "etp=%d, ranks_per_node=%d", self._ledger_name(layer_number), plugin.schedule, plugin.exchange,
            plugin.pipeline_degree, layout.mp, layout.ep, layout.esp, layout.ranks_per_node)
        if resharding is not None:     # Hecate's re-sharding (patches/megatron_hecate_reshard.py) moves its experts
            resharding.add(self)
            self.token_dispatcher.expert_weights = partial(megatron_hecate.layer_weights, self.experts,
                                                           partial(resharding.slots_of, self))

    @staticmethod
    def _check(config: Any, plugin: PluginConfig, pg_collection: Any, groups: Optional[MegatronGroups],
               ranks_per_node: Optional[int], profile: ProfileLookup, *, has_engine: bool,
               lane: bool = False) -> ParallelLayout:
        world, rank = dist.get_world_size(), dist.get_rank()
        rpn = plugin.ranks_per_node or (groups.layout.ranks_per_node if groups is not None else None) \
            or ranks_per_node or world
        facts = facts_from_config(config)
        problems = plugin_problems(facts, plugin, world=world, ranks_per_node=rpn, profile=profile)
        if not has_engine and (lane or needs_lane(plugin.pipeline_degree)):
            problems.append(f"pipeline_degree ({plugin.pipeline_degree!r}) runs on an engine's pipeline lane, which "
                            "the layer does not build: pass engines=LayoutEngines() (patches.megatron_engines) to "
                            "get_moe_module_spec, or engine=build_engine(token_view(groups), pipeline=True), or "
                            "build the model under enable()")
        if not problems:
            layout = ParallelLayout(world=world, ranks_per_node=rpn, mp=facts.tp, ep=facts.ep, esp=facts.etp)
            problems = pg_collection_problems(pg_collection, layout, rank)
        if problems:
            raise ValueError("moe_plugins cannot run this Megatron MoE layer: " + "; ".join(problems))
        return layout

    @staticmethod
    def _ledger_name(layer_number: Optional[int]) -> str:
        return "megatron.moe" if layer_number is None else f"megatron.moe.{layer_number}"

    def set_layer_number(self, layer_number: int) -> None:
        super().set_layer_number(layer_number)
        self.token_dispatcher.rename(self._ledger_name(layer_number))

    def prefetch(self) -> None:
        """The schedule's work before the router (Hecate's early gather: patches/megatron_hecate_early.py), from
        the forward pre-hook of the block holding the layer."""
        if self.token_dispatcher.schedule.needs_expert_weights:
            with torch.no_grad():
                self.token_dispatcher.schedule.prefetch(self.token_dispatcher.expert_weights())

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """Megatron's forward, or, while Lancet's block executor has its request armed, the partitioned call
        (patches/megatron_lancet_parts.py)."""
        parts = self.lancet_parts
        if parts is not None and self.training:
            parts.check_covered(self)
            if parts.request.armed:
                return parts.forward(self, hidden_states, *args, **kwargs)
        return super().forward(hidden_states, *args, **kwargs)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Megatron's stage between dispatch and combine: the schedule's expert step (Megatron's experts, ESP
        reduction included). Returns ``(output, None)`` as the stock method does."""
        return self.token_dispatcher.expert_stage(hidden_states), None
