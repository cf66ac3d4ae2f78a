"""Lina's gradient micro-ops inside DeepSpeed's own reduction, ZeRO 0, 1 and 2 (docs/deepspeed.md, "Lina").

Each dense gradient is submitted to :class:`~moe_plugins.lina.reducer.GradReducer` on the MoE layout's DP group
as soon as DeepSpeed is done accumulating it, on the backward passes where DeepSpeed reduces it:

- ZeRO 0, and ZeRO 1 without ``overlap_comm``: a post-accumulate-grad hook at the gradient-accumulation
  boundary submits ``param.grad`` during backward. ZeRO 1's ``reduce_ready_partitions_and_remove_grads`` first
  waits for that parameter's micro-ops, then copies the summed gradient into its bucket as usual.
- ZeRO 2 (and ZeRO 1 with ``overlap_comm``): after ``reduce_ready_partitions_and_remove_grads(param, i)`` has
  moved the gradient into its IPG bucket, the bucket view (``param.grad``) is submitted.

DeepSpeed's own dense collective then waits instead of running: ``DeepSpeedEngine._reduce_non_expert_gradients``
(ZeRO 0) and ``DeepSpeedZeroOptimizer.average_tensor`` (ZeRO 1/2) first wait for the micro-ops of every dense
gradient involved (submitting any not yet submitted), then run as stock with ``deepspeed.comm.all_reduce`` /
``reduce`` (SUM) on the DP group replaced by a no-op for the duration of the call. Collectives on other groups
(expert-DP) run; partitions and bookkeeping stay DeepSpeed's, and so does the order of division and sum
(``GradScaling``): ZeRO 0 multiplies each gradient before its sum and/or the sum after it, as
``prescale_gradients`` and ``gradient_predivide_factor`` say, so Lina does both on each dense gradient (at submit,
after the wait) and DeepSpeed's call runs without them, and where its ``communication_data_type`` differs from the
gradients' it sums an fp32 (say) copy of each and copies the result back, as DeepSpeed casts its bucket; ZeRO
1/2's reduce-scatter path (the one DeepSpeed allows with MoE) divides each bucket before its sum, so Lina divides
each dense gradient when it submits it, the bucket's expert slices before DeepSpeed's call, and that call runs
without its division. In fp16 this is more than rounding: a sum of loss-scaled gradients overflows where the sum
of the divided ones may not.
Expert parameters (``allreduce=False``) are never reduced by Lina.

Stock ZeRO 1/2 all-reduces each bucket too (``use_multi_rank_bucket_allreduce``, the default); with it off,
it reduces each partition slice to its owner, and Lina's all-reduce then moves more bytes for the same result.

All patches are per DeepSpeed engine and per ZeRO optimizer (instance attributes, through a Patcher), undone by
the engine's ``destroy()`` or by :meth:`LinaHooks.remove` (``disable()``). Every rank must produce the same dense
gradients in the same order (DDP's rule): the micro-ops are matched across ranks by their order on the
background lane.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.groups import Group
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.patcher import Patch, Patcher, undo_all
from moe_plugins.core.plugin_config import SECTION
from moe_plugins.lina.config import LinaConfig
from moe_plugins.lina.microops import micro_op_bytes
from moe_plugins.lina.reducer import GradReducer, PendingReduce
from moe_plugins.patches import deepspeed_lina_packing as packing
from moe_plugins.patches.deepspeed_lina_config import (GradScaling, config_problems, reduce_scatter_scaling,
                                                       zero0_scaling)

logger = logging.getLogger("moe_plugins.deepspeed")

PATH = f"{SECTION}.lina"


def _is_moe_param(param: torch.Tensor) -> bool:
    from deepspeed.moe.utils import is_moe_param
    return is_moe_param(param)


# deepspeed.comm's reductions (0.19.8) and their leading positional parameters; its timed_op wrapper hides them
_COLLECTIVE_ARGS = {"all_reduce": ("tensor", "op", "group"), "reduce": ("tensor", "dst", "op", "group")}


def _is_sum(op: Any) -> bool:
    return op is None or str(getattr(op, "name", op)).upper().endswith("SUM")


@dataclass
class _Setup:
    """One DeepSpeed engine being configured with a ``lina`` section: the layouts its MoE layers use."""
    config: LinaConfig
    layouts: Dict[ParallelLayout, Any] = field(default_factory=dict)   # layout -> (groups, comm, profile_fn)


class LinaEngine:
    """Lina for one DeepSpeed engine: its reducer on the layout's DP group, the micro-ops in flight (keyed by
    parameter), the patches and hooks, and counters for the tests (``submitted``; ``skipped``: DeepSpeed's
    dense collectives replaced by the wait; ``passed``: other collectives inside the wrapped calls)."""

    def __init__(self, ds_engine, reducer: GradReducer, dp: Group, dense: List[torch.nn.Parameter]):
        self.ds_engine, self.reducer, self.dp, self.dense = ds_engine, reducer, dp, dense
        self.pending: Dict[int, Optional[PendingReduce]] = {}   # None: summed, not yet consumed by DeepSpeed
        self.patchers: List[Patcher] = []
        self.handles: List[Any] = []
        self.submitted = self.skipped = self.passed = 0
        self.mode = ""
        self.scaling = GradScaling()            # DeepSpeed's division around the sum, done by Lina instead
        self.sum_dtype: Optional[torch.dtype] = None   # ZeRO 0: DeepSpeed's communication_data_type
        self.staged: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}   # (sum in sum_dtype, the gradient)
        self.packer: Any = None                 # patches/deepspeed_lina_packing.EnginePacker when packing != 1

    # -- micro-ops -------------------------------------------------------------------------------------

    def submit(self, param: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        if grad is None:
            return
        if id(param) in self.pending:
            raise RuntimeError(f"{PATH}: a gradient was submitted twice before DeepSpeed reduced it (shape "
                               f"{tuple(param.shape)}); was backward run twice on one micro-batch?")
        flat = grad.view(-1)
        if self.sum_dtype is not None and flat.dtype != self.sum_dtype:     # as allreduce_bucket casts its bucket
            self.staged[id(param)] = (flat.to(self.sum_dtype), flat)
            flat = self.staged[id(param)][0]
        self.scaling.apply(self.scaling.before, flat)
        self.pending[id(param)] = self.reducer.submit(flat, self.dp)
        self.submitted += 1

    def wait(self, param: torch.Tensor) -> None:
        handle = self.pending.get(id(param))
        if handle is not None:
            handle.wait()
            self.pending[id(param)] = None

    def settle(self, params: List[torch.Tensor], grad_of: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> None:
        """Before DeepSpeed's dense collective: every dense gradient it is about to reduce is summed. Those not
        submitted yet are submitted now (in ``params`` order, the same on every rank), then all are waited."""
        for p in params:
            if id(p) not in self.pending:
                self.submit(p, grad_of(p))
        for p in params:
            handle = self.pending.pop(id(p), None)
            if handle is not None:
                handle.wait()
                staged = self.staged.pop(id(p), None)
                self.scaling.apply(self.scaling.after, grad_of(p) if staged is None else staged[0])
                if staged is not None:
                    staged[1].copy_(staged[0])

    def boundary_hook(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook (ZeRO 0; ZeRO 1 without overlap_comm): submit where DeepSpeed will reduce."""
        ds = self.ds_engine
        if ds.is_gradient_accumulation_boundary() and ds.enable_backward_allreduce and not ds.inside_no_sync_ctxt:
            self.submit(param, param.grad)

    def undivided(self, owner: Any) -> Any:
        """DeepSpeed's own scaling off for one call (``gradient_average`` of ``owner``: the engine at ZeRO 0, the ZeRO
        optimizer at 1/2) where Lina scales instead (:attr:`scaling`)."""
        return Patcher([Patch(owner, "gradient_average", False)]) if self.scaling.active else contextlib.nullcontext()

    @contextlib.contextmanager
    def skipping(self, dp_pg: Any) -> Iterator[None]:
        """DeepSpeed's SUM all_reduce / reduce on ``dp_pg`` do nothing (Lina summed already); others run."""
        from deepspeed import comm as ds_comm
        engine = self

        def make(name: str, original: Callable) -> Callable:
            def collective(*args, **kwargs):
                bound = {**dict(zip(_COLLECTIVE_ARGS[name], args)), **kwargs}
                if bound.get("group") is dp_pg and _is_sum(bound.get("op")):
                    engine.skipped += 1
                    return None
                engine.passed += 1
                return original(*args, **kwargs)
            collective.__wrapped__ = original
            return collective
        with Patcher([Patch(ds_comm, name, make(name, getattr(ds_comm, name))) for name in _COLLECTIVE_ARGS],
                     logger=logger):
            yield

    # -- DeepSpeed's hook points -----------------------------------------------------------------------

    def zero0(self, original: Callable) -> Callable:
        def _reduce_non_expert_gradients(grads, elements_per_buffer):
            self.settle([p for p in self.dense if p.grad is not None], lambda p: p.grad)
            from deepspeed.utils import groups as ds_groups
            with self.undivided(self.ds_engine), self.skipping(ds_groups._get_sequence_data_parallel_group()):
                return original(grads, elements_per_buffer)
        return _reduce_non_expert_gradients

    def zero12(self, zero) -> None:
        """Patch the ZeRO 1/2 optimizer of this engine (its instance attributes)."""
        hooked = bool(zero.partition_gradients or zero.overlap_comm or zero.use_grad_accum_attribute)
        self.mode = "after-bucketing" if hooked else "boundary-hook"
        if zero.reduce_scatter:                     # stock divides each bucket before it sums it
            dp_size = dist.get_world_size(group=zero.dp_process_group) / float(zero.sequence_parallel_size)
            self.scaling = reduce_scatter_scaling(zero.gradient_average, dp_size)
        original_ready, original_average = zero.reduce_ready_partitions_and_remove_grads, zero.average_tensor

        def reduce_ready_partitions_and_remove_grads(param, i):
            if not hooked:
                self.wait(param)
                return original_ready(param, i)
            result = original_ready(param, i)
            bucket = zero.ipg_buckets.get(zero.get_param_comm_dtype(param))
            if (bucket is not None and bucket.params and bucket.params[-1][2] == zero.get_param_id(param)
                    and not _is_moe_param(param)):
                self.submit(param, zero.get_gradient_for_reduction(param))
            return result

        def average_tensor(tensor, communication_data_type):
            self._check_dtypes({tensor.dtype}, communication_data_type)
            bucket = zero.ipg_buckets[communication_data_type]
            params = [zero.bit16_groups[i][idx] for i, idx, _ in bucket.params]
            self.settle([p for p in params if not _is_moe_param(p)], zero.get_gradient_for_reduction)
            if self.scaling.active:            # the dense slices were divided at submit: the rest here, as stock
                offset = 0                     # divides the whole bucket (its params' gradients back to back)
                for p in params:
                    if _is_moe_param(p):
                        self.scaling.apply(self.scaling.before, tensor.narrow(0, offset, p.numel()))
                    offset += p.numel()
            with self.undivided(zero), self.skipping(zero.dp_process_group):
                return original_average(tensor, communication_data_type)

        patches = [Patch(zero, "reduce_ready_partitions_and_remove_grads", reduce_ready_partitions_and_remove_grads),
                   Patch(zero, "average_tensor", average_tensor)]
        self.patchers.append(Patcher(patches, logger=logger).apply())
        if not hooked and not self.handles:        # once: a ZeRO optimizer rebuilt by packing keeps the dense hooks
            self.handles += [p.register_post_accumulate_grad_hook(self.boundary_hook) for p in self.dense]

    @staticmethod
    def _check_dtypes(dtypes, comm_dtype) -> None:
        if dtypes - {comm_dtype}:
            raise ValueError(f"{PATH}: DeepSpeed would reduce {sorted(map(str, dtypes))} gradients in "
                             f"communication_data_type {comm_dtype}; Lina needs them equal")

    def remove(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()
        patchers, self.patchers = self.patchers, []
        try:
            undo_all(patcher.restore for patcher in reversed(patchers))
        finally:
            self.pending.clear()
            self.staged.clear()


def _packer(engine, model: torch.nn.Module, lina: LinaConfig, layout: ParallelLayout, plugin: Any,
            problems: List[str]) -> Optional[packing.EnginePacker]:
    """The engine's packer when ``lina.packing`` != 1 (its layout's problems added to ``problems``)."""
    if lina.packing == 1:
        return None
    from deepspeed.moe.layer import MoE
    layers = [packing.PackedLayer(m, plugin.swapped_layers) for m in model.modules()
              if isinstance(m, MoE) and m.deepspeed_moe in plugin.swapped_layers]
    problems += packing.layout_problems(layout, layers[0].config.num_experts, lina)
    stock = layers[0].moe.expert_group_name

    def register(target: ParallelLayout):
        name = stock if target == layout else f"ep_size_{target.ep}"
        return name, plugin.register_groups(name, plugin.host_groups(target, False))

    return packing.EnginePacker(engine, layers, lina, register, lambda t: plugin.host_groups(t, False).groups,
                                lambda groups: plugin.lane_engine(groups, True, True))   # with Lina's lane


class LinaHooks:
    """The Lina part of one ``moe_plugins.enable()``: which DeepSpeed engine is being set up with a ``lina``
    section (:attr:`current`), and the engines set up so (:attr:`engines`)."""

    def __init__(self):
        self.current: Optional[_Setup] = None
        self.engines: List[LinaEngine] = []

    def begin(self, engine, model: torch.nn.Module, cfg) -> Optional[_Setup]:
        """Validate before anything is set up: one ValueError listing every problem. None: no Lina here (or
        only its inference part, patches/deepspeed_lina_infer.py)."""
        if cfg is None or not cfg.enabled or cfg.lina is None:
            return None
        import deepspeed
        lina = LinaConfig.from_dict(cfg.lina, PATH)
        if not lina.training:
            return None
        problems = config_problems(engine, model, lina, deepspeed.__version__)
        problems += packing.config_problems(engine, cfg, lina)
        if problems:
            raise ValueError("moe_plugins cannot run Lina on this DeepSpeed engine: " + "; ".join(problems))
        return _Setup(config=lina)

    def profile_problems(self, layout: ParallelLayout, read_profile: Callable[[ParallelLayout], Any]) -> List[str]:
        """``micro_op_mb: "auto"`` reads the all-reduce term of the profile cached for ``layout``: checked when a
        layer is validated, before its groups are built (``read_profile`` raises a ValueError naming an
        unusable file)."""
        lina = self.current.config if self.current is not None else None
        if lina is None or not lina.priority or lina.micro_op_mb != "auto":
            return []
        try:
            profile = read_profile(layout)
        except ValueError as exc:
            return [f'{PATH}.micro_op_mb ("auto") reads the cost profile cached for this layout, which cannot be '
                    f"used: {exc}"]
        if profile is None or "all_reduce@dp" not in profile.models:
            what = "none is cached" if profile is None else "the cached one has no all_reduce@dp model"
            return [f'{PATH}.micro_op_mb ("auto") needs a cost profile with the data-parallel all-reduce for this '
                    f"layout, and {what}: run `moe-plugins profile` on this cluster, or give a size in MB"]
        return []

    def layer(self, layout: ParallelLayout, groups: Any, comm: Any, profile_fn: Callable[[], Any]) -> None:
        """A MoE layer of the engine being set up runs on ``layout`` with the engine ``comm``."""
        self.current.layouts.setdefault(layout, (groups, comm, profile_fn))

    def install(self, setup: Optional[_Setup], engine, model: torch.nn.Module, plugin: Any) -> None:
        """After the engine's MoE layers are set up (``plugin``: the DeepSpeedPlugin that swapped them): check the
        layout, then hook this engine (collective-free)."""
        if setup is None:
            return
        from deepspeed.utils import groups as ds_groups
        problems, packer = [], None
        if len(setup.layouts) != 1:
            found = "; ".join(f"mp={lay.mp} ep={lay.ep} esp={lay.esp}" for lay in setup.layouts)
            problems.append(f"{PATH} needs the model's swapped MoE layers on exactly one layout; found "
                            f"{len(setup.layouts)} ({found or 'no DeepSpeed MoE layer was swapped'})")
        else:
            (layout, (groups, comm, profile_fn)), = setup.layouts.items()
            ds_dp = tuple(dist.get_process_group_ranks(ds_groups._get_sequence_data_parallel_group()))
            if ds_dp != tuple(groups.dp.ranks):
                problems.append(f"{PATH}: DeepSpeed's data-parallel group {list(ds_dp)} differs from the MoE "
                                f"layout's {list(groups.dp.ranks)} (mp={layout.mp} ep={layout.ep} esp={layout.esp})")
            packer = _packer(engine, model, setup.config, layout, plugin, problems)
        if problems:
            raise ValueError("moe_plugins cannot run Lina on this DeepSpeed engine: " + "; ".join(problems))
        lina = setup.config
        size = micro_op_bytes(lina.micro_op_mb, profile_fn() if lina.micro_op_mb == "auto" else None) \
            if lina.priority else None
        dense = [p for p in model.parameters() if p.requires_grad and not _is_moe_param(p)]
        state = LinaEngine(engine, GradReducer(comm, micro_op_bytes=size, priority=lina.priority), groups.dp, dense)
        self.engines.append(state)
        if packer is not None:
            state.packer, packer.reducer = packer, state.reducer
            state.patchers.append(packer.patcher().apply())
        stage = engine.zero_optimization_stage()
        if stage == 0:
            dp_size = dist.get_world_size(ds_groups._get_sequence_data_parallel_group()) / engine.sequence_parallel_size
            state.mode, state.scaling = "boundary-hook", zero0_scaling(
                engine.gradient_average, engine._config.prescale_gradients, engine.gradient_predivide_factor(), dp_size)
            state.sum_dtype = engine.communication_data_type
            patches = [Patch(engine, "_reduce_non_expert_gradients", state.zero0(engine._reduce_non_expert_gradients))]
            state.handles += [p.register_post_accumulate_grad_hook(state.boundary_hook) for p in dense]
        else:
            patches = [Patch(engine, "_configure_zero_optimizer",
                             self._zero_optimizer(state, engine._configure_zero_optimizer))]
        patches.append(Patch(engine, "destroy", self._destroy(state, engine.destroy)))
        state.patchers.append(Patcher(patches, logger=logger).apply())
        if dist.get_rank() == 0:
            logger.info("moe_plugins: Lina reduces %d dense gradients of this DeepSpeed engine (ZeRO %d) as %s on "
                        "DP %s", len(dense), stage, f"micro-ops of {size} bytes" if size else "one op per gradient",
                        list(groups.dp.ranks))

    @staticmethod
    def _zero_optimizer(state: LinaEngine, original: Callable) -> Callable:
        def _configure_zero_optimizer(optimizer):
            from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
            zero = original(optimizer)
            if type(zero) is not DeepSpeedZeroOptimizer:
                raise ValueError(f"{PATH} supports DeepSpeed's DeepSpeedZeroOptimizer (ZeRO 1/2), not "
                                 f"{type(zero).__name__}")
            ranks = tuple(dist.get_process_group_ranks(zero.dp_process_group))
            shared = [name for name, pg in getattr(zero, "expert_dp_process_group", {}).items()
                      if pg is zero.dp_process_group]
            if ranks != tuple(state.dp.ranks) or shared:
                raise ValueError(f"{PATH}: the ZeRO optimizer's DP group {list(ranks)} must be the MoE layout's "
                                 f"{list(state.dp.ranks)} and distinct from the expert-DP groups (shared: {shared})")
            state.zero12(zero)
            return zero
        return _configure_zero_optimizer

    def _destroy(self, state: LinaEngine, original: Callable) -> Callable:
        def destroy(*args, **kwargs):
            """DeepSpeedEngine.destroy, after Lina's hooks and patches on this engine are undone."""
            try:
                if state in self.engines:
                    self.engines.remove(state)
                state.remove()
            finally:
                outcome = original(*args, **kwargs)
            return outcome
        return destroy

    def remove(self) -> None:
        """Undo every engine's hooks and patches (the first error is raised after all were tried)."""
        engines, self.engines = self.engines, []
        undo_all(state.remove for state in reversed(engines))
