"""Lancet on Megatron-core (``"lancet": {"defer_wgrad": true}`` in the ``moe_plugins`` section): the plugin's MoE
layers compute Megatron's experts with their weight gradients deferred, and the layers' backward exchanges run
them while they fly (docs/lancet.md).

- **Experts.** Megatron's ``SequentialMLP`` local experts (``linear_fc1`` -> activation -> ``linear_fc2``, the
  activation as Megatron's MLP applies it, gated linear units included) run through Lancet's ``deferred_linear`` on
  their own weights: dX at once, dW queued and delivered through autograd, so Megatron's DDP hooks (and
  ``main_grad``) see each gradient once, as in stock. The ESP reduction is the plugin's (``megatron_experts``).
- **Exchanges.** The layer's Recorder carries ``ExchangeOverlap(queue)``, on an engine with a pipeline lane (the
  enabled plugin's :class:`~moe_plugins.patches.megatron_engines.LayoutEngines`), so each backward all-to-all flies
  on the lane while the queue runs. What is left is flushed when the backward pass ends (before DDP's
  ``finish_grad_sync``, which the training loop calls after it).

Refused, naming the setting: experts other than ``SequentialMLP`` (grouped GEMMs), fused or Transformer Engine
activations, biases with expert tensor parallelism. Batch partitions: patches/megatron_lancet_parts.py.

Shapes: E_l local experts, N rows per expert, M model dim, H (H_s) FFN hidden (this rank's shard).
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Union

import torch

from moe_plugins.core.plugin_config import SECTION, PluginConfig
from moe_plugins.lancet.config import LancetConfig, partitioned
from moe_plugins.lancet.overlap import ExchangeOverlap
from moe_plugins.lancet.wgrad import deferred_linear
from moe_plugins.lancet.wgrad_queue import WgradQueue

logger = logging.getLogger("moe_plugins.megatron")


def lancet_on(plugin: PluginConfig) -> bool:
    """Whether the section runs Lancet at all: deferred weight gradients, batch partitions, or both."""
    if not plugin.enabled or plugin.lancet is None:
        return False
    return LancetConfig.from_dict(plugin.lancet).defer_wgrad or partitioned(plugin.lancet)


def partition_count(plugin: PluginConfig) -> Union[int, str]:
    """The section's ``partitions`` (1: none)."""
    return LancetConfig.from_dict(plugin.lancet).partitions if lancet_on(plugin) else 1


def defers_wgrad(plugin: PluginConfig) -> bool:
    """Whether the section runs Lancet's deferred weight gradients."""
    return plugin.enabled and plugin.lancet is not None and LancetConfig.from_dict(plugin.lancet).defer_wgrad


def defers_dense(plugin: PluginConfig) -> bool:
    """Whether the section defers the dense layers' weight gradients too (``dense_wgrad``)."""
    return defers_wgrad(plugin) and LancetConfig.from_dict(plugin.lancet).dense_wgrad


def expert_problems(config: Any, experts: torch.nn.Module, name: str, esp: int) -> List[str]:
    """Why Lancet cannot defer this Megatron layer's expert weight gradients (empty when it can)."""
    where = f"{SECTION}.lancet.defer_wgrad on Megatron MoE layer {name}"
    problems = []
    if type(experts).__name__ != "SequentialMLP" or not hasattr(experts, "local_experts"):
        problems.append(f"{where}: its experts are a {type(experts).__name__}; Lancet defers SequentialMLP experts "
                        "only (moe_grouped_gemm off)")
    for flag in ("bias_activation_fusion", "use_te_activation_func"):
        if getattr(config, flag, False):
            problems.append(f"{where}: {flag} ({getattr(config, flag)!r}) must be False (the deferred experts "
                            "compute Megatron's unfused MLP)")
    if getattr(config, "add_bias_linear", False) and esp > 1:
        problems.append(f"{where}: add_bias_linear (True) with expert_tensor_parallel_size ({esp}) > 1: each shard "
                        "would add the output bias before the ESP sum")
    return problems


def mlp_activation(config: Any, h_NH: torch.Tensor) -> torch.Tensor:
    """Megatron's MLP activation on fc1's output (its bias added, unfused): ``activation_func``, or its gated
    linear unit (clamp and offset as Megatron applies them)."""
    if not config.gated_linear_unit:
        return config.activation_func(h_NH)
    x_glu, x_linear = torch.chunk(h_NH, 2, dim=-1)
    val = getattr(config, "activation_func_clamp_value", None)
    if val is not None:
        x_glu, x_linear = x_glu.clamp(min=None, max=val), x_linear.clamp(min=-val, max=val)
    return config.activation_func(x_glu) * (x_linear + getattr(config, "glu_linear_offset", 0.0))


def deferred_local_experts(experts: torch.nn.Module, x_ElNM: torch.Tensor, *, config: Any, queue: WgradQueue,
                           layer: str) -> torch.Tensor:
    """``SequentialMLP``'s local experts on their rows (the ``run`` of ``megatron_layer.megatron_experts``, which adds
    the ESP reduction), each one's two GEMMs (with their biases, as Megatron's expert MLP adds them) with dW and db
    deferred to ``queue``."""
    tag = f"experts.{layer}"
    outs = []
    for e, mlp in enumerate(experts.local_experts):
        fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
        h_NH = deferred_linear(x_ElNM[e], fc1.weight, getattr(fc1, "bias", None), queue, name=f"{layer}.{e}.fc1",
                               tag=tag)
        outs.append(deferred_linear(mlp_activation(config, h_NH), fc2.weight, getattr(fc2, "bias", None), queue,
                                    name=f"{layer}.{e}.fc2", tag=tag))
    return torch.stack(outs)


class LancetState:
    """The enabled plugin's Lancet state on Megatron: one queue (a model runs one backward at a time), the
    overlap callback of each layer built while enabled (``defer``: the experts' dW deferred) and, with ``dense``,
    the dense linear layers whose dW it defers (patches/megatron_lancet_dense.py); with ``parts`` other than 1,
    the batch partitions (``partitions``: patches/megatron_lancet_parts.py)."""

    def __init__(self, record_timeline: bool = False, dense: bool = False, defer: bool = True,
                 parts: Union[int, str] = 1):
        from moe_plugins.patches.megatron_lancet_dense import DenseLayers
        from moe_plugins.patches.megatron_lancet_parts import MegatronPartitions
        self.defer = defer
        self.partitions = MegatronPartitions(parts) if parts != 1 else None
        self.queue = WgradQueue(record_timeline=record_timeline)
        self.overlaps: List[ExchangeOverlap] = []
        self.layers: List[str] = []
        self.dense = DenseLayers(self.queue) if dense else None

    def patches(self) -> List[Any]:
        """With ``dense``: the linear classes' construction; with batch partitions, ``TransformerBlock``'s (it
        installs the block executor on its layers: patches/megatron_lancet_parts.py); wrapped while enabled."""
        from moe_plugins.patches.megatron_lancet_dense import dense_patches
        dense = dense_patches(self.dense) if self.dense is not None else []
        return dense + (self.partitions.patches() if self.partitions is not None else [])

    def overlap(self, name: str) -> ExchangeOverlap:
        """A new layer's ``while_in_flight`` callback on the shared queue."""
        self.overlaps.append(ExchangeOverlap(self.queue))
        self.layers.append(name)
        logger.info("moe_plugins: Megatron MoE layer %s defers its experts' weight gradients (Lancet)", name)
        return self.overlaps[-1]

    def close(self) -> None:
        try:
            if self.partitions is not None:
                self.partitions.close()
        finally:
            try:
                if self.dense is not None:
                    self.dense.restore()
            finally:
                self.queue.clear()


def lancet_or_none(plugin: PluginConfig, lancet: Optional[LancetState]) -> Optional[LancetState]:
    """``lancet`` when the section runs Lancet (:func:`lancet_on`); a ValueError when it does but the plugin is not
    enabled (the spec provider alone has no queue to share)."""
    if not lancet_on(plugin):
        return None
    if lancet is None:
        raise ValueError(f"{SECTION}.lancet needs the plugin enabled (enable(), the Megatron-LM flag or moe-plugins "
                         "launch), which owns the queue and the engines the layers share; the spec provider alone "
                         "does not")
    return lancet
