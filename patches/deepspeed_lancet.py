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

- **Batch partitions** (``"partitions": n`` > 1). When DeepSpeed configures a model, the ``torch.nn.ModuleList``
  of blocks holding the swapped layers gets Lancet's block executor (``moe_plugins.lancet.blocks``; HF GPT-2
  blocks and the recipes' BERT-MoE layers, others refused naming the block), checked against the engine's
  micro-batch (n must divide it). The executor reaches the MoE layer through the block's own module (GPT-2's
  ``mlp``, BERT's ``output.block``; the user's wrapper keeps its aux loss):
  with a :class:`PartitionRequest` armed, the swapped layer starts the partitioned call
  (``moe_plugins.lancet.partition.start_partitions``, DeepSpeed's gate and experts) and returns a placeholder,
  which must come back out of ``mlp`` untouched (else refused: the wrapper changes the MoE output).

- **Dense layers** (``"dense_wgrad": true``). When DeepSpeed configures a model, its ``nn.Linear`` and HF
  ``Conv1D`` modules outside the swapped MoE layers defer their dW to the same queue
  (``moe_plugins.lancet.dense.dense_patcher``: instance forwards through the core's Patcher, restored by
  :meth:`LancetHooks.remove`); a weight tied to another module (GPT-2's LM head) stays stock, a Linear subclass
  or a parametrized one is refused naming it. The queue runs them behind the next backward exchange, or flushes
  them before the epilogue (the dense layers below the first MoE layer).

Not here: the experts the plugin slices over ESP itself (``esp`` set without DeepSpeed's expert tensor
parallelism), Lina together with Lancet (refused by the config).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, fields
from typing import Any, Callable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.core.plugin_config import SECTION, PluginConfig
from moe_plugins.lancet.blocks import BlockExecutor
from moe_plugins.lancet.config import LancetConfig
from moe_plugins.lancet.dense import defer_model_dense, dense_wgrad, wrap_problems
from moe_plugins.lancet.overlap import ExchangeOverlap
from moe_plugins.lancet.partition import partition_bounds, start_partitions
from moe_plugins.lancet.request import PartitionRequest, partition_policy, partition_stack
from moe_plugins.lancet.wgrad_queue import WgradQueue
from moe_plugins.patches.deepspeed_layer import GateReplay, SwappedLayer

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
    """A swapped layer whose experts' Linear weight gradients are deferred to ``queue`` (None: not deferred), and
    which starts a partitioned call when ``request`` is armed."""

    queue: Optional[WgradQueue] = None
    request: Optional[PartitionRequest] = None

    def experts(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.queue is None:
            return super().experts(layer)
        linears = expert_linears(layer, self.name)
        return lambda x, inner=super().experts(layer): _deferred_experts(inner, linears, self.queue,
                                                                         f"experts.{self.name}", x)

    def forward(self, layer: nn.Module, x: torch.Tensor, used_token: Optional[torch.Tensor]) -> torch.Tensor:
        request = self.request
        if request is None or not request.armed or not layer.training:
            return super().forward(layer, x, used_token)
        x_SM = x.reshape(-1, x.shape[-1])
        bounds = partition_bounds(x.shape[0], request.parts, x_SM.shape[0] // x.shape[0])
        call = start_partitions(x_SM, bounds, router=GateReplay(layer.gate, used_token, noted=self.noted),
                                experts=self.experts(layer), groups=self.groups,
                                num_experts=self.schedule.config.num_experts, rec=self.schedule.rec)
        layer.l_aux, layer.exp_counts = call.aux_loss, call.exp_counts_E
        return request.hand_back(call, x.new_empty(x.shape))


def _lancet_layers(model: nn.Module, swapped: Mapping[nn.Module, Any], field: str) -> List[nn.Module]:
    """``model``'s DeepSpeed MoE layers swapped as a :class:`LancetSwappedLayer` whose ``field`` is set (``queue``:
    deferring dW; ``request``: running partitions)."""
    return [m for m in model.modules() if isinstance(swapped.get(m), LancetSwappedLayer) and getattr(swapped[m], field)]


class LancetHooks:
    """The plugin's Lancet state: one queue (the models it sets up run one backward at a time), the epilogue
    patch while a Lancet layer is swapped, the layers it attached to."""

    def __init__(self) -> None:
        self.queue: Optional[WgradQueue] = None
        self.layers: List[str] = []
        self.dense: List[str] = []                           # the dense modules whose dW it defers (dense_wgrad)
        self.overlaps: List[ExchangeOverlap] = []           # one per layer: how often it ran dW behind an exchange
        self.request = PartitionRequest("DeepSpeed")
        self.executors: List[BlockExecutor] = []
        self._parts = 1                                      # partitions of the layers being swapped
        self._dense = False                                  # dense_wgrad of the layers being swapped
        self._patcher: Optional[Patcher] = None
        self._dense_patchers: List[Patcher] = []             # one per model configured with dense_wgrad

    def overlap(self, cfg: PluginConfig) -> Optional[ExchangeOverlap]:
        """With the section's ``defer_wgrad`` on, the callback a layer's Recorder carries (``while_in_flight``) on
        the plugin's queue, for a layer about to be swapped; else None (the layer runs without Lancet)."""
        lancet = None if cfg.lancet is None else LancetConfig.from_dict(cfg.lancet)
        self._parts = 1 if lancet is None else lancet.partitions
        self._dense = lancet is not None and lancet.dense_wgrad
        if lancet is None or not lancet.defer_wgrad:
            return None
        if self.queue is None:
            self.queue = WgradQueue()
        self.overlaps.append(ExchangeOverlap(self.queue))
        return self.overlaps[-1]

    def needs_lane(self, overlap: Optional[ExchangeOverlap]) -> bool:
        """Whether the layer being swapped needs an engine with a pipeline lane: its exchanges carry ``overlap``, or
        its partitions' exchanges fly on the lane."""
        return overlap is not None or self._parts != 1

    def attach(self, swapped: SwappedLayer, moe: nn.Module) -> SwappedLayer:
        """``swapped`` (DeepSpeed's ``moe``, a ``deepspeed.moe.layer.MoE``) as is, or, where its Recorder carries
        :meth:`overlap`'s callback, its Lancet form (its experts' Linear dW deferred to the queue)."""
        defer = swapped.schedule.rec.while_in_flight is not None
        if not defer and self._parts == 1:      # (partitions: an int, or "auto")
            return swapped
        if defer:
            problems = expert_problems(moe.deepspeed_moe, swapped.name, swapped)
            if problems:
                raise ValueError("; ".join(problems))
            self._install()
            logger.info("moe_plugins: DeepSpeed MoE layer %s defers its experts' weight gradients (Lancet)",
                        swapped.name)
        self.layers.append(swapped.name)
        return LancetSwappedLayer(**{f.name: getattr(swapped, f.name) for f in fields(swapped)},
                                  queue=self.queue if defer else None,
                                  request=self.request if self._parts != 1 else None)

    def install_model(self, engine, model: nn.Module, swapped: Mapping[nn.Module, Any],
                      profile_dir: Optional[str] = None) -> None:
        """After DeepSpeed configured ``model`` (its MoE layers swapped; ``swapped``: DeepSpeed MOELayer -> swapped
        layer): the block executor (:meth:`install_blocks`), then the dense layers' dW deferral
        (:meth:`install_dense`)."""
        self.install_blocks(engine, model, swapped, profile_dir)
        self.install_dense(model, swapped)

    def install_blocks(self, engine, model: nn.Module, swapped: Mapping[nn.Module, Any],
                       profile_dir: Optional[str] = None) -> None:
        """With partitions, the block executor on the ModuleList of blocks that holds the swapped layers; ``"auto"``
        reads the cost profile cached in ``profile_dir`` for the layers' layout."""
        mine = _lancet_layers(model, swapped, "request")
        if not mine:
            return
        parts, field, first = self._parts, f"{SECTION}.lancet.partitions", swapped[mine[0]]
        blocks, moe = partition_stack(model, mine, parts, int(engine.train_micro_batch_size_per_gpu()), field)
        policy = partition_policy(parts, blocks, moe, first.schedule.config, first.groups, profile_dir, field)
        self.executors.append(BlockExecutor(blocks, moe, self.request.start, policy).install())
        if self.executors[-1].kind.caches and getattr(getattr(model, "config", None), "use_cache", False):
            logger.warning("moe_plugins: the model's config.use_cache is on: forwards that do not pass "
                           "use_cache=False keep a KV cache and run without Lancet's batch partitions")
        logger.info("moe_plugins: Lancet's batch partitions (%s) run the blocks after MoE blocks %s", parts, moe)

    def install_dense(self, model: nn.Module, swapped: Mapping[nn.Module, Any]) -> None:
        """With ``dense_wgrad``: ``model``'s Linear and Conv1D modules outside its Lancet layers defer their dW to
        the queue (tied weights stay stock, logged); a module it cannot wrap is refused, naming every one."""
        mine = _lancet_layers(model, swapped, "queue")
        if not self._dense or not mine:
            return
        patcher, names = defer_model_dense(self.queue, model, mine, field=f"{SECTION}.lancet.dense_wgrad (True)",
                                           logger=logger)
        self._dense_patchers.append(patcher)
        self.dense += names

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
            for executor in self.executors:
                executor.remove()
            for dense in reversed(self._dense_patchers):
                dense.restore()
            if patcher is not None:
                patcher.restore()
        finally:
            self.executors, self._dense_patchers, self.dense = [], [], []
            if self.queue is not None:
                self.queue.clear()
            self.queue, self.layers, self.overlaps = None, [], []
