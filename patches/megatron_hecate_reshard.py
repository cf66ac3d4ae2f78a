"""Hecate's re-sharding (``"hecate": {"reshard_every": n}``) on Megatron-core: Algorithm 2 re-homes each Hecate
layer's experts every n optimizer steps (moe_plugins/hecate/reshard.py, rehome.py), under
:func:`moe_plugins.patches.megatron.enable` (the ``--moe-plugins`` flag, or the ``with`` form around building and
training the model).

Runs with Megatron's non-distributed optimizers: fp32 (``FP32Optimizer``, whose Adam state is keyed by the
model's own parameters) and bf16/fp16 (``Float16OptimizerWithFloat16Params``: the torch optimizer holds an fp32
master copy of each parameter, ``param.main_param``, and its Adam state); and with the distributed optimizer at
any expert-DP, where each rank steps a piece of each expert (a flat fp32 master in bf16/fp16, a flat view of the
fp32 parameter otherwise, with their Adam state; patches/megatron_pieces.py), made whole over expert-DP for the
move and written back as the new slot's pieces. :class:`~moe_plugins.patches.megatron_masters.Masters` gives them
to the move.

While enabled, :class:`MegatronResharding` (``handle.hecate``) replaces, through the plugin's Patcher:

- ``DistributedOptimizer.__init__``: after Megatron's, when its buffers hold a re-sharded layer's experts, it
  records each expert parameter's piece (:attr:`MegatronResharding.shards`).
- ``step_with_ready_grads`` of ``FP32Optimizer`` and ``MixedPrecisionOptimizer`` (after its copy of the masters
  to the parameters): after a successful step of a torch optimizer holding re-sharded layers' experts
  (ChainedOptimizer steps its expert optimizer through it), the :class:`Resharder` of that optimizer counts it and
  re-shards every n (collective; values, ``grad`` (fp32: = ``main_grad``, a view of DDP's buffer, in place) and
  Adam's moments move with the experts, and in bf16/fp16 the masters, their gradients and ``main_grad`` too;
  global expert ids never change).
- ``megatron.core.dist_checkpointing.save``: written with every expert on its stock owner (moved there and back
  around the write), so the checkpoint is stock Megatron's; ``async_sharded_save`` is refused (the write would
  outlive the move back). ``dist_checkpointing.load``: the experts go to their stock owners first, so the
  loaded tensors (stock layout) land on the right experts; the optimizer state loaded after follows.

A loop that writes ``state_dict()`` itself (the recipe's per-rank files) uses :meth:`MegatronResharding.stock_homes`
around the write and :meth:`MegatronResharding.to_stock` before reading. A ``SequentialMLP`` expert is one
slot: its parameters whole, in the module's order. With ``"pool_slots": true`` (Algorithm 2 as the paper has it)
the layers one optimizer steps share their slots (:class:`~moe_plugins.hecate.pool.SlotPool`, made with their
Resharder at that optimizer's first step): an expert may sit in another layer's ``SequentialMLP`` (its parameters,
``main_grad`` and Adam moments moved there), and each layer reads its experts from the pool
(:meth:`MegatronResharding.slots_of`); the state dict and checkpoints are written from the stock homes as above.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set

import torch
import torch.distributed as dist

from moe_plugins.core.patcher import Patch
from moe_plugins.core.plugin_config import SECTION
from moe_plugins.hecate.config import NAME
from moe_plugins.hecate.pool import SlotPool
from moe_plugins.hecate.rehome import Resharder
from moe_plugins.patches.megatron_masters import Masters, stepped
from moe_plugins.patches.megatron_pieces import Piece, pieces
from moe_plugins.patches.megatron_steps import after_fp32_steps, after_mixed_precision_steps

logger = logging.getLogger("moe_plugins.megatron")
FIELD = f"{SECTION}.{NAME}.reshard_every"


class MegatronResharding:
    """The enabled plugin's re-sharding state (module docstring): the layers that asked for it (in build order,
    the same on every rank), one :class:`Resharder` per torch optimizer holding their experts."""

    def __init__(self, every: int, pooled: bool = False) -> None:
        self.every, self.pooled = every, pooled
        self.pool: Optional[SlotPool] = None          # pooled: the layers' shared slots, from the first step
        self._layers: List[weakref.ref] = []
        self._resharders: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Optional[Resharder]]" = \
            weakref.WeakKeyDictionary()
        self.shards: Dict[int, Piece] = {}            # expert parameter id -> its distributed optimizer's piece

    def add(self, layer: Any) -> None:
        """Register a ``PluginMoELayer`` running Hecate with ``reshard_every`` (called when it is built)."""
        self._layers.append(weakref.ref(layer))

    def layers(self) -> List[Any]:
        return [layer for layer in (ref() for ref in self._layers) if layer is not None]

    def slots_of(self, layer: Any) -> Optional[List[torch.nn.Module]]:
        """Pooled slots: the modules holding ``layer``'s experts on this rank (None: its own SequentialMLP's)."""
        pool = self.pool
        return pool.experts_of(layer) if pool is not None and pool.holds(layer) else None

    @property
    def resharders(self) -> List[Resharder]:
        return [r for r in self._resharders.values() if r is not None]

    # ---- Megatron's names, replaced while enabled -------------------------------------------------------------

    def patches(self) -> List[Patch]:
        from megatron.core import dist_checkpointing
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        return [Patch(DistributedOptimizer, "__init__", self._wrap_init(DistributedOptimizer.__init__)),
                after_fp32_steps(self._step_end), after_mixed_precision_steps(self._step_end),
                Patch(dist_checkpointing, "save", self._wrap_save(dist_checkpointing.save)),
                Patch(dist_checkpointing, "load", self._wrap_load(dist_checkpointing.load))]

    def _wrap_init(self, original: Callable) -> Callable:
        state = self

        @functools.wraps(original)
        def __init__(opt, *args, **kwargs):
            original(opt, *args, **kwargs)
            buffered = {p for buffer in opt.buffers for p in buffer.param_index_map}
            for layer in state.layers():
                params = list(layer.experts.parameters())
                if any(p in buffered for p in params):
                    state.shards.update(pieces(opt, params))
        return __init__

    def _step_end(self, optimizer: torch.optim.Optimizer) -> None:
        resharder = self._resharder(optimizer)
        if resharder is not None:
            resharder.step_end(optimizer, Masters(optimizer, self.shards))

    def _wrap_save(self, original: Callable) -> Callable:
        state, signature = self, inspect.signature(original)

        @functools.wraps(original)
        def save(*args, **kwargs):
            if signature.bind(*args, **kwargs).arguments.get("async_sharded_save") and state.resharders:
                raise ValueError(f"{FIELD} ({state.every}): dist_checkpointing.save(async_sharded_save=True) would "
                                 "write after the experts move back from their stock owners; save synchronously")
            with state.stock_homes():
                return original(*args, **kwargs)
        return save

    def _wrap_load(self, original: Callable) -> Callable:
        state = self

        @functools.wraps(original)
        def load(*args, **kwargs):
            state.to_stock()
            return original(*args, **kwargs)
        return load

    # ---- moving ------------------------------------------------------------------------------------------------

    @contextmanager
    def stock_homes(self) -> Iterator[None]:
        """Inside: every re-sharded layer's experts (and their optimizer state) on their stock owners, so that a
        ``state_dict()`` or checkpoint written here is stock Megatron's; after: back (collective)."""
        with ExitStack() as stack:
            for optimizer, resharder in list(self._resharders.items()):
                if resharder is not None:
                    stack.enter_context(resharder.stock_homes(optimizer, Masters(optimizer, self.shards)))
            yield

    def to_stock(self) -> None:
        """Every re-sharded layer's experts to their stock owners, to stay (before loading stock-layout state)."""
        for optimizer, resharder in list(self._resharders.items()):
            if resharder is not None:
                resharder.to_stock(optimizer, Masters(optimizer, self.shards))

    def reshard(self, homes_LE: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Re-shard now (collective), each optimizer's layers to Algorithm 2's plan or to ``homes_LE`` (one homes
        tuple per layer, in build order)."""
        for optimizer, resharder in list(self._resharders.items()):
            if resharder is not None:
                resharder.reshard(optimizer, homes_LE, Masters(optimizer, self.shards))

    def _resharder(self, optimizer: torch.optim.Optimizer) -> Optional[Resharder]:
        """The Resharder of the layers whose experts ``optimizer`` holds (None: it holds none), made at its first
        step. A layer whose experts it holds only in part is refused: their state would stay behind."""
        if optimizer in self._resharders:
            return self._resharders[optimizer]
        held = _param_ids(optimizer)
        layers, partial = [], []
        for layer in self.layers():
            ids = []
            for p in layer.experts.parameters():
                piece, main = self.shards.get(id(p)), stepped(p)
                ids.append(piece.optimizer is optimizer if piece is not None else
                           id(p if main is None else main) in held)
            if all(ids):
                layers.append(layer)
            elif any(ids):
                partial.append(layer.token_dispatcher.rec.layer)
        if partial:
            raise ValueError(f"{FIELD} ({self.every}): the experts of {', '.join(partial)} are split over several "
                             "optimizers; each layer's experts must be stepped by one (their state moves with them)")
        resharder = None
        if layers and self.pooled and self.pool is not None:
            raise ValueError(f"{SECTION}.{NAME}.pool_slots (True): the Hecate layers are stepped by several "
                             "optimizers; pooled slots need every re-sharded layer's experts in one")
        if layers:
            schedules = [layer.token_dispatcher.schedule for layer in layers]
            resharder = Resharder([(s, functools.partial(_slots, layer)) for s, layer in zip(schedules, layers)],
                                  self.every, world=dist.group.WORLD, pooled=self.pooled)
            if self.pooled:
                self.pool = SlotPool(layers, [list(layer.experts.local_experts) for layer in layers], schedules)
            log = logger.info if dist.get_rank() == 0 else logger.debug
            log("moe_plugins: Hecate re-shards the experts of %d Megatron layers every %d optimizer steps",
                len(layers), self.every)
        self._resharders[optimizer] = resharder
        return resharder

    def close(self) -> None:
        self._resharders.clear()       # the pool stays: the layers keep reading their experts where they sit
        self.shards.clear()


def _param_ids(optimizer: Optional[torch.optim.Optimizer]) -> Set[int]:
    return {id(p) for group in (optimizer.param_groups if optimizer is not None else []) for p in group["params"]}


def _slots(layer: Any) -> List[List[Any]]:
    return [[(p, None) for p in mlp.parameters()] for mlp in layer.experts.local_experts]
