"""Hecate's early gather (``"hecate": {"prefetch": true}``) on Megatron-core: each Hecate layer's spAG is planned
from earlier calls' load and issued on its engine's pipeline lane when the transformer block holding the layer
starts, so that the attention before the layer hides it (moe_plugins/hecate/early.py; docs/hecate.md "The early
gather").

Under :func:`moe_plugins.patches.megatron.enable` (which builds the layers' engines with a pipeline lane),
:class:`MegatronEarlyGather` (``handle.early``):

- replaces ``TransformerLayer.__init__`` (Megatron's block) through the plugin's Patcher: a layer whose ``mlp`` is
  a prefetching ``PluginMoELayer`` gets a forward pre-hook that calls :meth:`PluginMoELayer.prefetch`;
- :meth:`MegatronEarlyGather.wrap_model` does the same for a model of other blocks (the recipes' HF GPT-2/BERT
  blocks): each prefetching layer's nearest ancestor held in a ``ModuleList``.

A layer with no such block issues its gather at its own call (only its gate hides it). The hooks are removed by
``disable()``, which closes the engines they issue on.

With ``"rematerialize": true`` the same two points link each rematerialising layer into the plugin's one
:class:`~moe_plugins.hecate.regather.RegatherChain`, so that a layer's re-gather starts on the lane when the next
layer (in forward order) has released its copies (moe_plugins/hecate/regather.py).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, List

import torch
import torch.distributed as dist

from moe_plugins.core.patcher import Patch
from moe_plugins.hecate.early import enclosing_blocks
from moe_plugins.hecate.regather import RegatherChain
from moe_plugins.hecate.regather import link as link_chain

logger = logging.getLogger("moe_plugins.megatron")


class MegatronEarlyGather:
    """The enabled plugin's early-gather hooks (module docstring)."""

    def __init__(self) -> None:
        self.handles: List[Any] = []
        self.hooked: "weakref.WeakSet[Any]" = weakref.WeakSet()     # the layers whose block issues their gather
        self.chain = RegatherChain()          # the rematerialising layers' re-gathers (weak: nothing held)

    def patches(self) -> List[Patch]:
        from megatron.core.transformer.transformer_layer import TransformerLayer
        return [Patch(TransformerLayer, "__init__", self._wrap_init(TransformerLayer.__init__))]

    def _wrap_init(self, original: Callable) -> Callable:
        state = self

        @functools.wraps(original)
        def __init__(block, *args, **kwargs):
            original(block, *args, **kwargs)
            mlp = getattr(block, "mlp", None)
            link_chain([getattr(getattr(mlp, "token_dispatcher", None), "schedule", None)], state.chain)
            if prefetches(mlp):
                state._hook(block, mlp)
        return __init__

    def wrap_model(self, model: torch.nn.Module) -> int:
        """Hook the blocks of ``model``'s prefetching layers not hooked yet (and link its rematerialising ones);
        returns how many were hooked."""
        link_chain([getattr(getattr(m, "token_dispatcher", None), "schedule", None) for m in model.modules()],
                   self.chain)
        layers = [m for m in model.modules() if prefetches(m) and m not in self.hooked]
        count = 0
        for layer, block in zip(layers, enclosing_blocks(model, layers)):
            if block is None:
                logger.info("moe_plugins: Hecate layer %s is in no ModuleList of blocks: its early gather is issued "
                            "at the layer's own call", layer.token_dispatcher.rec.layer)
                continue
            self._hook(block, layer)
            count += 1
        return count

    def _hook(self, block: torch.nn.Module, layer: Any) -> None:
        self.handles.append(block.register_forward_pre_hook(functools.partial(_prefetch, layer)))
        self.hooked.add(layer)
        log = logger.info if not dist.is_initialized() or dist.get_rank() == 0 else logger.debug
        log("moe_plugins: Hecate layer %s gathers its copies early, when its block (%s) starts",
            layer.token_dispatcher.rec.layer, type(block).__name__)

    def close(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()


def prefetches(module: Any) -> bool:
    """Whether ``module`` is a plugin MoE layer whose schedule gathers early."""
    schedule = getattr(getattr(module, "token_dispatcher", None), "schedule", None)
    return hasattr(module, "prefetch") and getattr(getattr(schedule, "options", None), "prefetch", False) is True


def _prefetch(layer: Any, block: torch.nn.Module, args: Any) -> None:
    layer.prefetch()
