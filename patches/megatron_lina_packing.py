"""Lina's expert packing on Megatron-core (``"lina": {"packing": p | "auto"}``; docs/lina.md, "Packing").

Packing p runs the plugin's MoE layers on the layout with ``ep / p``: each rank holds p times its stock experts
(Megatron's ``SequentialMLP.local_experts``), and expert-DP grows by p (moe_plugins/lina/packing.py). It runs
with Lina's gradient micro-ops (patches/megatron_lina.py), whose DDP hook it extends:

- When Megatron's ``DistributedDataParallel`` is built over the layers (:meth:`MegatronPacking.add_ddp`), a
  :class:`DDPPacker` takes them; a fixed p regroups there, before the optimizer exists. ``"auto"`` times the
  forward micro-ops and applies the paper's rule at steps 10, 14, ... (counted by ``FP32Optimizer``'s
  ``step_with_ready_grads``, replaced while enabled; its ``__init__`` is wrapped to learn the torch optimizer
  holding the experts).
- A regroup (:meth:`DDPPacker.regroup`, collective, at a step boundary): the experts' values, ``main_grad`` and
  Adam state move with one all-to-all per fine EP group (``lina.regroup.move_experts``); ``local_experts`` grows
  (clones of the first expert module, joining its optimizer group with its ``step``) or shrinks; the
  ``SequentialMLP``'s ``ep_group`` and ``dp_group`` become the packed layout's, so Megatron's own
  ``sharded_state_dict`` names every expert by its global id (``dist_checkpointing`` files load into any packing
  and into stock Megatron). The expert gradients get new DDP buffers: a second ``DistributedDataParallel`` over
  the experts alone, on the packed expert-DP group, whose buffers and bucket groups replace the model's expert
  ones (its hooks register the experts' gradients; the model's DDP forgets them) and whose bucket groups reduce
  through Lina's micro-ops on the packed layout's engine (dense buckets follow: same DP ranks). The layers'
  schedules are rebuilt on that engine and the packed groups; capacities are still agreed over the stock EP
  group (a superset), so routing, capacities and drops are stock's.
- Gradient norm: the expert optimizer sums squared norms over Megatron's EP group, which now holds p copies of
  every expert; the copies on EP members ``j >= ep / p`` are marked ``shared`` (Megatron's "do not double count"),
  so the norm, and clipping, are stock's. Not under the distributed optimizer: its pieces over the packed
  expert-DP group hold every expert once.

In bf16/fp16 (``Float16OptimizerWithFloat16Params``, whose ``__init__`` is wrapped too, and whose steps
``MixedPrecisionOptimizer.step_with_ready_grads`` counts) the experts' fp32 masters and their Adam moments move
with them and join or leave Megatron's optimizer groups (patches/megatron_masters.py). With Megatron's
distributed optimizer a fixed p regroups before it shards the buffers, and a mid-training one rebuilds it over the
new buffers, the masters and moments carried whole (patches/megatron_packing_distopt.py; ``stock_homes`` unpacks
and packs through the same rebuild); any TP (at TP > 1 without expert
biases under sequence parallelism), any expert-TP (each rank's shards move over its own EP group), PP 1, ``SequentialMLP`` experts, the ``baseline`` schedule at an integer pipeline degree (PipeMoE's
executor is rebuilt on the packed layout's engine; so are Lancet's deferred dW, whose exchanges fly on its pipeline
lane), without Hecate, and beside Lancet's batch partitions only at a fixed p (their calls run no timed schedule
steps for ``"auto"``): :func:`config_problems` and :func:`model_problems` list the rest.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.patcher import Patch
from moe_plugins.core.plugin_config import SECTION, PluginConfig
from moe_plugins.lancet.config import partitioned
from moe_plugins.lina.config import LinaConfig
from moe_plugins.lina.modules import regroup_modules, resize_experts
from moe_plugins.lina.packer import PackingController
from moe_plugins.lina.packing import AUTO, packed_layout, packing_layout_problems, regroup_problems
from moe_plugins.lina.probe import PackingProbe, rebuild_schedule
from moe_plugins.patches.megatron_config import facts_from_config
from moe_plugins.patches.megatron_masters import carried_masters, replace_masters, share_flags
from moe_plugins.patches.megatron_packing_distopt import DistributedExperts, gloo_for, record_patch
from moe_plugins.patches.megatron_steps import after_fp32_steps, after_mixed_precision_steps
from moe_plugins.pipemoe.runner import build_executor

logger = logging.getLogger("moe_plugins.megatron")
FIELD = f"{SECTION}.lina.packing"


# ---- checks (before anything is patched, and before Megatron's DDP is built) ---------------------------------

def config_problems(plugin: PluginConfig, lina: LinaConfig) -> List[str]:
    """Why the plugin section cannot pack on Megatron (empty: it can, or ``packing`` is 1)."""
    if lina.packing == 1:
        return []
    what, problems = f"{FIELD} ({lina.packing!r})", []
    if plugin.schedule != "baseline":
        problems.append(f"{what} runs the schedule 'baseline', and {SECTION}.schedule is {plugin.schedule!r}")
    if not isinstance(plugin.pipeline_degree, int):
        problems.append(f"{what} needs an integer {SECTION}.pipeline_degree (got {plugin.pipeline_degree!r}): the "
                        "cost profile that prices a degree is the stock layout's, not the packed one's")
    if plugin.hecate is not None:
        problems.append(f"{what} does not combine with {SECTION}.hecate: both move the expert modules")
    if plugin.lancet is not None and partitioned(plugin.lancet) and lina.packing == AUTO:
        problems.append(f"{what} does not combine with {SECTION}.lancet.partitions "
                        f"({plugin.lancet.get('partitions')!r}): \"auto\" times the schedule's micro-ops, which "
                        "partitioned calls do not run; give a fixed packing")
    return problems


def model_problems(config: Any, layers: List[Any], lina: LinaConfig) -> List[str]:
    """Why these layers (``PluginMoELayer``s of one DDP) and their TransformerConfig cannot pack."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    what, problems = f"{FIELD} ({lina.packing!r})", []
    layout = layers[0].token_dispatcher.groups.layout
    problems += packing_layout_problems(lina.packing, layout, config.num_moe_experts, f"{SECTION}.lina")
    if (getattr(config, "pipeline_model_parallel_size", 1) or 1) != 1:
        problems.append(f"{what} runs with pipeline_model_parallel_size 1 (got {config.pipeline_model_parallel_size})")
    facts = facts_from_config(config)
    if facts.tp > 1 and facts.bias_sp:           # the reason Hecate's re-sharding refuses it (megatron_config)
        problems.append(f"{what} cannot run with add_bias_linear and sequence_parallel at tensor_model_parallel_size "
                        f"{facts.tp}: Megatron all-reduces each expert's linear_fc2 bias gradient over the tensor-parallel "
                        "group, adding the experts that share a local slot on the TP peers; packing changes which")
    kinds = sorted({type(layer.experts).__name__ for layer in layers if not isinstance(layer.experts, SequentialMLP)})
    if kinds:
        problems.append(f"{what} moves SequentialMLP experts (one module per expert), and this model's are "
                        f"{', '.join(kinds)} (moe_grouped_gemm must be off)")
    if lina.packing == AUTO and torch.cuda.is_available() and dist.get_backend() == "nccl":
        problems.append(f'{what}: "auto" times the micro-ops by the wall clock, which on CUDA measures kernel '
                        "launches; give a fixed packing there")
    return problems


# ---- one layer as the controller sees it ---------------------------------------------------------------------

class PackedLayer:
    """A ``PluginMoELayer`` as :class:`~moe_plugins.lina.packer.PackingController` sees it (its dispatcher's
    ``name``, ``config``, ``groups``, ``rec`` and ``schedule``)."""

    def __init__(self, layer: Any):
        self.layer = layer

    dispatcher = property(lambda self: self.layer.token_dispatcher)
    name = property(lambda self: self.dispatcher.rec.layer)
    config = property(lambda self: self.dispatcher.schedule.config)
    groups = property(lambda self: self.dispatcher.groups)
    rec = property(lambda self: self.dispatcher.rec)
    experts = property(lambda self: self.layer.experts.local_experts)

    @property
    def schedule(self) -> Any:
        return self.dispatcher.schedule

    @schedule.setter
    def schedule(self, value: Any) -> None:
        self.dispatcher.schedule = value


def clone_expert(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of one expert module with new parameters (values copied) sharing everything else (its config,
    process groups, functions); the parameters keep Megatron's attributes (``allreduce``, ...) but not DDP's."""
    memo: Dict[int, Any] = {}
    for m in module.modules():
        for name, value in vars(m).items():
            if not name.startswith("_") and not torch.is_tensor(value) and not isinstance(value, torch.nn.Module):
                memo[id(value)] = value
    new = copy.deepcopy(module, memo)
    old = dict(module.named_parameters())
    for name, p in new.named_parameters():
        for key, value in vars(old[name]).items():
            if key not in ("main_grad", "grad_added_to_main_grad", "shared", "main_param"):
                setattr(p, key, value)
    return new


# ---- one DDP's experts ---------------------------------------------------------------------------------------

class DDPPacker:
    """Packing of the plugin's MoE ``layers`` inside one Megatron ``ddp`` (module docstring). ``lina``: the
    plugin's LinaState (its engines, reducer routes, ledger); ``found``: the stock layout's LinaEngine;
    ``pgc``: the ProcessGroupCollection Megatron's DDP was built with (stock groups)."""

    def __init__(self, ddp: Any, layers: List[Any], config: LinaConfig, lina: Any, found: Any, pgc: Any):
        self.ddp, self.layers, self.lina, self.found, self.pgc = ddp, [PackedLayer(x) for x in layers], lina, found, pgc
        self.base: MoEProcessGroups = self.layers[0].groups
        self.made: Dict[int, Any] = {}           # packing -> MegatronGroups built for it
        self.holder: Optional[Any] = None        # the DDP over the experts alone, once regrouped
        self.mixed: Optional[Any] = None         # bf16/fp16: Megatron's optimizer holding the experts' fp32 masters
        self.dist: Optional[DistributedExperts] = None   # Megatron's distributed optimizer holding the experts
        self.stock_dp: Optional[Tuple[Any, Any, int]] = None    # Megatron's distributed optimizer's (see dp_of)
        self.regroups = 0
        self.controller = PackingController(
            self.layers, self.base, packing=config.packing, path=f"{SECTION}.lina", regroup=self.regroup,
            groups_for=self._groups_for)

    # -- groups and engines ----------------------------------------------------------------------------------

    def _groups_for(self, packing: int) -> MoEProcessGroups:
        from moe_plugins.patches.megatron_groups import build_megatron_groups
        self.made[packing] = build_megatron_groups(packed_layout(self.base.layout, packing))   # collective
        return self.made[packing].groups

    def dp_of(self, packing: int) -> Tuple[Any, Any, int]:
        """The expert-DP group, its gloo twin and the state index of the distributed optimizer over the experts at
        ``packing`` (patches/megatron_packing_distopt.py): Megatron's own at 1."""
        if packing == 1:
            return self.stock_dp
        group = self._collection(packing).expt_dp
        return group, gloo_for(group, self.stock_dp), self.made[packing].pg_collection.tp_ep_pp.rank()

    def _packing_of(self, groups: MoEProcessGroups) -> int:
        return self.base.layout.ep // groups.layout.ep

    def _collection(self, packing: int) -> Any:
        """Megatron's groups for the experts at ``packing``: the DDP's own, expert-DP (and EP) packed."""
        if packing == 1:
            return self.pgc
        made = self.made[packing].pg_collection
        pgc = copy.copy(self.pgc)
        pgc.expt_dp = pgc.intra_expt_dp = made.expt_dp
        pgc.ep = made.ep
        return pgc

    # -- the regroup -----------------------------------------------------------------------------------------

    def regroup(self, layers: List[PackedLayer], groups: MoEProcessGroups, optimizer: Optional[Any]) -> None:
        """The controller's regroup (module docstring). Every check, group and engine comes before anything
        moves. ``optimizer``: the controller's, learnt from Megatron's FP32Optimizer (None before it exists)."""
        old = layers[0].groups
        num_experts = layers[0].config.num_experts
        problems = regroup_problems(old.layout, groups.layout, num_experts)
        if problems:
            raise ValueError(f"{FIELD}: cannot regroup: " + "; ".join(problems))
        packing = self._packing_of(groups)
        engine = self.lina.packed_engine(groups, self.found.reducer,       # the stock layout's: Lina's own
                                         packed_layout(self.found.groups.layout, packing))   # DDP's: MP = TP
        schedules = [rebuild_schedule(layer.schedule, groups, dataclasses.replace(layer.rec, engine=engine))
                     for layer in layers]                              # raises before moving
        if old.layout.ep == groups.layout.ep:
            return
        mixed, spread = self.mixed, self.dist    # their torch optimizers hold masters / pieces, not the parameters
        before = [p for layer in layers for p in layer.experts.parameters()]
        carried = carried_masters(before, mixed.optimizer) if mixed is not None else \
            spread.carried(before) if spread is not None else None
        keyed = optimizer if mixed is None and spread is None else None
        def resize(layer: PackedLayer) -> Callable[[int, Dict[str, Dict[str, Any]]], None]:
            return lambda local, scalars: resize_experts(layer.experts, local, keyed, scalars,
                                                         f"{FIELD}: layer {layer.name}", clone=clone_expert)
        lists = [(f"{FIELD}: layer {layer.name}", layer.experts, resize(layer)) for layer in layers]
        grads = regroup_modules(lists, num_experts, old, groups, layers[0].rec, keyed,
                                grad_of=lambda p: getattr(p, "main_grad", None), carried=carried)
        pairs = [(p, dict(layer.experts[0].named_parameters())[name]) for layer in layers
                 for expert in layer.experts for name, p in expert.named_parameters()]
        if mixed is not None:
            replace_masters(mixed, before, [p for p, _ in pairs], [t for _, t in pairs], carried)
        local = num_experts // groups.layout.ep
        pgc = self._collection(packing)
        for layer in layers:
            experts, moe = layer.layer.experts, layer.layer
            experts.num_local_experts = moe.num_local_experts = local
            experts.ep_group, experts.dp_group = pgc.ep, pgc.expt_dp       # sharded_state_dict: global ids
            start = groups.ep.rank * local
            moe.local_expert_indices = list(range(start, start + local))
        self._rebuild_buffers(layers, pgc, groups, engine, grads)
        if spread is not None:             # its torch optimizer is new: the controller learns it (record_patch)
            spread.rebuild(before, [p for p, _ in pairs], [t for _, t in pairs], carried, self.dp_of(packing))
        for layer, schedule in zip(layers, schedules):
            dispatcher = layer.dispatcher
            dispatcher.groups = layer.layer.moe_groups = groups
            dispatcher.engine, dispatcher.rec, dispatcher.schedule = engine, schedule.rec, schedule
            dispatcher.lane = build_executor(dispatcher.degree, None, engine)    # PipeMoE: on the new lane
        self.regroups += 1
        logger.info("moe_plugins: Lina packing regrouped %d Megatron MoE layers from ep %d to ep %d (%d experts "
                    "per rank)", len(layers), old.layout.ep, groups.layout.ep, local)

    def _rebuild_buffers(self, layers: List[PackedLayer], pgc: Any, groups: MoEProcessGroups, engine: Any,
                         grads: Dict[int, torch.Tensor]) -> None:
        """New DDP buffers for the experts' gradients, on ``pgc``'s expert-DP group (module docstring)."""
        from megatron.core.distributed import DistributedDataParallel
        ddp, routes = self.ddp, self.lina._routes
        params = [p for layer in layers for p in layer.layer.experts.parameters()]
        for bucket_group in ddp.expert_parallel_bucket_groups:
            routes.pop(bucket_group, None)
        stale = self.holder.param_to_bucket_group if self.holder is not None else ddp.param_to_bucket_group
        for p in list(stale):
            if not getattr(p, "allreduce", True):
                del stale[p]                       # their hooks (on kept experts) now do nothing
        with torch.enable_grad():              # its hooks need grad_fn (the optimizer's step runs under no_grad)
            holder = DistributedDataParallel(ddp.config, copy.copy(ddp.ddp_config),
                                             torch.nn.ModuleList(layer.layer.experts for layer in layers),
                                             pg_collection=pgc)
        ddp.expert_parallel_buffers = holder.expert_parallel_buffers
        ddp.expert_parallel_bucket_groups = holder.expert_parallel_bucket_groups
        ddp.params_with_grad = [p for p in ddp.params_with_grad if getattr(p, "allreduce", True)] + params
        for bucket_group in holder.expert_parallel_bucket_groups:
            routes[bucket_group] = (self.found.reducer, groups.expert_dp)
            self.lina.routed += 1
        self.found.reducer.engine = engine     # one engine orders the exchanges and every micro-op
        self.holder = holder
        # the first ep/p EP members hold every expert once; the distributed optimizer's pieces hold it once already
        keep = self.base.ep.rank < groups.layout.ep or ddp.ddp_config.use_distributed_optimizer
        with torch.no_grad():
            for p in params:
                p.grad = None
                if id(p) in grads:
                    p.main_grad.copy_(grads[id(p)])
                p.shared = not keep
        share_flags(params)

    # -- the host's side -------------------------------------------------------------------------------------

    def holds(self, optimizer: Any) -> bool:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        mine = [id(getattr(p, "main_param", p)) in ids
                for layer in self.layers for p in layer.layer.experts.parameters()]
        if any(mine) and not all(mine):
            raise ValueError(f"{FIELD}: the experts of the packed layers are split over several optimizers; one "
                             "torch optimizer must step them all (their state moves with them)")
        return all(mine)

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer holding the experts (learnt when Megatron's FP32Optimizer is built over it)."""
        return self.controller.optimizer

    def stock(self) -> ContextManager[None]:
        """Inside: the experts on the stock layout (collective on the way in and out when packed)."""
        return self.controller.unpacked()

    def close(self) -> None:
        from moe_plugins.patches.megatron_groups import destroy_megatron_groups
        for layer in self.layers:
            PackingProbe.detach(layer)
        made, self.made = self.made, {}
        for packing in sorted(made):            # collective, in the same order on every rank
            destroy_megatron_groups(made[packing])


class MegatronPacking:
    """Packing under one enabled plugin: a :class:`DDPPacker` per DDP built over its layers, and the optimizer
    wrappers (module docstring)."""

    def __init__(self, config: LinaConfig):
        self.config = config
        self.packers: List[DDPPacker] = []

    def add_ddp(self, ddp: Any, layers: List[Any], lina: Any, found: Any, pgc: Any) -> DDPPacker:
        if pgc is None:
            from moe_plugins.patches.megatron_groups import parallel_state_collection
            pgc = parallel_state_collection()
        packer = DDPPacker(ddp, layers, self.config, lina, found, pgc)
        self.packers.append(packer)
        return packer

    def patches(self) -> List[Patch]:
        from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params as Mixed
        return [Patch(FP32Optimizer, "__init__", self._wrap_init(FP32Optimizer.__init__)),
                Patch(Mixed, "__init__", self._wrap_init(Mixed.__init__, mixed=True)),
                record_patch(self._distributed),
                after_fp32_steps(self._step_end), after_mixed_precision_steps(self._step_end)]

    def _wrap_init(self, original: Callable, mixed: bool = False) -> Callable:
        state, signature = self, inspect.signature(original)

        @functools.wraps(original)
        def __init__(opt, *args, **kwargs):
            original(opt, *args, **kwargs)
            optimizer = signature.bind(opt, *args, **kwargs).arguments.get("optimizer")
            for packer in state.packers:
                if optimizer is not None and packer.holds(optimizer):
                    packer.controller.optimizer = optimizer
                    packer.mixed = opt if mixed else None
        return __init__

    def _distributed(self, opt: Any, groups: Any) -> None:
        """Megatron built (or the packer rebuilt) a distributed optimizer: it holds a packer's experts or none."""
        for packer in self.packers:
            experts = [p for layer in packer.layers for p in layer.experts.parameters()]
            if any(p in buffer.param_index_map for buffer in opt.buffers for p in experts):
                if packer.stock_dp is None:      # Megatron's own build, with its groups (a fixed p: the packed ones)
                    packer.stock_dp = (opt.data_parallel_group, opt.data_parallel_group_gloo,
                                       opt.data_parallel_group_idx)
                    packing = packer.controller.packing
                    opt.data_parallel_group, opt.data_parallel_group_gloo, opt.data_parallel_group_idx = \
                        packer.dp_of(packing)
                packer.dist, packer.controller.optimizer = DistributedExperts(opt, groups), opt.optimizer

    def _step_end(self, optimizer: torch.optim.Optimizer) -> None:
        for packer in self.packers:
            if optimizer is packer.optimizer:
                packer.controller.step_end()

    @contextmanager
    def stock_homes(self) -> Iterator[None]:
        """Inside: every packed model's experts on the stock layout (a per-rank ``state_dict()`` written or read
        here is stock Megatron's; under its distributed optimizer, rebuilt on the stock groups, so is the
        optimizer's ``dp_reshardable`` state, keyed by the buffers' layout); after: packed again (collective).
        The model's ``sharded_state_dict`` (by global expert id) needs no regroup."""
        with ExitStack() as stack:
            for packer in self.packers:
                stack.enter_context(packer.stock())
            yield

    def close(self) -> None:
        packers, self.packers = self.packers, []
        for packer in packers:
            packer.close()


__all__ = ["DDPPacker", "MegatronPacking", "PackedLayer", "clone_expert", "config_problems", "model_problems"]
