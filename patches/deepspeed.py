"""DeepSpeed host adapter: ``deepspeed.moe.layer.MoE`` layers run the project's schedules, with DeepSpeed's own
gate (routing stays DeepSpeed's) and DeepSpeed's own expert modules (state_dict keys and the expert parameters'
``allreduce=False`` / ``group_name`` attributes stay DeepSpeed's).

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

Everything is patched by :func:`enable` and restored by :meth:`DeepSpeedPlugin.disable` (the functions are put
back as the identical objects, and DeepSpeed's group registry as it was). Validation runs before any patch.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist

from moe_plugins.core import comm
from moe_plugins.core.comm import Recorder
from moe_plugins.core.config import MoEConfig, moe_config_problems
from moe_plugins.core.experts import ExpertWeights, ffn_shard, partial_ffn
from moe_plugins.core.gating import Routing
from moe_plugins.core.groups import Group, MoEProcessGroups, build_process_groups
from moe_plugins.core.layout import ParallelLayout, layout_problems
from moe_plugins.core.ledger import CommLedger
from moe_plugins.core.plugin_config import SECTION, PluginConfig, degree_needs_profile, resolve
from moe_plugins.core.profile_ops import profile_key
from moe_plugins.core.schedule import LayerParams, Schedule, run_schedule
from moe_plugins.plugins import default_registry

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
_REGISTRY = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
             "_EXPERT_DATA_PARALLEL_GROUP_RANKS")

_ACTIVE: Optional["DeepSpeedPlugin"] = None   # the one enabled plugin, so that disable() can restore DeepSpeed


# ---- pure translation of DeepSpeed's objects into the core's -------------------------------------------

def routing_from_gate(gate_out: Tuple[Any, ...]) -> Routing:
    """DeepSpeed's sparse gate output ``(l_aux, C, E, indices_KS, locations_KS, gates_KS, exp_counts_E)``
    (``TopKGate.forward(x, used_token, sparse_routes=True)``; a dropped route has index -1) as a Routing."""
    l_aux, cap, _num_experts, indices_KS, locations_KS, gates_KS, exp_counts_E = gate_out
    kept_KS = indices_KS >= 0
    expert_SK = indices_KS.clamp(min=0).long().t()
    slot_SK = torch.where(kept_KS, locations_KS.long(), torch.full_like(locations_KS, -1, dtype=torch.long)).t()
    return Routing(expert_SK=expert_SK, slot_SK=slot_SK, weight_SK=gates_KS.t(), capacity=int(cap),
                   aux_loss=l_aux, exp_counts_E=exp_counts_E)


def gate_router(gate: torch.nn.Module, used_token: Optional[torch.Tensor], x_SM: torch.Tensor) -> Routing:
    """The core's router contract met by DeepSpeed's own TopKGate (its RNG draws, capacity and dropless
    all-reduce over the EP group included)."""
    return routing_from_gate(gate(x_SM, used_token, True, False))


class GateReplay:
    """DeepSpeed's gate, called once per token block of one forward, every call from the same RNG state.

    A schedule may gate several blocks (the baseline gates its ESP group's blocks). Each call starts from the
    state the first call saw, so a block is routed with the random numbers (RTS, jitter, top-2 sampling) the
    stock layer would draw for it, and the generator ends where one stock gate call leaves it."""

    def __init__(self, gate: torch.nn.Module, used_token: Optional[torch.Tensor]):
        self.gate, self.used_token, self.state = gate, used_token, None

    def __call__(self, x_SM: torch.Tensor) -> Routing:
        rng = torch if x_SM.device.type == "cpu" else getattr(torch, x_SM.device.type)
        args = () if x_SM.device.type == "cpu" else (x_SM.device,)
        if self.state is None:
            self.state = rng.get_rng_state(*args)
        else:
            rng.set_rng_state(self.state, *args)
        return gate_router(self.gate, self.used_token, x_SM)


def host_experts(experts: torch.nn.Module, ep: int, x_ElRM: torch.Tensor) -> torch.Tensor:
    """The core's experts contract met by DeepSpeed's ``Experts`` module. Rows arrive per local expert,
    source-major (R = P * C); DeepSpeed's experts take (P, E_l, C, M), so they see the shapes they see in
    stock DeepSpeed. Their own tensor parallelism (the ESP reduction) happens inside the user's modules."""
    e_l, rows, model_dim = x_ElRM.shape
    x_PElCM = x_ElRM.reshape(e_l, ep, rows // ep, model_dim).transpose(0, 1).contiguous()
    y_PElCM = experts(x_PElCM)
    return y_PElCM.transpose(0, 1).reshape(e_l, rows, model_dim)


_FFN_ACTIVATIONS = {torch.nn.GELU: "gelu", torch.nn.ReLU: "relu", torch.nn.SiLU: "silu"}


def ffn_activation(expert: torch.nn.Module, hidden: int) -> Optional[str]:
    """The activation's name when ``expert`` is ``nn.Sequential(nn.Linear(M, H), GELU|ReLU|SiLU, nn.Linear(H, M))``,
    the form the plugin can slice along H itself (esp > 1 without DeepSpeed's expert tensor parallelism)."""
    if not isinstance(expert, torch.nn.Sequential) or len(expert) != 3:
        return None
    fc1, act, fc2 = expert
    if type(fc1) is not torch.nn.Linear or type(fc2) is not torch.nn.Linear:
        return None
    if fc1.in_features != hidden or fc2.out_features != hidden or fc1.out_features != fc2.in_features:
        return None
    if isinstance(act, torch.nn.GELU) and act.approximate != "none":
        return None
    return _FFN_ACTIVATIONS.get(type(act))


def sliced_experts(experts: torch.nn.ModuleList, esp: Group, rec: Recorder, activation: str,
                   x_ElRM: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's full FFN experts computed H-sliced over the ESP group: this member computes its slice H_s of
    every local expert from the full parameters (views, so gradients land in the slice), the partial sums are
    all-reduced, b2 is added with its gradient divided by N_ESP. The members see the same rows, so DeepSpeed's
    sum over the replicas (ESP x expert-DP, the group registered as expert-DP) is the full gradient."""
    fc1s, fc2s = [e[0] for e in experts], [e[2] for e in experts]
    h = ffn_shard(esp.rank, fc1s[0].out_features, esp.size)
    w = ExpertWeights(w1_EMH=torch.stack([f.weight[h].t() for f in fc1s]),
                      b1_EH=torch.stack([_bias(f)[h] for f in fc1s]),
                      w2_EHM=torch.stack([f.weight[:, h].t() for f in fc2s]),
                      b2_EM=torch.stack([_bias(f) for f in fc2s]))
    x_ElRM = comm.copy_to(x_ElRM, esp, rec)
    y_ElRM = comm.all_reduce(partial_ffn(x_ElRM, w, activation), esp, rec)
    return y_ElRM + comm.grad_scale(w.b2_EM, 1.0 / esp.size).unsqueeze(1)


def _bias(linear: torch.nn.Linear) -> torch.Tensor:
    return linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)


def replica_groups(layout: ParallelLayout) -> List[Tuple[int, ...]]:
    """The ranks that hold the same local experts (the same EP index): the ESP group times the expert-DP group."""
    return [tuple(r for r in range(layout.world) if layout.coords(r)["ep"] == e) for e in range(layout.ep)]


def expert_ffn_width(expert: torch.nn.Module, hidden: int, esp_sharded: int) -> int:
    """H of one expert, read from its first 2-D weight that takes M inputs (nn.Linear stores (H, M)), times the
    tensor-parallel degree the expert is already sharded by. Raises when no such weight exists."""
    for p in expert.parameters():
        if p.dim() == 2 and p.shape[1] == hidden:
            return int(p.shape[0]) * esp_sharded
    raise ValueError(f"cannot read the expert FFN width H: no 2-D weight of the expert takes M={hidden} inputs")


def _common(values: List[Optional[str]]) -> Optional[str]:
    return values[0] if values and all(v == values[0] for v in values) else None


@dataclass(frozen=True)
class HostLayerFacts:
    """What the adapter reads from one DeepSpeed MoE layer and the host's mpu, once, at setup."""

    name: str
    hidden: int
    num_experts: int
    ep: int
    k: int
    capacity_factor: float
    min_capacity: int
    drop_tokens: bool
    expert_tp: bool          # enable_expert_tensor_parallelism under an mpu
    tp: int                  # mpu's tensor-parallel degree (1 without mpu)
    pp: int                  # mpu's pipeline degree
    tp_ranks: Tuple[int, ...]
    use_tutel: bool
    ffn: int
    ffn_activation: Optional[str] = None   # set when every local expert is a plain FFN the plugin can slice

    @property
    def host_esp(self) -> int:
        """The degree DeepSpeed itself shards the experts by (its expert tensor parallelism)."""
        return self.tp if self.expert_tp else 1


def layer_problems(facts: HostLayerFacts, cfg: PluginConfig, world: int, rank: int, ranks_per_node: int,
                   use_data_before_expert_parallel: bool) -> List[str]:
    """Every reason the plugin cannot run this layer, each naming the setting and its value (empty when fine)."""
    host_esp = facts.host_esp
    esp = cfg.esp if cfg.esp is not None else host_esp
    problems = []
    if use_data_before_expert_parallel:
        problems.append("ds_config use_data_before_expert_parallel_ (true) is not supported: the plugin's layout "
                        "places EP inside the expert-DP blocks")
    if facts.use_tutel:
        problems.append("use_tutel (true) is not supported: the schedules replace Tutel's dispatcher")
    if facts.pp > 1:
        problems.append(f"pipeline parallel degree ({facts.pp}) must be 1: the plugin's layout has no PP axis")
    if esp != host_esp and host_esp > 1:
        problems.append(f"{SECTION}.esp ({esp}) must equal the tensor-parallel degree ({host_esp}) that "
                        "enable_expert_tensor_parallelism shards this layer's expert modules by")
    elif esp != host_esp and facts.ffn_activation is None:
        problems.append(f"{SECTION}.esp ({esp}) > 1 without DeepSpeed's expert tensor parallelism needs every "
                        "expert to be nn.Sequential(nn.Linear(M, H), nn.GELU()|nn.ReLU()|nn.SiLU(), nn.Linear(H, M)), "
                        "which the plugin slices along H; this layer's experts are not")
    registry = default_registry()
    needs_partials = cfg.schedule in registry.schedule_names() and \
        registry.schedule_class(cfg.schedule).needs_expert_partials
    if host_esp > 1 and esp == host_esp and needs_partials:
        allowed = [n for n in registry.schedule_names() if not registry.schedule_class(n).needs_expert_partials]
        problems.append(f"{SECTION}.schedule ({cfg.schedule!r}) cannot run with DeepSpeed's expert tensor "
                        f"parallelism (esp {host_esp}): its local combine needs the experts' partial sums, and "
                        "enable_expert_tensor_parallelism's expert modules all-reduce inside themselves; allowed "
                        f"here: {', '.join(repr(n) for n in allowed)}")
    problems += layout_problems(world, ranks_per_node, facts.tp, facts.ep, esp)
    if problems:
        return problems
    layout = ParallelLayout(world=world, ranks_per_node=ranks_per_node, mp=facts.tp, ep=facts.ep, esp=esp)
    if facts.tp > 1 and facts.tp_ranks != layout.group_of("mp", rank):
        problems.append(f"the mpu's tensor-parallel group of rank {rank} {list(facts.tp_ranks)} must be the "
                        f"contiguous block {list(layout.group_of('mp', rank))} (Megatron's rank order)")
    problems += moe_config_problems(moe_config(facts), layout) + registry.schedule_problems(cfg.schedule, layout)
    return problems


def moe_config(facts: HostLayerFacts) -> MoEConfig:
    return MoEConfig(hidden=facts.hidden, ffn=facts.ffn, num_experts=facts.num_experts, k=facts.k,
                     capacity_factor=facts.capacity_factor, min_capacity=facts.min_capacity,
                     drop_tokens=facts.drop_tokens)


# ---- one swapped layer ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class SwappedLayer:
    """A DeepSpeed MOELayer that runs a schedule: what it runs and on which groups."""

    name: str
    schedule: Schedule
    groups: MoEProcessGroups
    pipeline_degree: Any            # 1, an int > 1 or a pipemoe.AutoDegree
    lane: Any = None                # the pipemoe.runner.Pipelined executor when pipeline_degree != 1
    slice_activation: Optional[str] = None   # set: the plugin slices DeepSpeed's FFN experts over ESP

    def experts(self, layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.slice_activation is None:
            return partial(host_experts, layer.experts, self.groups.ep.size)
        return partial(sliced_experts, layer.experts.deepspeed_experts, self.groups.esp, self.schedule.rec,
                       self.slice_activation)

    def forward(self, layer: torch.nn.Module, x: torch.Tensor, used_token: Optional[torch.Tensor]) -> torch.Tensor:
        if used_token is not None and self.groups.esp.size > 1:
            raise ValueError(f"MoE layer {self.name}: used_token is not supported with esp ({self.groups.esp.size})"
                             " > 1, where a schedule may gate other ranks' token blocks")
        timed = getattr(layer, "wall_clock_breakdown", False)
        if timed:
            layer.timers("moe").start()
        x_SM = x.reshape(-1, x.shape[-1])
        params = LayerParams(router=GateReplay(layer.gate, used_token), experts=self.experts(layer))
        if self.pipeline_degree == 1:
            y_SM, dispatched = run_schedule(self.schedule, x_SM, params)
        else:
            from moe_plugins.pipemoe.runner import run_pipelined
            y_SM, dispatched = run_pipelined(self.schedule, x_SM, params, self.pipeline_degree, self.lane)
        layer.l_aux, layer.exp_counts = dispatched.aux_loss, dispatched.exp_counts_E
        if timed:
            layer.timers("moe").stop()
            layer.time_moe = layer.timers("moe").elapsed(reset=False)
        return y_SM.reshape(x.shape)


@dataclass(frozen=True)
class _HostGroups:
    """The project's groups of one layout, plus the process groups DeepSpeed's registry gets for EP and
    expert-DP (real groups even of size 1: DeepSpeed asks them for ranks)."""

    groups: MoEProcessGroups
    ep_pg: Any
    expert_dp_pg: Any
    expert_dp_ranks: Tuple[int, ...]


# ---- the plugin ----------------------------------------------------------------------------------------

class DeepSpeedPlugin:
    """The state of one :func:`enable`: the originals to restore, the swapped layers, the groups built.
    Use as a context manager, or call :meth:`disable`."""

    def __init__(self, config: Optional[PluginConfig], *, ledger: Optional[CommLedger], ranks_per_node: Optional[int],
                 profile_dir: Optional[str]):
        self.config, self.ledger, self.ranks_per_node, self.profile_dir = config, ledger, ranks_per_node, profile_dir
        self.swaps: List[Dict[str, Any]] = []                    # one record per swapped layer, in setup order
        self._layers: "weakref.WeakKeyDictionary[torch.nn.Module, SwappedLayer]" = weakref.WeakKeyDictionary()
        self._originals: Dict[Tuple[type, str], Tuple[bool, Any]] = {}
        self._built: Dict[ParallelLayout, MoEProcessGroups] = {}
        self._groups: Dict[Tuple[ParallelLayout, bool], _HostGroups] = {}
        self._lanes: Dict[ParallelLayout, Any] = {}
        self._singletons: Optional[List[Any]] = None
        self._own_pgs: List[Any] = []                           # process groups built here that this rank is in
        self._registered: List[str] = []
        self._etp_before: Optional[int] = None
        self._engine_config: Optional[PluginConfig] = None
        self._names: Dict[int, str] = {}
        self._ds: Any = None

    # -- patching --------------------------------------------------------------------------------------

    def _install(self, ds) -> None:
        """Replace every hook; if one fails, put back those already replaced."""
        self._ds = ds
        try:
            for hook, factory in HOOKS.items():
                cls, original = ds.owner(hook)
                self._originals[(cls, hook[2])] = (hook[2] in cls.__dict__, original)
                setattr(cls, hook[2], getattr(self, factory)(original))
        except BaseException:
            self._restore_functions()
            self._ds = None
            raise

    def _restore_functions(self) -> None:
        try:
            for (cls, name), (owned, value) in self._originals.items():
                if owned:
                    setattr(cls, name, value)
                else:
                    delattr(cls, name)
        finally:
            self._originals.clear()

    def _restore_registry(self) -> None:
        groups = self._ds.groups
        try:
            for name in self._registered:
                for attr in _REGISTRY:
                    getattr(groups, attr).pop(name, None)
            if self._etp_before is not None:
                groups.expert_tensor_parallel_world_size = self._etp_before
        finally:
            self._registered.clear()
            self._etp_before = None

    def disable(self) -> None:
        """Restore DeepSpeed: the patched functions (identical objects) and its group registry, and destroy the
        process groups the plugin built. An engine set up under the plugin needs it enabled for as long as it
        trains. Collective when the plugin built groups: every rank disables."""
        global _ACTIVE
        if self._ds is None:
            return
        try:
            self._restore_functions()
        finally:
            try:
                self._restore_registry()
            finally:
                self._free_groups()
                self._layers.clear()
                self._ds = None
                if _ACTIVE is self:
                    _ACTIVE = None
        if self.swaps:
            logger.info("moe_plugins: DeepSpeed restored; %d MoE layer(s) had run the plugin", len(self.swaps))
        else:
            logger.warning("moe_plugins: DeepSpeed restored; the plugin matched no MoE layer while enabled (were "
                           "the layers set up before enable(), or did the ds_config lack a %r section?)", SECTION)

    def built_process_groups(self) -> List[Any]:
        """The process groups this rank is in that the plugin built (its layouts' groups, DeepSpeed's expert-DP
        replicas, singletons; not the pipeline lanes'). :meth:`disable` destroys them."""
        pgs = [g.pg for groups in self._built.values() for g in groups.by_kind().values() if g.pg is not None]
        return list({id(pg): pg for pg in pgs + self._own_pgs}.values())

    def _free_groups(self) -> None:
        """Close the pipeline lanes and destroy every process group the plugin built (gloo keeps threads per
        group). Every rank disables in the same order, as every rank built them in the same order."""
        for lane in self._lanes.values():
            lane.close()
        if dist.is_initialized():                    # the job may have torn down the default group already
            for pg in self.built_process_groups():
                dist.destroy_process_group(pg)
        self._lanes.clear()
        self._groups.clear()
        self._built.clear()
        self._own_pgs.clear()
        self._singletons = None

    @property
    def active(self) -> bool:
        return self._ds is not None

    def __enter__(self) -> "DeepSpeedPlugin":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    # -- the replacements ------------------------------------------------------------------------------

    def _patched_configure(self, original: Callable) -> Callable:
        plugin = self

        def _configure_distributed_model(engine, model):
            section = getattr(engine._config, "_param_dict", {}).get(SECTION)
            found = None if section is None else PluginConfig.from_dict(section, SECTION,
                                                                            schedules=default_registry().schedule_names())
            if plugin.config is not None and found is not None and found != plugin.config:
                raise ValueError(f"the ds_config {SECTION!r} section {found.to_dict()} conflicts with the config "
                                 f"given to moe_plugins.enable {plugin.config.to_dict()}")
            names = {id(m): n or "<root>" for n, m in model.named_modules()}
            previous = (plugin._engine_config, plugin._names)
            plugin._engine_config, plugin._names = found, names
            try:
                return original(engine, model)
            finally:
                plugin._engine_config, plugin._names = previous

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
            plugin._swap(moe, cfg, use_data_before_expert_parallel_)

        _create_process_groups.__wrapped__ = original
        return _create_process_groups

    def _patched_forward(self, original: Callable) -> Callable:
        plugin = self

        def forward(layer, *inputs, **kwargs):
            swapped = plugin._layers.get(layer)
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
            ffn_activation=_common([ffn_activation(e, hidden) for e in layer.experts.deepspeed_experts]))

    def _swap(self, moe, cfg: PluginConfig, use_data_before_expert_parallel: bool) -> None:
        """Validate, build (or reuse) the layout's groups, register them with DeepSpeed, swap the layer."""
        facts = self._facts(moe)
        world, rank = dist.get_world_size(), dist.get_rank()
        rpn = cfg.ranks_per_node or self.ranks_per_node or world
        problems = layer_problems(facts, cfg, world, rank, rpn, use_data_before_expert_parallel)
        if problems:
            raise ValueError(f"moe_plugins cannot run DeepSpeed MoE layer {facts.name}: " + "; ".join(problems))
        esp = cfg.esp if cfg.esp is not None else facts.host_esp
        sliced = esp != facts.host_esp
        layout = ParallelLayout(world=world, ranks_per_node=rpn, mp=facts.tp, ep=facts.ep, esp=esp)
        host = self._host_groups(layout, sliced)
        degree, lane = self._pipeline(cfg.pipeline_degree, layout, host.groups, moe)
        ep_pg = self._register(moe.expert_group_name, host)
        if facts.expert_tp:
            if self._etp_before is None:
                self._etp_before = self._ds.groups.expert_tensor_parallel_world_size
            self._ds.groups.expert_tensor_parallel_world_size = esp
        moe.deepspeed_moe._set_ep_group(ep_pg)
        schedule = self._schedule_class(cfg.schedule, layout, moe)(moe_config(facts), host.groups,
                                                                  Recorder(self.ledger, facts.name,
                                                                           self._lanes.get(layout)))
        self._layers[moe.deepspeed_moe] = SwappedLayer(
            name=facts.name, schedule=schedule, groups=host.groups, pipeline_degree=degree, lane=lane,
            slice_activation=facts.ffn_activation if sliced else None)
        record = {"layer": facts.name, "schedule": cfg.schedule, "pipeline_degree": cfg.pipeline_degree,
                  "mp": layout.mp, "ep": layout.ep, "esp": layout.esp, "num_experts": facts.num_experts, "k": facts.k,
                  "experts_sliced_by_plugin": sliced, "expert_dp_ranks": list(host.expert_dp_ranks)}
        self.swaps.append(record)
        log = logger.info if rank == 0 else logger.debug
        log("moe_plugins: DeepSpeed MoE layer %s (E=%d, k=%d) runs schedule %r, pipeline_degree %s, on layout "
            "mp=%d ep=%d esp=%d ranks_per_node=%d%s", facts.name, facts.num_experts, facts.k, cfg.schedule,
            cfg.pipeline_degree, layout.mp, layout.ep, layout.esp, rpn,
            " (the plugin slices DeepSpeed's FFN experts along H)" if sliced else "")

    def _cached_profile(self, layout: ParallelLayout, moe):
        """The cost profile ``moe-plugins profile`` cached for this layout, backend and device (or None)."""
        from moe_plugins.core import costmodel
        device = next(moe.parameters()).device
        key = profile_key(layout, dist.get_backend(), device)
        return costmodel.load_cached(self.profile_dir, key) if self.profile_dir else None

    def _schedule_class(self, name: str, layout: ParallelLayout, moe):
        """The schedule's class; ``parm-auto`` / ``parm-tune`` read the profile cached for this layout."""
        registry = default_registry()
        profile = self._cached_profile(layout, moe) if registry.is_profiled(name) else None
        return registry.host_schedule_class(name, profile, next(moe.parameters()).element_size(), layout.mp, logger)

    def _pipeline(self, value: Union[int, str], layout: ParallelLayout, groups: MoEProcessGroups, moe):
        """PipeMoE's degree (``"auto"`` or ``"tune"``: from the cost profile cached for this layout and device)
        and its executor, on one communication engine with a pipeline lane per layout (collective to build)."""
        if value == 1:
            return 1, None
        from moe_plugins.core.engine import build_engine
        from moe_plugins.pipemoe.runner import build_executor
        profile = self._cached_profile(layout, moe) if degree_needs_profile(value) else None
        if layout not in self._lanes:
            self._lanes[layout] = build_engine(groups, pipeline=True)
        executor = build_executor(value, profile, self._lanes[layout])
        return executor.degree, executor

    def _host_groups(self, layout: ParallelLayout, sliced: bool) -> _HostGroups:
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
                    pg = dist.new_group(list(ranks))      # collective, real even at size 1
                    made = (pg, ranks) if rank in ranks else made
                edp_pg, edp_ranks = made
                self._own_pgs.append(edp_pg)
            else:
                edp_pg, edp_ranks = self._real_pg(groups.expert_dp), groups.expert_dp.ranks
            self._groups[(layout, sliced)] = _HostGroups(groups=groups, ep_pg=self._real_pg(groups.ep),
                                                         expert_dp_pg=edp_pg, expert_dp_ranks=tuple(edp_ranks))
        return self._groups[(layout, sliced)]

    def _real_pg(self, group: Group):
        if group.pg is not None:
            return group.pg
        if self._singletons is None:   # collective: the same layouts, hence the same decision, on every rank
            self._singletons = [dist.new_group([r]) for r in range(dist.get_world_size())]
            self._own_pgs.append(self._singletons[dist.get_rank()])
        return self._singletons[dist.get_rank()]

    def _register(self, name: str, host: _HostGroups):
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


def _import_deepspeed() -> _DeepSpeed:
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
    missing += [f"deepspeed.utils.groups.{attr}" for attr in _REGISTRY
                if not isinstance(getattr(groups, attr, None), dict)]
    if missing:
        raise ValueError(f"DeepSpeed {ds.version} lacks the hook points {', '.join(missing)}; moe_plugins' "
                         f"adapter was written against {SUPPORTED_VERSION}")
    if ds.version != SUPPORTED_VERSION:
        logger.warning("moe_plugins: DeepSpeed %s found; the adapter was checked against %s", ds.version,
                       SUPPORTED_VERSION)
    return ds


def _default_ranks_per_node() -> Optional[int]:
    """LOCAL_WORLD_SIZE as torchrun and DeepSpeed's launcher set it, read once at enable (the boundary)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def _profile_dir() -> Optional[str]:
    """Where ``moe-plugins profile`` caches cost profiles (pipeline_degree "auto" or "tune"), read once at enable."""
    try:
        from moe_plugins.core.costmodel import default_cache_dir
    except ImportError:
        return None
    return str(default_cache_dir())


def enable(config: Union[None, PluginConfig, str, os.PathLike, Mapping[str, Any]] = None, *,
           ledger: Optional[CommLedger] = None) -> DeepSpeedPlugin:
    """Patch DeepSpeed so that its MoE layers run the project's schedules; returns the handle (a context
    manager). ``config``: a ds_config (dict or JSON path) with a ``moe_plugins`` section, the section itself,
    a PluginConfig, or None to let each engine's ds_config section decide. Everything is validated before
    anything is patched; a failed enable leaves DeepSpeed untouched."""
    global _ACTIVE
    resolved = resolve(config, schedules=default_registry().schedule_names())
    if _ACTIVE is not None:
        raise ValueError("moe_plugins is already enabled for DeepSpeed; call moe_plugins.disable() first")
    ds = _import_deepspeed()
    plugin = DeepSpeedPlugin(resolved, ledger=ledger, ranks_per_node=_default_ranks_per_node(),
                             profile_dir=_profile_dir())
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
