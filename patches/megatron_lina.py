"""Lina's gradient micro-ops in Megatron-core's ``DistributedDataParallel`` (megatron-core 0.16.1 and 0.19.2).

While :func:`moe_plugins.patches.megatron.enable` runs with a ``"lina"`` section, two Megatron names are replaced
(through the plugin's :class:`~moe_plugins.core.patcher.Patcher`, restored by ``disable()``):

- ``DistributedDataParallel.__init__``: when the wrapped module holds MoE layers built by this plugin, its DDP
  settings and process groups are checked *before* Megatron's ``__init__`` runs (one ``ValueError`` listing
  every problem), and afterwards its bucket groups are routed to the layers' engine: dense bucket groups to the
  layout's ``dp`` group, expert bucket groups to ``expert_dp`` (matched by ranks).
- ``_ParamAndGradBucketGroup.start_grad_sync``: for a routed bucket group it does what stock does before its
  collective (the first-batch rule, the grad checks, ``grad_data *= gradient_scaling_factor``, and on 0.19.2
  also draining a linked predecessor, waiting CUDA-graph wgrad events and copying separate ``main_grad`` tensors
  into the buffer, each where Megatron has the attribute it reads), then submits
  every bucket's ``grad_data`` to Lina's :class:`~moe_plugins.lina.reducer.GradReducer` and leaves a handle in
  ``grad_reduce_handle`` whose ``wait()`` waits every micro-op, so the stock ``finish_grad_sync`` waits on it.
  Without ``overlap_grad_reduce`` stock calls it from ``finish_grad_sync``, and it waits at once. Any other
  bucket group (a model not built with the plugin) runs the original.

One engine per layout, owned by :class:`LinaState` (on the plugin handle): a background lane on twins of the
layout's groups (Megatron's MP = TP), and a pipeline lane on twins of the token layout (MP = 1) when the pipeline
degree needs one. Every MoE layer of that layout runs its exchanges through it, so its background lane holds
micro-ops back while an exchange is pending, in flight, or imminent (``Schedule.mark_combine``). The engines are
closed by ``disable()`` (collective): with Lina, run the model inside the enable/disable pair.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.engine import CommEngine
from moe_plugins.core.groups import Group, MoEProcessGroups, build_process_groups
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.ledger import CommLedger, CommRecord
from moe_plugins.core.ops import BACKGROUND, PIPELINE
from moe_plugins.core.patcher import Patch
from moe_plugins.core.plugin_config import SECTION, PluginConfig
from moe_plugins.hecate.config import lane_on
from moe_plugins.lina.config import LinaConfig
from moe_plugins.lina.microops import micro_op_bytes
from moe_plugins.lina.reducer import GradReducer, PendingReduce
from moe_plugins.pipemoe.runner import needs_lane

logger = logging.getLogger("moe_plugins.megatron")

CHECKED_VERSIONS = ("0.16.1", "0.19.2")         # start_grad_sync read against each
PATH = f"{SECTION}.lina"

# DistributedDataParallelConfig fields Lina cannot run exactly, as (field, Megatron-LM argument, fine value, why)
DDP_UNSUPPORTED: Tuple[Tuple[str, str, Any, str], ...] = (
    ("reduce_scatter_with_fp32_accumulation", "reduce_scatter_with_fp32_accumulation", False,
     "Lina's micro-ops reduce in the gradients' dtype"),
    ("num_distributed_optimizer_instances", "num_distributed_optimizer_instances", 1,
     "several optimizer instances add an inter-instance all-reduce on a stream of their own"),
    ("average_in_collective", "ddp_average_in_collective", False,
     "Lina's micro-ops sum (gloo has no AVG); with it off DDP pre-scales the buckets, the same average"),
    ("use_megatron_fsdp", "use_megatron_fsdp", False, "Lina hooks DistributedDataParallel's bucket groups"),
    ("use_custom_fsdp", "use_custom_fsdp", False, "Lina hooks DistributedDataParallel's bucket groups"),
    ("delay_wgrad_compute", "delay_wgrad_compute", False,
     "delayed weight gradients reach DDP from Transformer Engine's backward_dw: untested"),
)


# ---- checks (pure) -----------------------------------------------------------------------------------------

def version_problems(version: str) -> List[str]:
    if version in CHECKED_VERSIONS:
        return []
    return [f"{PATH} needs megatron-core {' or '.join(CHECKED_VERSIONS)} (found {version}): its hook, "
            "_ParamAndGradBucketGroup.start_grad_sync, was checked against those versions only"]


def ddp_problems(source: Any, *, args: bool = False) -> List[str]:
    """Every DDP setting of ``source`` (a ``DistributedDataParallelConfig``, or Megatron-LM's parsed arguments
    with ``args=True``) that Lina cannot run, each naming the field and its value."""
    problems = []
    for name, arg, fine, why in DDP_UNSUPPORTED:
        key = arg if args else name
        value = getattr(source, key, fine)
        if value is not None and value != fine:
            problems.append(f"{key} ({value!r}) must be {fine!r} with {PATH}: {why}")
    return problems


def group_problems(kind: str, have: Tuple[int, ...], want: Group, rank: int) -> List[str]:
    what = {"dp": "dense", "expert_dp": "expert"}[kind]
    if have == tuple(want.ranks):
        return []
    return [f"DistributedDataParallel reduces the {what} gradients of rank {rank} over ranks {list(have)}, but the "
            f"plugin's layout puts them in its {kind} group {list(want.ranks)}"]


# ---- one engine per layout ---------------------------------------------------------------------------------

@dataclass
class LinaEngine:
    """A layout's shared engine, its reducer, and the layout's groups (Megatron's, MP = TP)."""

    engine: CommEngine
    reducer: GradReducer
    groups: MoEProcessGroups


def build_lina_engine(dense: ParallelLayout, tokens: ParallelLayout, *, pipeline: bool,
                      ledger: Optional[CommLedger], record_timeline: bool,
                      timeout_s: Optional[float] = None) -> CommEngine:
    """Collective: an engine whose background lane runs on twins of the ``dense`` layout (Megatron's DP groups,
    MP = TP), its pipeline lane (if asked for) on twins of the ``tokens`` layout (MP = 1) the schedules run on
    (``build_engine`` puts every lane on one layout). ``timeout_s`` None: the default group's."""
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    lanes = {}
    if pipeline:
        lanes[PIPELINE] = build_process_groups(tokens, timeout=timeout)
    lanes[BACKGROUND] = build_process_groups(dense, timeout=timeout)
    cuda = "nccl" in str(dist.get_backend())
    return CommEngine(lanes, ledger=ledger, record_timeline=record_timeline, cuda=cuda)


class BucketGroupReduce:
    """``grad_reduce_handle`` of a routed bucket group: ``wait()`` waits every micro-op of its buckets."""

    def __init__(self, pending: List[PendingReduce]):
        self._pending = pending

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            p.wait()


@dataclass
class LinaState:
    """Lina on one :class:`~moe_plugins.patches.megatron.MegatronPlugin`: its engines, the bucket groups routed
    to them, and the two patches. Passed to every layer the plugin builds (in the layer spec)."""

    plugin: PluginConfig
    config: LinaConfig
    ledger: Optional[CommLedger] = None
    record_timeline: bool = False
    engines: Dict[Any, LinaEngine] = field(default_factory=dict)
    closed: List[CommEngine] = field(default_factory=list)
    routed: int = 0                                      # bucket groups routed to an engine so far
    packing: Any = None                                  # megatron_lina_packing.MegatronPacking when packing != 1
    _routes: Any = field(default_factory=weakref.WeakKeyDictionary)

    @classmethod
    def create(cls, plugin: PluginConfig, version: str, **kw: Any) -> "LinaState":
        """Validated before anything is patched; raises one ValueError listing every problem."""
        config = LinaConfig.from_dict(plugin.lina, PATH)
        problems = version_problems(version)
        if config.inference is not None:
            problems.append(f"{PATH}.inference is supported by the DeepSpeed adapter only (Lina's inference "
                            "scheduling is not wired into Megatron-core)")
        from moe_plugins.patches.megatron_lina_packing import MegatronPacking, config_problems
        problems += config_problems(plugin, config)
        if problems:
            raise ValueError(f"{SECTION} cannot run Lina on this Megatron: " + "; ".join(problems))
        return cls(plugin=plugin, config=config, packing=MegatronPacking(config) if config.packing != 1 else None,
                   **kw)

    def __deepcopy__(self, memo: Any) -> "LinaState":      # specs may be deep-copied: shared like the engine
        return self

    # ---- the layers' side ------------------------------------------------------------------------------------

    def engine_for(self, groups: MoEProcessGroups, tokens: MoEProcessGroups,
                   profile: Callable[[Any], Any]) -> CommEngine:
        """The engine of ``groups``' layout, built by its first layer (collective: layers build in the same order
        on every rank). ``profile(layout)``: the cost profile cached for the token layout ("auto" sizes)."""
        found = self.engines.get(groups.layout)
        if found is None:
            size = micro_op_bytes(self.config.micro_op_mb, profile(tokens.layout) if self.config.micro_op_mb == "auto"
                                  else None)
            engine = build_lina_engine(groups.layout, tokens.layout, pipeline=self._pipeline_lane(),
                                       ledger=self.ledger, record_timeline=self.record_timeline)
            found = self.engines[groups.layout] = LinaEngine(
                engine, GradReducer(engine, micro_op_bytes=size, priority=self.config.priority), groups)
            log = logger.info if dist.get_rank() == 0 else logger.debug
            log("moe_plugins: Lina engine for %s: micro-ops of %d bytes, priority %s", _short(groups.layout), size,
                self.config.priority)
        return found.engine

    def _pipeline_lane(self) -> bool:
        """Whether the engines need a pipeline lane: PipeMoE's chunks, Hecate's early gather, Lancet's exchanges."""
        from moe_plugins.patches.megatron_lancet import lancet_on
        return needs_lane(self.plugin.pipeline_degree) or lane_on(self.plugin) or lancet_on(self.plugin)

    def packed_engine(self, groups: MoEProcessGroups, reducer: GradReducer, dense: ParallelLayout) -> CommEngine:
        """A packed layout's engine (patches/megatron_lina_packing.py): the pipeline lane on twins of ``groups``
        (tokens, MP 1), the background lane of the ``dense`` layout (MP = TP), ``reducer`` shared; built by the
        first regroup to it (collective), closed here."""
        found = self.engines.get(groups.layout)
        if found is None:
            engine = build_lina_engine(dense, groups.layout, pipeline=self._pipeline_lane(), ledger=self.ledger,
                                       record_timeline=self.record_timeline)
            found = self.engines[groups.layout] = LinaEngine(engine, reducer, groups)
        return found.engine

    # ---- Megatron's DDP side ---------------------------------------------------------------------------------

    def patches(self) -> List[Patch]:
        from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
        return [Patch(DistributedDataParallel, "__init__", self._wrap_ddp_init(DistributedDataParallel.__init__)),
                Patch(_ParamAndGradBucketGroup, "start_grad_sync",
                      self._wrap_start_grad_sync(_ParamAndGradBucketGroup.start_grad_sync))] + (
                    self.packing.patches() if self.packing is not None else [])

    def _engine_of(self, module: Any) -> List[LinaEngine]:
        mine = {id(e.engine): e for e in self.engines.values()}
        used = {id(m.token_dispatcher.engine) for m in _plugin_layers(module)}
        return [mine[i] for i in sorted(used & set(mine))]

    def _wrap_ddp_init(self, original: Callable) -> Callable:
        state = self

        def __init__(ddp, config, ddp_config, module, *args, **kwargs):
            found = state._engine_of(module)
            if found:
                pg_collection = kwargs.get("pg_collection", args[1] if len(args) > 1 else None)
                state._check_ddp(ddp_config, pg_collection, found, config, module)
            original(ddp, config, ddp_config, module, *args, **kwargs)
            if found:
                state._route(ddp, found[0])
                if state.packing is not None:      # a fixed packing regroups here, before the optimizer exists
                    state.packing.add_ddp(ddp, _plugin_layers(module), state, found[0], pg_collection)

        __init__.__wrapped__ = original
        return __init__

    def _check_ddp(self, ddp_config: Any, pg_collection: Any, found: List[LinaEngine], config: Any,
                   module: Any) -> None:
        """Before Megatron's DDP is built: its settings, the ranks its bucket groups will reduce over, and with
        packing the model's."""
        problems = ddp_problems(ddp_config)
        if self.packing is not None:
            from moe_plugins.patches.megatron_lina_packing import model_problems
            problems += model_problems(config, _plugin_layers(module), self.config)
        if len(found) > 1:
            problems.append(f"the model holds MoE layers of {len(found)} layouts "
                            f"({'; '.join(_short(e.groups.layout) for e in found)}); Lina needs one")
        rank, groups = dist.get_rank(), found[0].groups
        for kind, pg in zip(("dp", "expert_dp"), _ddp_groups(pg_collection)):
            have = (rank,) if pg is None else tuple(dist.get_process_group_ranks(pg))
            problems += group_problems(kind, have, getattr(groups, kind), rank)
        if problems:
            raise ValueError(f"{PATH} cannot reduce this model's gradients: " + "; ".join(problems))
        if not ddp_config.overlap_grad_reduce:
            logger.warning("moe_plugins: %s with overlap_grad_reduce=False: Megatron reduces after the backward "
                           "pass, where there is no all-to-all to give way to", PATH)

    def _route(self, ddp: Any, found: LinaEngine) -> None:
        rank = dist.get_rank()
        for kind, bucket_groups in (("dp", ddp.bucket_groups), ("expert_dp", ddp.expert_parallel_bucket_groups)):
            group = getattr(found.groups, kind)
            for bucket_group in bucket_groups:
                problems = group_problems(kind, tuple(dist.get_process_group_ranks(_reduced_over(bucket_group))),
                                          group, rank)
                if problems:                   # the check before __init__ saw other groups: Megatron changed
                    raise RuntimeError("; ".join(problems))
                self._routes[bucket_group] = (found.reducer, group)
                self.routed += 1

    def _wrap_start_grad_sync(self, original: Callable) -> Callable:
        routes = self._routes

        def start_grad_sync(bucket_group, force_all_reduce: Optional[bool] = False):
            route = routes.get(bucket_group)
            if route is None:
                return original(bucket_group, force_all_reduce)
            return _start_grad_sync(bucket_group, *route, force_all_reduce=force_all_reduce)

        start_grad_sync.__wrapped__ = original
        return start_grad_sync

    # ---- the end ----------------------------------------------------------------------------------------------

    def timeline(self) -> List[CommRecord]:
        """The ops every engine recorded (``record_timeline=True``), open or closed."""
        records: List[CommRecord] = []
        for engine in [e.engine for e in self.engines.values()] + self.closed:
            records += engine.timeline or []
        return records

    def close(self) -> None:
        """Close the engines (collective: every rank, in the same order) and forget the routes."""
        if self.packing is not None:
            self.packing.close()
        self._routes.clear()
        engines, self.engines = [e.engine for e in self.engines.values()], {}
        self.closed += engines
        for engine in engines:
            engine.close()
        if not self.routed:
            logger.warning("moe_plugins: %s was on, but no Megatron DistributedDataParallel was built over the "
                           "plugin's MoE layers while it was enabled: no gradient went through Lina", PATH)


def _plugin_layers(module: Any) -> List[Any]:
    from moe_plugins.patches.megatron_layer import PluginMoELayer
    return [m for m in module.modules() if isinstance(m, PluginMoELayer)]


def _short(layout: Any) -> str:
    return f"world {layout.world}, tp {layout.mp}, ep {layout.ep}, etp {layout.esp}"


def _ddp_groups(pg_collection: Any) -> Tuple[Any, Any]:
    """The groups Megatron 0.16.1's DDP gives its dense and expert bucket groups (one optimizer instance):
    ``dp_cp`` (else ``dp``) and ``expt_dp`` of the collection, else ``parallel_state``'s. None: DDP makes a
    group of this rank alone."""
    if pg_collection is None:
        from megatron.core import parallel_state
        return (parallel_state.get_data_parallel_group(with_context_parallel=True),
                parallel_state.get_expert_data_parallel_group())
    dense = getattr(pg_collection, "dp_cp", None)
    return (pg_collection.dp if dense is None else dense), getattr(pg_collection, "expt_dp", None)


def _drain_predecessor(bucket_group: Any, force_all_reduce: Optional[bool]) -> None:
    """0.19.2: finish the linked predecessor's reduction first (linked only with fp32-accumulating
    reduce-scatter; 0.16.1 has no link)."""
    previous = getattr(bucket_group, "previous_grad_reduce_bucket_group", None)
    if previous is not None and previous.grad_reduce_handle is not None:
        previous.finish_grad_sync(force_all_reduce=force_all_reduce)


def _sync_extra_grads(bucket_group: Any) -> None:
    """0.19.2: wait for CUDA-graph replays that accumulate into these buckets, and copy separate (higher precision)
    ``main_grad`` tensors into the buffer (stock's ``finish_grad_sync`` copies them back). No-op on 0.16.1."""
    events = {}
    for bucket in bucket_group.buckets:
        for param in getattr(bucket, "params_list", ()):
            event = getattr(param, "_cudagraph_wgrad_ready_event", None)
            if event is not None:
                events[id(event)] = event
    if events:
        stream = torch.cuda.current_stream()
        for event in events.values():
            stream.wait_event(event)
    for bucket in bucket_group.buckets:
        for param in getattr(bucket, "params_with_extra_main_grads", ()):
            if getattr(param, "main_grad_copy_in_grad_buffer", None) is not None:
                param.main_grad_copy_in_grad_buffer.copy_(param.main_grad)


def _reduced_over(bucket_group: Any) -> Any:
    """A bucket group's data-parallel group, or with the distributed optimizer (one instance) its instance's."""
    found = getattr(bucket_group, "data_parallel_group", None)
    return found if found is not None else bucket_group.intra_distributed_optimizer_instance_group


def _start_grad_sync(bucket_group: Any, reducer: GradReducer, group: Group, *,
                     force_all_reduce: Optional[bool] = False) -> None:
    """Stock ``start_grad_sync`` (0.16.1 / 0.19.2, one optimizer instance) with Lina's micro-ops: all-reduces, or
    with the distributed optimizer (unless ``force_all_reduce``) reduce-scatters into each rank's shard of the
    bucket, as stock's ``reduce_scatter_tensor`` writes it (:meth:`GradReducer.submit_scatter`)."""
    if bucket_group.is_first_batch and bucket_group.grad_reduce_handle is not None:
        return                                           # first batch: already dispatched
    _drain_predecessor(bucket_group, force_all_reduce)
    if bucket_group.grad_reduce_handle is not None:
        raise RuntimeError("Should not have multiple communication calls outstanding at once")
    _sync_extra_grads(bucket_group)
    ddp_config = bucket_group.ddp_config
    if ddp_config.check_for_nan_in_grad or ddp_config.check_for_large_grads:
        bucket_group.check_grads(check_for_nan_or_inf=ddp_config.check_for_nan_in_grad,
                                 check_for_large=ddp_config.check_for_large_grads)
    with torch.no_grad():
        for bucket in bucket_group.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
    if group.size == 1:                                  # a sum over one rank: stock's collective is a no-op
        pending = []
    elif ddp_config.use_distributed_optimizer and not force_all_reduce:
        member = bucket_group.intra_distributed_optimizer_instance_rank          # the shard Megatron reads
        if group.ranks[member] != dist.get_rank():
            raise RuntimeError(f"Megatron's distributed-optimizer rank {member} is rank {dist.get_rank()}, and the "
                               f"layout's {group.kind} group {list(group.ranks)} orders it elsewhere")
        pending = [reducer.submit_scatter(bucket.grad_data, group, member) for bucket in bucket_group.buckets]
    else:
        pending = [reducer.submit(bucket.grad_data, group) for bucket in bucket_group.buckets]
    handle = BucketGroupReduce(pending)
    if ddp_config.overlap_grad_reduce:
        bucket_group.grad_reduce_handle = handle
    else:                                                # called from finish_grad_sync: synchronous
        handle.wait()
        bucket_group.grad_reduce_handle = None


__all__ = ["CHECKED_VERSIONS", "DDP_UNSUPPORTED", "BucketGroupReduce", "LinaEngine", "LinaState", "build_lina_engine",
           "ddp_problems", "group_problems", "version_problems"]
