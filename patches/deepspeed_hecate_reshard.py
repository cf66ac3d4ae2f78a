"""Hecate's re-sharding (``"hecate": {"reshard_every": n}``) on a DeepSpeed engine: Algorithm 2 re-homes each
Hecate layer's experts every n optimizer steps (moe_plugins/hecate/reshard.py, rehome.py).

- :func:`reshard_problems`: before the engine sets anything up, the engines it runs on: ZeRO stage 0, 1 or 2, in
  fp32, bf16 or fp16 (the 16-bit model's fp32 masters move as below), with or without ZeRO-Offload
  (``offload_optimizer``: the flat fp32 partitions and their moments then live on the host; the same views and
  gathers move them there). One line per problem, naming the field.
- ZeRO 1/2 (:func:`zero_views`): the experts' parameters are views of the group's flat buffer, and the fp32
  master partition and its Adam moments are flat tensors of the same layout; with the expert group on one rank
  (expert-DP 1: ``ep_size`` = world) each expert parameter's slices of those move with it, in place. An expert
  group partitioned over expert-DP > 1 holds only a slice of each expert here: its master values and moments
  are gathered whole for the move (collective), moved with the experts, and this rank's slices written back
  after it (:class:`moe_plugins.patches.deepspeed_zero_state.GatheredState`); so for ``BF16_Optimizer`` (bf16
  with fp32 gradient accumulation), whose flat fp32 partitions over DP are ZeRO 1's layout. fp16 and bf16 at
  ZeRO 0 run ``FP16_UnfusedOptimizer`` (an fp32 master per parameter, moved with it: :func:`unfused_views`), or
  around a fused Adam ``FP16_Optimizer`` (one flat fp32 master per group: :func:`fused_views`). The loss scale
  (fp16) is the optimizer's and stays as it is.
- :class:`EngineResharder`: after the engine configured its model, wraps three methods of that engine (instance
  attributes, taken off by :meth:`EngineResharder.remove`):

  - ``step``: after an optimizer step (a gradient-accumulation boundary: ``global_steps`` moved), the
    Resharder counts it and re-shards every n (collective; the engine's optimizer state moves with the experts).
  - ``save_checkpoint``: written with every expert on its stock owner (moved there and back around the write),
    so the files are stock DeepSpeed's: a run without the plugin, or without re-sharding, loads them.
  - ``load_checkpoint``: the experts go to their stock owners first, so the loaded files (stock layout) land on
    the right experts, parameters and optimizer state alike.

A DeepSpeed expert module is one slot: its parameters whole (``nn.Linear`` weights and biases), in the
module's order. With ``"pool_slots": true`` (Algorithm 2 as the paper has it) the engine's re-sharded layers share
their slots (:class:`SlotPool`): a rank may hold more experts of one layer and fewer of another, an expert may
sit in another layer's module, and each layer reads its experts from the pool (``HecateBlockHooks.pools``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, List, Mapping, MutableMapping, Optional, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.plugin_config import SECTION
from moe_plugins.hecate.config import NAME, reshard_interval
from moe_plugins.hecate.rehome import Extra, Resharder
from moe_plugins.hecate.pool import SlotPool
from moe_plugins.patches.deepspeed_zero_state import unfused, unfused_masters

logger = logging.getLogger(__name__)
FIELD = f"{SECTION}.{NAME}.reshard_every"
WRAPPED = ("step", "save_checkpoint", "load_checkpoint")


def reshard_problems(engine: Any, cfg: Any) -> List[str]:
    """What keeps re-sharding off this engine (empty: none, or no re-sharding asked for)."""
    every = reshard_interval(cfg)
    if not every:
        return []
    problems = []
    stage = int(engine.zero_optimization_stage())
    if stage not in (0, 1, 2):
        problems.append(f"{FIELD} ({every}) runs on ZeRO stage 0, 1 or 2, and zero_optimization.stage is {stage}")
    return problems


def check(engine: Any, cfg: Any) -> None:
    problems = reshard_problems(engine, cfg)
    if problems:
        raise ValueError("moe_plugins cannot re-shard Hecate's experts on this DeepSpeed engine: " + "; ".join(problems))


def slot_pool(moes: List[torch.nn.Module], schedules: List[Any]) -> SlotPool:
    """Pooled slots on one engine over its re-sharded DeepSpeed ``MOELayer``s (moe_plugins/hecate/pool.py)."""
    return SlotPool(moes, [list(moe.experts.deepspeed_experts) for moe in moes], schedules)


class EngineResharder:
    """Re-sharding on one engine (module docstring); :meth:`install` is a no-op where no layer asks for it.
    ``pools``: where a pooled engine registers its layers' :class:`SlotPool` (the adapter's weights read it)."""

    def __init__(self, pools: Optional[MutableMapping[torch.nn.Module, SlotPool]] = None) -> None:
        self.engine: Any = None
        self.resharder: Optional[Resharder] = None
        self.pools = pools if pools is not None else {}
        self._pooled: List[torch.nn.Module] = []
        self._checked = False

    def install(self, engine: Any, swapped: Mapping[torch.nn.Module, Any]) -> None:
        """After DeepSpeed configured the model (``swapped``: DeepSpeed MOELayer -> the adapter's SwappedLayer)."""
        layers, moes, every, pooled = [], [], set(), set()
        for moe in engine.module.modules():          # the model's order: the same on every rank
            layer = swapped.get(moe)
            options = getattr(getattr(layer, "schedule", None), "options", None)
            if getattr(options, "reshard_every", 0):
                layers.append((layer.schedule, functools.partial(_slots, moe)))
                moes.append(moe)
                every.add(options.reshard_every)
                pooled.add(options.pool_slots)
        if not layers:
            return
        if len(every) != 1 or len(pooled) != 1:
            raise ValueError(f"{FIELD}: the engine's Hecate layers ask for several intervals {sorted(every)} or "
                             f"pool_slots settings {sorted(pooled)}")
        pool = pooled.pop()
        self.engine = engine
        self.resharder = Resharder(layers, every.pop(), world=dist.group.WORLD, pooled=pool)
        if pool:
            shared = slot_pool(moes, [s for s, _ in layers])
            for moe in moes:
                self.pools[moe] = shared
            self._pooled = moes
        for name in WRAPPED:
            setattr(engine, name, functools.partial(getattr(self, f"_{name}"), getattr(engine, name)))
        logger.info("moe_plugins: Hecate re-shards the experts of %d layers every %d optimizer steps", len(layers),
                    self.resharder.every)

    def remove(self) -> None:
        for moe in self._pooled:
            self.pools.pop(moe, None)
        self._pooled = []
        engine, self.engine = self.engine, None
        for name in WRAPPED if engine is not None else ():
            engine.__dict__.pop(name, None)

    def _moving(self) -> Tuple[Optional[torch.optim.Optimizer], Optional[Extra]]:
        """What moves with the experts (:func:`_optimizer`), every expert parameter's ZeRO views checked the first
        time (one in no ZeRO group is refused at the first step, whether or not that step moves anything)."""
        optimizer, extra = _optimizer(self.engine)
        if extra is not None and not self._checked and not hasattr(extra, "done"):
            for _, slots in self.resharder.layers:
                for slot in slots():
                    for param, _ in slot:
                        extra(param)
            self._checked = True
        return optimizer, extra

    def _step(self, original, *args, **kwargs):
        before = self.engine.global_steps
        out = original(*args, **kwargs)
        if self.engine.global_steps != before:
            self.resharder.step_end(*self._moving())
        return out

    def _save_checkpoint(self, original, *args, **kwargs):
        with self.resharder.stock_homes(*self._moving()):
            return original(*args, **kwargs)

    def _load_checkpoint(self, original, *args, **kwargs):
        self.resharder.to_stock(*self._moving())
        return original(*args, **kwargs)


def _slots(moe: torch.nn.Module) -> List[List[Any]]:
    return [[(p, None) for p in expert.parameters()] for expert in moe.experts.deepspeed_experts]


def _optimizer(engine: Any) -> Tuple[Optional[torch.optim.Optimizer], Optional[Extra]]:
    """What moves besides the parameters: (a torch optimizer keyed by them (ZeRO 0), or None; the ZeRO 1/2
    views (expert groups on one rank each), or the whole master values and moments gathered for the move and
    written back after it (an expert group partitioned over expert-DP > 1, or BF16_Optimizer's:
    patches/deepspeed_zero_state.py), or the masters of fp16/bf16 at ZeRO 0 (:func:`unfused_views`,
    :func:`fused_views`), or None)."""
    opt = getattr(engine, "optimizer", None)
    if opt is None:
        return None, None
    if hasattr(opt, "fp32_groups_flat_partition"):       # BF16_Optimizer: ZeRO 1's layout (deepspeed_zero_state)
        from moe_plugins.patches.deepspeed_zero_state import GatheredState
        return None, GatheredState(opt)
    if unfused(opt):                                     # FP16_UnfusedOptimizer: fp16/bf16 at ZeRO 0
        return None, unfused_views(opt)
    if int(engine.zero_optimization_stage()) in (1, 2):
        if any(opt.is_moe_group(g) and dist.get_world_size(group=pg) > 1
               for g, pg in zip(opt.optimizer.param_groups, opt.real_dp_process_group)):
            from moe_plugins.patches.deepspeed_zero_state import GatheredState
            return None, GatheredState(opt)
        return None, zero_views(opt)
    if hasattr(opt, "fp32_groups_flat"):                 # FP16_Optimizer: fp16/bf16 at ZeRO 0 with a fused Adam
        return None, fused_views(opt)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"{FIELD}: the engine's optimizer ({type(opt).__qualname__}) is not a torch optimizer "
                         "keyed by the parameters; re-sharding moves that optimizer's state")
    return opt, None


def unfused_views(opt: Any) -> Extra:
    """For DeepSpeed's ``FP16_UnfusedOptimizer`` ``opt`` (fp16/bf16 at ZeRO 0: ``fp16_groups`` of model parameters,
    parallel ``fp32_groups`` of fp32 masters that its torch optimizer steps and keys Adam's state by): a
    parameter's master and the master's moments, whole (nothing is partitioned)."""
    master = unfused_masters(opt)

    def views(param: torch.nn.Parameter) -> List[torch.Tensor]:
        main = master.get(id(param))
        if main is None:
            raise ValueError(f"{FIELD}: an expert parameter {tuple(param.shape)} has no master in DeepSpeed's "
                             f"{type(opt).__qualname__}")
        state = opt.optimizer.state.get(main, {})
        return [main.data] + [state[k] for k in sorted(state, key=str) if torch.is_tensor(state[k])
                              and state[k].shape == main.shape]
    return views


def zero_views(opt: Any) -> Extra:
    """For DeepSpeed's ZeRO 1/2 optimizer ``opt``: a parameter's slices of its group's fp32 master partition and
    of that partition's optimizer state (Adam's moments), shaped like the parameter. A ValueError where the group
    is partitioned over more than one rank (expert-DP > 1), naming the field."""
    index = {id(p): i for i, group in enumerate(opt.bit16_groups) for p in group}

    def views(param: torch.nn.Parameter) -> List[torch.Tensor]:
        i = index.get(id(param))
        if i is None:
            raise ValueError(f"{FIELD}: an expert parameter {tuple(param.shape)} is in no ZeRO parameter group")
        ranks = dist.get_world_size(group=opt.real_dp_process_group[i])
        if ranks != 1:
            raise ValueError(f"{FIELD}: ZeRO stage 1/2 partitions this expert group over {ranks} expert-DP ranks; "
                             "re-sharding there runs with expert-DP 1 (ep_size = world) or on ZeRO stage 0")
        fp32 = opt.single_partition_of_fp32_groups[i]
        return _narrowed(param, opt.bit16_groups_flat[i], fp32, opt.optimizer.state.get(fp32, {}))
    return views


def fused_views(opt: Any) -> Extra:
    """For DeepSpeed's ``FP16_Optimizer`` ``opt`` (fp16 or bf16 at ZeRO 0 around a fused Adam: each group's
    parameters are views of one flat 16-bit buffer, ``fp16_groups_flat``, and its torch optimizer steps one flat
    fp32 master of the same layout, ``fp32_groups_flat``, keying Adam's state by it): a parameter's slices of
    the master and of its moments, shaped like the parameter (nothing is partitioned at ZeRO 0)."""
    index = {id(p): i for i, group in enumerate(opt.fp16_groups) for p in group}

    def views(param: torch.nn.Parameter) -> List[torch.Tensor]:
        i = index.get(id(param))
        if i is None:
            raise ValueError(f"{FIELD}: an expert parameter {tuple(param.shape)} is in no group of DeepSpeed's "
                             f"{type(opt).__qualname__}")
        fp32 = opt.fp32_groups_flat[i]
        return _narrowed(param, opt.fp16_groups_flat[i], fp32, opt.optimizer.state.get(fp32, {}))
    return views


def _narrowed(param: torch.nn.Parameter, flat: torch.Tensor, fp32: torch.Tensor,
              state: Mapping[str, Any]) -> List[torch.Tensor]:
    """``param``'s slices (it is a view of ``flat``) of the flat master ``fp32`` laid out like ``flat``, and of
    the optimizer ``state`` tensors shaped like it, each viewed in the parameter's shape."""
    start, n = (param.data_ptr() - flat.data_ptr()) // param.element_size(), param.numel()
    tensors = [fp32] + [state[k] for k in sorted(state, key=str) if torch.is_tensor(state[k])
                        and state[k].shape == fp32.shape]
    return [t.narrow(0, start, n).view(param.shape) for t in tensors]

