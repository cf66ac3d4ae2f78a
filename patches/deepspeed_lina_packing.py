"""Lina's expert packing on a DeepSpeed engine (``"lina": {"packing": p | "auto"}``; docs/lina.md, "Packing").

Packing p runs the engine's MoE layers on the layout with ``ep / p``: each rank holds p times its stock experts
(DeepSpeed expert modules), and expert-DP grows by p (moe_plugins/lina/packing.py). The pieces:

- :func:`config_problems` (the section and the engine's settings, before anything is set up) and
  :func:`layout_problems` (the swapped layers' layout, before anything is patched): fp32, bf16 or fp16 (not
  DeepSpeed's BF16_Optimizer, bf16 with fp32 gradient accumulation at ZeRO 1, nor its FP16_Optimizer around a
  fused Adam at ZeRO 0: neither is rebuilt),
  ZeRO stage 0, 1 or 2, the ``baseline`` schedule at an integer
  pipeline degree with MP 1 and ESP 1, no Hecate, Lancet's batch partitions with a fixed packing only (their calls run no timed schedule steps), and
  ``"auto"`` only off CUDA (its probe times micro-ops by the wall clock).
- :func:`regroup_deepspeed`: the controller's regroup (:class:`moe_plugins.lina.packer.PackingController`) for
  DeepSpeed layers. The experts' values, gradients and optimizer state shaped like them move with one
  all-to-all per fine EP group (:func:`moe_plugins.lina.regroup.move_experts`); each layer's
  ``deepspeed_experts`` then grows (copies of its first expert module, their parameters added to the optimizer
  group of the ones they copy, with its scalar state: Adam's ``step``) or shrinks (parameters and state
  dropped); every expert parameter names the layout's DeepSpeed group (``ep_size_{ep}``, registered with the
  layout's EP and expert-DP groups by the plugin); the plugin's swapped layer is rebuilt on the new groups.
  The gate keeps its stock EP group: the dropless capacity is agreed over the stock EP group (a superset of
  the packed one), so routing, capacities and drops are stock's.
- :class:`EnginePacker` wraps methods of the engine (instance attributes, undone with Lina's patches):
  ``_configure_optimizer`` (ZeRO 0) or ``_configure_zero_optimizer`` (ZeRO 1/2) makes the controller once the
  torch optimizer exists (a fixed p regroups there, before the first step, and before ZeRO flattens the groups:
  the MoE groups' ``name`` becomes the packed group's, so ZeRO partitions them over the packed expert-DP group);
  ``step`` calls ``step_end`` at every gradient-accumulation boundary ("auto" checks at steps 10, 14, ...);
  ``save_checkpoint`` and ``load_checkpoint`` run on the stock layout (unpacked around the call, packed again
  after), so the files are stock DeepSpeed's both ways. A regroup once ZeRO 1/2 built its optimizer rebuilds that
  optimizer around it (patches/deepspeed_zero_state.py), each parameter's master value and moments carried whole;
  in fp16/bf16 at ZeRO 0 so is DeepSpeed's ``FP16_UnfusedOptimizer`` (an fp32 master per parameter). In fp16 the
  rebuilt optimizer goes on with the old one's loss scale.

Gradients need no rescaling: DeepSpeed 0.19.8 divides expert gradients by the DP world size, not the expert-DP
size (ZeRO 0: ``DeepSpeedEngine._reduce_expert_gradients``; ZeRO 1/2: ``gradient_reduction_w_predivide``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple

import torch

from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.core.plugin_config import SECTION
from moe_plugins.lina.config import LinaConfig
from moe_plugins.lina.modules import Carried, regroup_modules, resize_experts
from moe_plugins.lina.packer import PackingController
from moe_plugins.lina.packing import AUTO, packed_layout, packing_layout_problems, regroup_problems
from moe_plugins.lina.probe import rebuild_schedule
from moe_plugins.patches.deepspeed_zero_state import loss_scale, unfused
from moe_plugins.pipemoe.runner import build_executor

logger = logging.getLogger("moe_plugins.deepspeed")
FIELD = f"{SECTION}.lina.packing"
SCHEDULES = ("baseline",)
Register = Callable[[ParallelLayout], Tuple[str, Any]]    # layout -> (DeepSpeed group name, its EP process group)


def config_problems(engine: Any, cfg: Any, lina: LinaConfig) -> List[str]:
    """Why this section and engine cannot pack (empty: they can, or ``packing`` is 1), each naming its field."""
    if lina.packing == 1:
        return []
    what, problems = f"{FIELD} ({lina.packing!r})", []
    stage = int(engine.zero_optimization_stage())
    if stage not in (0, 1, 2):
        problems.append(f"{what} runs on zero_optimization.stage 0, 1 or 2, and it is {stage}")
    if engine.bfloat16_enabled() and stage == 1 and engine.get_data_types()[1] == torch.float32:
        problems.append(f"{what} does not rebuild DeepSpeed's BF16_Optimizer (bf16 at zero_optimization.stage 1 "
                        "with data_types.grad_accum_dtype fp32): accumulate in bf16, or use stage 2")
    if cfg.schedule not in SCHEDULES:
        problems.append(f"{what} runs the schedule {' or '.join(map(repr, SCHEDULES))}, and "
                        f"{SECTION}.schedule is {cfg.schedule!r}")
    if not isinstance(cfg.pipeline_degree, int):
        problems.append(f"{what} needs an integer {SECTION}.pipeline_degree (got {cfg.pipeline_degree!r}): the "
                        "cost profile that prices a degree is the stock layout's, not the packed one's")
    if cfg.esp not in (None, 1):
        problems.append(f"{what} needs {SECTION}.esp 1 (got {cfg.esp})")
    if cfg.hecate is not None:
        problems.append(f"{what} does not combine with {SECTION}.hecate: both move the expert modules")
    if cfg.lancet is not None and cfg.lancet.get("partitions", 1) != 1 and lina.packing == AUTO:
        problems.append(f"{what} does not combine with {SECTION}.lancet.partitions "
                        f"({cfg.lancet.get('partitions')!r}): \"auto\" times the schedule's micro-ops, which "
                        "partitioned calls do not run; give a fixed packing")
    if lina.inference is not None:
        problems.append(f"{what} does not combine with {SECTION}.lina.inference (its replicas assume stock homes)")
    device = getattr(engine, "device", None)
    if lina.packing == AUTO and getattr(device, "type", str(device)) == "cuda":
        problems.append(f'{what}: "auto" times the micro-ops by the wall clock, which on CUDA measures kernel '
                        "launches; give a fixed packing there")
    return problems


def layout_problems(layout: ParallelLayout, num_experts: int, lina: LinaConfig) -> List[str]:
    """Why the swapped layers' ``layout`` cannot pack (a fixed p must divide ep; MP and ESP 1)."""
    problems = packing_layout_problems(lina.packing, layout, num_experts, f"{SECTION}.lina")
    if layout.mp != 1 or layout.esp != 1:
        problems.append(f"{FIELD} ({lina.packing!r}) runs with tensor parallelism 1 and esp 1 (the layout has "
                        f"mp {layout.mp}, esp {layout.esp})")
    return problems


class PackedLayer:
    """One swapped DeepSpeed MoE layer (``moe``: ``deepspeed.moe.layer.MoE``) as the controller sees it: its
    ``name``, ``config``, ``groups``, ``rec`` and ``schedule``; setting ``schedule`` replaces the plugin's
    SwappedLayer record in ``table``."""

    def __init__(self, moe: torch.nn.Module, table: Any):
        self.moe, self._table = moe, table

    @property
    def swapped(self) -> Any:
        return self._table[self.moe.deepspeed_moe]

    name = property(lambda self: self.swapped.name)
    config = property(lambda self: self.swapped.schedule.config)
    groups = property(lambda self: self.swapped.groups)
    rec = property(lambda self: self.swapped.schedule.rec)
    experts = property(lambda self: self.moe.deepspeed_moe.experts.deepspeed_experts)

    @property
    def schedule(self) -> Any:
        return self.swapped.schedule

    @schedule.setter
    def schedule(self, value: Any) -> None:
        if self.moe.deepspeed_moe in self._table:          # gone once the plugin is disabled
            self._table[self.moe.deepspeed_moe] = dataclasses.replace(self.swapped, schedule=value)

    def rebuilt(self, groups: MoEProcessGroups, schedule: Any, lane: Any = None) -> None:
        self._table[self.moe.deepspeed_moe] = dataclasses.replace(self.swapped, schedule=schedule, groups=groups,
                                                                  lane=lane)


def regroup_deepspeed(layers: List[PackedLayer], groups: MoEProcessGroups, optimizer: Optional[Any], *,
                      register: Register, engine_for: Optional[Callable[[MoEProcessGroups], Any]] = None,
                      before_move: Optional[Callable[[], Tuple[Any, Optional[Carried]]]] = None) -> None:
    """Move ``layers`` onto ``groups``' layout (module docstring). Every check runs before anything moves.
    ``engine_for(groups)``: the communication engine with a pipeline lane on ``groups`` (the layout's twins),
    for layers that PipeMoE pipelines or Lancet overlaps: their executor and schedule are rebuilt on it. ``before_move()``, once the
    checks passed: the optimizer to move the state of instead of ``optimizer``, and more tensors shaped like each
    parameter (by ``id``: ZeRO's master values and moments, patches/deepspeed_zero_state.py), moved with the
    experts and keyed by the new expert parameters after."""
    old = layers[0].groups
    num_experts = layers[0].config.num_experts
    problems = regroup_problems(old.layout, groups.layout, num_experts)
    problems += [f"layer {layer.name}: on layout {layer.groups.layout}, not {old.layout}" for layer in layers
                 if layer.groups.layout != old.layout]
    if problems:
        raise ValueError(f"{FIELD}: cannot regroup: " + "; ".join(problems))
    pipelined = [layer.swapped.lane is not None or layer.rec.while_in_flight is not None for layer in layers]
    if any(pipelined) and engine_for is None:
        raise ValueError(f"{FIELD}: pipelined (or Lancet's) layers regroup with an engine for the new layout")
    comm = engine_for(groups) if any(pipelined) else None        # collective the first time, before moving
    schedules = [rebuild_schedule(layer.schedule, groups, dataclasses.replace(layer.rec, engine=comm) if lane else None)
                 for layer, lane in zip(layers, pipelined)]     # raises before moving
    lanes = [build_executor(layer.swapped.pipeline_degree, None, comm) if layer.swapped.lane is not None else None
             for layer in layers]
    if old.layout.ep == groups.layout.ep:
        return
    carried: Optional[Carried] = None
    if before_move is not None:
        optimizer, carried = before_move()
    name, ep_pg = register(groups.layout)
    lists = [(f"{FIELD}: layer {layer.name}", layer.experts,
              functools.partial(_resize, layer, optimizer=optimizer, name=name)) for layer in layers]
    grads = regroup_modules(lists, num_experts, old, groups, layers[0].rec, optimizer, carried=carried)
    for p in (p for layer in layers for p in layer.experts.parameters()):
        if id(p) in grads:
            p.grad = grads[id(p)].clone()
    local = num_experts // groups.layout.ep
    for layer, schedule, lane in zip(layers, schedules, lanes):
        moe, inner = layer.moe, layer.moe.deepspeed_moe
        moe.ep_size = inner.ep_size = groups.layout.ep
        moe.num_local_experts = inner.num_local_experts = inner.experts.num_local_experts = local
        moe.expert_group_name, inner.ep_group = name, ep_pg     # the gate keeps the stock EP group (docstring)
        layer.rebuilt(groups, schedule, lane)
    logger.info("moe_plugins: Lina packing regrouped %d DeepSpeed MoE layers from ep %d to ep %d (%d experts per "
                "rank, DeepSpeed group %s)", len(layers), old.layout.ep, groups.layout.ep, local, name)


def _resize(layer: PackedLayer, local: int, scalars: Mapping[str, Dict[str, Any]], *, optimizer: Optional[Any],
            name: str) -> None:
    """``layer``'s expert modules grown or shrunk to ``local``, in the optimizer too; every expert parameter
    names DeepSpeed's group ``name``."""
    groups = resize_experts(layer.experts, local, optimizer, scalars, f"{FIELD}: layer {layer.name}")
    for p in layer.experts.parameters():
        p.allreduce, p.group_name = False, name
    for group in groups.values():
        if "name" in group:                   # DeepSpeed's MoE groups: ZeRO 1/2 reduce them over this group
            group["name"] = name


class EnginePacker:
    """Packing on one DeepSpeed engine (module docstring). ``controller`` is None until the engine has an
    optimizer (an engine without one trains nothing, and stays unpacked)."""

    WRAPPED = ("step", "save_checkpoint", "load_checkpoint")

    def __init__(self, engine: Any, layers: List[PackedLayer], lina: LinaConfig, register: Register,
                 groups_for: Callable[[ParallelLayout], MoEProcessGroups],
                 engine_for: Callable[[MoEProcessGroups], Any]):
        self.engine, self.layers, self.lina = engine, layers, lina
        self.register, self.groups_for, self.engine_for = register, groups_for, engine_for
        self.reducer: Any = None                 # Lina's GradReducer: its lane follows pipelined layers' engine
        self.stage = int(engine.zero_optimization_stage())
        self.controller: Optional[PackingController] = None
        self._zero_built = False                # ZeRO 1/2: the engine has built its ZeRO optimizer

    def patcher(self) -> Patcher:
        """The wrappers, and ``engine.moe_plugins_checkpoint_ep``: the stock EP the engine's checkpoint files are
        written and read at (patches/deepspeed_reshard.current_layout reads it)."""
        names = ("_configure_optimizer" if self.stage == 0 else "_configure_zero_optimizer",) + self.WRAPPED
        patches = [Patch(self.engine, name, functools.partial(getattr(self, name.lstrip("_") + "_"),
                                                              getattr(self.engine, name))) for name in names]
        patches.append(Patch(self.engine, "moe_plugins_checkpoint_ep", self.layers[0].groups.layout.ep))
        return Patcher(patches, logger=logger)

    def configure_optimizer_(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """ZeRO 0: once the engine's optimizer is the torch optimizer itself."""
        out = original(*args, **kwargs)
        self._control(self.engine.optimizer)
        return out

    def configure_zero_optimizer_(self, original: Callable, optimizer: Any) -> Any:
        """ZeRO 1/2: a fixed packing regroups the torch optimizer (no state yet) before ZeRO flattens its groups;
        later regroups rebuild the ZeRO optimizer through the engine's ``_configure_zero_optimizer`` again (with
        every wrapper on it, Lina's hooks included: :meth:`_regroup`)."""
        if self.controller is None:
            self._control(optimizer)
        zero = original(optimizer)
        self._zero_built = True
        return zero

    def _control(self, optimizer: Any) -> None:
        if unfused(optimizer):                # fp16/bf16 at ZeRO 0: the torch optimizer inside steps the masters
            optimizer = optimizer.optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            fused = (" (DeepSpeed's wrapper of a fused Adam in fp16/bf16 at ZeRO 0: set optimizer.params.torch_adam "
                     "true, or use zero_optimization.stage 1 or 2)") if hasattr(optimizer, "fp32_groups_flat") else ""
            raise ValueError(f"{FIELD} ({self.lina.packing!r}) moves the state of a torch optimizer keyed by the "
                             f"parameters; the engine's optimizer is {type(optimizer).__qualname__}{fused}")
        base = self.layers[0].groups
        self.controller = PackingController(
            self.layers, base, packing=self.lina.packing, optimizer=optimizer, path=f"{SECTION}.lina",
            regroup=self._regroup, groups_for=lambda p: self.groups_for(packed_layout(base.layout, p)))

    def _regroup(self, layers: List[PackedLayer], groups: MoEProcessGroups, optimizer: Optional[Any]) -> None:
        """The controller's regroup; once ZeRO 1/2 built its optimizer, that optimizer is rebuilt around it
        (patches/deepspeed_zero_state.py), the experts' master values and state moving with them."""
        if unfused(self.engine.optimizer):
            self._regroup_unfused(layers, groups)
        elif not self._zero_built:
            regroup_deepspeed(layers, groups, optimizer, register=self.register, engine_for=self.engine_for)
            self.engine.param_names = {p: n for n, p in self.engine.module.named_parameters()}   # ZeRO names them
        else:
            from moe_plugins.patches import deepspeed_zero_state as zero_state
            taken: Dict[str, Any] = {}

            def release():                     # after the checks: the old ZeRO optimizer's state, whole
                taken["snap"] = zero_state.snapshot(self.engine.optimizer)
                taken["basic"] = zero_state.release(self.engine.optimizer)
                return taken["basic"], taken["snap"].values
            regroup_deepspeed(layers, groups, None, register=self.register, engine_for=self.engine_for,
                              before_move=release)
            if taken:                          # something moved: ZeRO built anew on the regrouped parameters
                self._rebuilt(lambda: self.engine._configure_zero_optimizer(taken["basic"]))
                zero_state.restore(self.engine.optimizer, taken["snap"])
        if self.reducer is not None and layers[0].rec.engine is not self.reducer.engine:
            self.reducer.engine = layers[0].rec.engine    # one engine orders the exchanges and the micro-ops

    def _regroup_unfused(self, layers: List[PackedLayer], groups: MoEProcessGroups) -> None:
        """fp16/bf16 at ZeRO 0 (``FP16_UnfusedOptimizer``): taken off the model, every master and its moments carried
        (the experts' through the regroup), and built anew on the regrouped parameters by the engine, as its
        ``_configure_optimizer`` does (patches/deepspeed_zero_state.py)."""
        from moe_plugins.patches import deepspeed_zero_state as zero_state
        taken: Dict[str, Any] = {}

        def release():
            taken["basic"], taken["carried"], taken["scalars"] = zero_state.unfused_release(self.engine.optimizer)
            return taken["basic"], taken["carried"]
        dtype = self.engine.optimizer.fp16_groups[0][0].dtype
        regroup_deepspeed(layers, groups, None, register=self.register, engine_for=self.engine_for,
                          before_move=release)
        if taken:
            self._rebuilt(lambda: self.engine._configure_fp16_optimizer(taken["basic"], dtype))
            zero_state.unfused_restore(self.engine.optimizer, taken["carried"], taken["scalars"])

    def _rebuilt(self, build: Callable[[], Any]) -> None:
        """The engine's optimizer built anew by ``build`` over the regrouped parameters (named again, as the
        engine names them for ZeRO), with the old one's loss scale (fp16: ``deepspeed_zero_state.loss_scale``)."""
        scale = loss_scale(self.engine.optimizer)
        self.engine.param_names = {p: n for n, p in self.engine.module.named_parameters()}
        self.engine.optimizer = build()
        for name, value in scale.items():
            setattr(self.engine.optimizer, name, value)

    def step_(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        before = self.engine.global_steps
        out = original(*args, **kwargs)
        if self.controller is not None and self.engine.global_steps != before:
            self.controller.step_end()
        return out

    def save_checkpoint_(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        with self._stock():
            return original(*args, **kwargs)

    def load_checkpoint_(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        with self._stock():
            return original(*args, **kwargs)

    def _stock(self) -> ContextManager[None]:
        """Inside: the experts on the stock layout (collective on the way in and out when packed)."""
        return self.controller.unpacked() if self.controller is not None else nullcontext()

