"""Lancet on the DeepSpeed host (``"lancet": {"defer_wgrad": true}`` in the ``moe_plugins`` section): the swapped
layer's experts (DeepSpeed's per-expert modules) defer their weight gradients, and the layer's backward exchanges
run them while they fly (docs/lancet.md).

- **Experts.** Every ``nn.Linear`` inside DeepSpeed's expert modules runs through Lancet's ``deferred_linear`` for
  the length of the expert call (``moe_plugins.lancet.dense_wgrad``: an instance ``forward`` set through the
  core's Patcher and removed in ``finally``), so DeepSpeed's ``Experts.forward`` and the user's modules run as in
  stock, and their dW joins the plugin's queue. A module there that is not a plain ``nn.Linear`` keeps stock
  gradients; an expert without one, or one that is a Linear subclass, is refused at setup, naming it.
- **Exchanges.** The layer's Recorder is built carrying ``ExchangeOverlap(queue)`` (:meth:`LancetHooks.overlap`),
  on an engine with a pipeline lane (the plugin's ``_pipeline`` asks for one for it), so each backward
  all-to-all flies on the lane while the queue runs.
- **The epilogue.** ZeRO-1/2 (DeepSpeed 0.19.8) run their post-backward epilogue from an autograd callback queued
  by the first gradient hook of a backward, ahead of the queue's own end-of-backward flush. While a Lancet layer
  is swapped, ``deepspeed.runtime.base_optimizer.BackwardHookStateManager.run_grad_acc_post_hooks`` first flushes
  the queue (one class patch through the core's Patcher, restored by :meth:`LancetHooks.remove`), so
  ``loss.backward()`` and ``engine.backward(loss)`` both reach the epilogue with every gradient delivered.

Not here: the experts the plugin slices over ESP itself (``esp`` set without DeepSpeed's expert tensor
parallelism), Lina together with Lancet (refused by the config), dense layers (``dense_wgrad``: refused).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, fields
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.core.plugin_config import SECTION, PluginConfig
from moe_plugins.lancet.config import LancetConfig
from moe_plugins.lancet.dense import dense_wgrad, wrap_problems
from moe_plugins.lancet.overlap import ExchangeOverlap
from moe_plugins.lancet.wgrad_queue import WgradQueue
from moe_plugins.patches.deepspeed_layer import SwappedLayer

logger = logging.getLogger("moe_plugins.deepspeed")

EPILOGUE = ("deepspeed.runtime.base_optimizer", "BackwardHookStateManager", "run_grad_acc_post_hooks")


def expert_linears(layer: nn.Module, name: str) -> List[Tuple[str, nn.Module]]:
    """The ``nn.Linear`` modules (and Linear subclasses, which ``dense_wgrad`` refuses) of a DeepSpeed MOELayer's
    local experts, named ``<layer>.experts.<i>.<path>``."""
    return [(f"{name}.experts.{i}.{path}", module)
            for i, expert in enumerate(layer.experts.deepspeed_experts)
            for path, module in expert.named_modules() if isinstance(module, nn.Linear)]


def expert_problems(layer: nn.Module, name: str, swapped: SwappedLayer) -> List[str]:
    """Why Lancet cannot defer this layer's expert weight gradients (empty when it can)."""
    where = f"{SECTION}.lancet.defer_wgrad on DeepSpeed MoE layer {name}"
    if swapped.slice_activation is not None:
        return [f"{where}: the experts the plugin slices over ESP itself ({SECTION}.esp without DeepSpeed's expert "
                "tensor parallelism) do not defer their weight gradients in this version; drop esp or the section"]
    linears = expert_linears(layer, name)
    if not linears:
        return [f"{where}: its expert modules hold no torch.nn.Linear whose weight gradient could be deferred"]
    return [f"{where}: {problem}" for path, module in linears for problem in wrap_problems(path, module)]


def _deferred_experts(experts: Callable[[torch.Tensor], torch.Tensor], linears: List[Tuple[str, nn.Module]],
                      queue: WgradQueue, tag: str, x_ElRM: torch.Tensor) -> torch.Tensor:
    with dense_wgrad(queue, linears, tag=tag):
        return experts(x_ElRM)


@dataclass(frozen=True)
class LancetSwappedLayer(SwappedLayer):
    """A swapped layer whose experts' Linear weight gradients are deferred to ``queue``."""

    queue: Optional[WgradQueue] = None

    def experts(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        linears = expert_linears(layer, self.name)
        return lambda x, inner=super().experts(layer): _deferred_experts(inner, linears, self.queue,
                                                                         f"experts.{self.name}", x)


class LancetHooks:
    """The plugin's Lancet state: one queue (the models it sets up run one backward at a time), the epilogue
    patch while a Lancet layer is swapped, the layers it attached to."""

    def __init__(self) -> None:
        self.queue: Optional[WgradQueue] = None
        self.layers: List[str] = []
        self.overlaps: List[ExchangeOverlap] = []           # one per layer: how often it ran dW behind an exchange
        self._patcher: Optional[Patcher] = None

    def overlap(self, cfg: PluginConfig) -> Optional[ExchangeOverlap]:
        """With the section's ``defer_wgrad`` on, the callback a layer's Recorder carries (``while_in_flight``) on
        the plugin's queue, for a layer about to be swapped; else None (the layer runs without Lancet)."""
        if cfg.lancet is None or not LancetConfig.from_dict(cfg.lancet).defer_wgrad:
            return None
        if self.queue is None:
            self.queue = WgradQueue()
        self.overlaps.append(ExchangeOverlap(self.queue))
        return self.overlaps[-1]

    def attach(self, swapped: SwappedLayer, moe: nn.Module) -> SwappedLayer:
        """``swapped`` (DeepSpeed's ``moe``, a ``deepspeed.moe.layer.MoE``) as is, or, where its Recorder carries
        :meth:`overlap`'s callback, its Lancet form (its experts' Linear dW deferred to the queue)."""
        if swapped.schedule.rec.while_in_flight is None:
            return swapped
        problems = expert_problems(moe.deepspeed_moe, swapped.name, swapped)
        if problems:
            raise ValueError("; ".join(problems))
        self._install()
        self.layers.append(swapped.name)
        logger.info("moe_plugins: DeepSpeed MoE layer %s defers its experts' weight gradients (Lancet)", swapped.name)
        return LancetSwappedLayer(**{f.name: getattr(swapped, f.name) for f in fields(swapped)}, queue=self.queue)

    def _install(self) -> None:
        if self._patcher is not None:
            return
        module = importlib.import_module(EPILOGUE[0])
        cls = getattr(module, EPILOGUE[1])
        original = getattr(cls, EPILOGUE[2])
        queue = self.queue

        def run_grad_acc_post_hooks(state):
            if getattr(state, "backward_active_depth", 0) and not queue.empty():
                queue.flush()        # every deferred gradient reaches its ZeRO hook before the epilogue
            return original(state)

        run_grad_acc_post_hooks.__wrapped__ = original
        self._patcher = Patcher([Patch(cls, EPILOGUE[2], run_grad_acc_post_hooks)], logger=logger).apply()

    def remove(self) -> None:
        """Restore DeepSpeed's epilogue and let go of the queue (the plugin closes the engines)."""
        patcher, self._patcher = self._patcher, None
        try:
            if patcher is not None:
                patcher.restore()
        finally:
            if self.queue is not None:
                self.queue.clear()
            self.queue, self.layers, self.overlaps = None, [], []
