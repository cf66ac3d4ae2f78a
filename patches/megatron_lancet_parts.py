"""Lancet's batch partitions on Megatron-core (``"lancet": {"partitions": n | "auto" | "tune"}``): the blocks around
the plugin's MoE layers (Megatron's own ``TransformerLayer`` in its ``TransformerBlock``, or the recipes' HF GPT-2 /
BERT blocks) run partition by partition after each gate, so that one partition's exchange flies while another
partition computes (``moe_plugins.lancet.blocks``, docs/lancet.md).

- **The model.** A ``TransformerBlock`` built while the plugin is enabled (a GPTModel's ``decoder``, under the flag
  too) installs the block executor on its own ``layers`` when they hold the plugin's MoE layers (the patched
  ``__init__``: :meth:`MegatronPartitions.patches`), so Megatron's own models need nothing more. Other models
  (the recipes' HF blocks) are handed over by the training script:
  ``handle.lancet.partitions.wrap_model(model, moe_layers, micro_batch=...)`` installs the executor on the one
  ``torch.nn.ModuleList`` of blocks holding the plugin's MoE layers (the recipes do this in
  ``plugin_model_hooks``; a second call for layers already covered returns their executor). A layer built with
  partitions whose model was not handed over refuses its first training forward, naming the call, rather than
  running unpartitioned silently.
- **The layer** (:meth:`MegatronPartitions.forward`, from ``PluginMoELayer.forward`` while the executor's request
  is armed): Megatron's router gates the whole batch, sequence-first ``[L, B, M]`` as stock does, so the kept and
  dropped routes, their slots, the aux-loss hooks and z-loss are stock's. The routes are then put in batch-first
  token order (partitions are whole samples) and each partition's kept routes move in one uneven exchange
  (``moe_plugins.lancet.partition.start_partitions``) through Megatron's own experts (with Lancet's deferred dW
  when ``defer_wgrad`` is on). The layer returns a placeholder ``[L, B, M]``, laid out as its stock output; the
  block's MoE module must return it or a view of all of it (a TransformerLayer's ``mlp`` is the layer itself;
  the recipes' wrapper returns ``y.transpose(0, 1)``), not a copy. The executor hands each partition's output to
  the block in the same memory layout (sequence-first under the transpose), so a dropout after the MoE block
  (BERT's output), which draws its mask in memory order, gets the mask stock drew
  (``moe_plugins.lancet.blocks.DropoutReplay.lay_out``).

Supported: TP 1 and expert-TP 1 (``partition_layout_problems``), schedule ``baseline``, pipeline degree 1 (the
section's checks), no shared experts, latent projection or MoE-layer recompute (refused at ``wrap_model``, each
naming the setting), no padding mask. Shapes: L tokens per sample, B samples, M model dim.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from moe_plugins.core.costmodel import default_cache_dir
from moe_plugins.core.patcher import Patch
from moe_plugins.core.plugin_config import SECTION
from moe_plugins.lancet.blocks import BlockExecutor
from moe_plugins.lancet.partition import partition_bounds, partition_layout_problems, start_partitions
from moe_plugins.lancet.request import PartitionRequest, partition_policy, partition_stack

logger = logging.getLogger("moe_plugins.megatron")
FIELD = f"{SECTION}.lancet.partitions"
RETURNS = "the layer's output y or a view of all of it (batch-first: y.transpose(0, 1)), not a copy"


def layer_problems(layer: Any, name: str) -> List[str]:
    """Why batch partitions cannot run through this PluginMoELayer (empty when they can)."""
    where = f"{FIELD} on Megatron MoE layer {name}"
    config = layer.config
    problems = [f"{where}: {p}" for p in partition_layout_problems(layer.moe_groups)]
    tp = config.tensor_model_parallel_size
    if tp != 1:           # the layer then sees its TP rank's sequence slice (sequence parallel), not whole samples
        problems.append(f"{where}: tensor_model_parallel_size ({tp}) must be 1; partitions cut whole samples")
    for flag, value in (("moe_shared_expert_intermediate_size", config.moe_shared_expert_intermediate_size),
                        ("moe_latent_size", getattr(config, "moe_latent_size", None))):
        if value is not None:
            problems.append(f"{where}: {flag} ({value}) must be None; partitions run the routed experts only")
    if getattr(layer, "moe_layer_recompute", False):
        problems.append(f"{where}: the MoE layer's recompute (recompute_modules 'moe') must be off")
    if layer.token_dispatcher.degree != 1:
        problems.append(f"{where}: pipeline degree {layer.token_dispatcher.degree}: partitions run at degree 1")
    return problems


class MegatronPartitions:
    """The enabled plugin's batch partitions on Megatron: the request the executors arm, the executors installed by
    :meth:`wrap_model` (taken off by :meth:`close`), the layers they cover."""

    def __init__(self, parts: Union[int, str]):
        self.parts = parts
        self.request = PartitionRequest("Megatron-core", RETURNS)
        self.executors: List[BlockExecutor] = []
        self._covered: Dict[int, BlockExecutor] = {}          # id of a covered MoE layer -> its executor

    def wrap_model(self, model: nn.Module, moe_layers: Sequence[nn.Module], micro_batch: Optional[int] = None,
                   profile_dir: Optional[str] = None) -> BlockExecutor:
        """Install the block executor on ``model``'s stack of blocks holding ``moe_layers`` (the plugin's
        PluginMoELayers; ``micro_batch``: samples per rank and forward, checked against the count when given;
        ``profile_dir``: where ``"auto"`` reads the cached cost profile). Every problem in one ValueError, before
        anything is installed."""
        mine = list(moe_layers)
        owners = [self._covered.get(id(m)) for m in mine]
        if owners and owners[0] is not None and all(o is owners[0] for o in owners):
            return owners[0]              # already covered (its TransformerBlock installed one): the same executor
        problems = [f"{FIELD}: {type(m).__name__} is not a PluginMoELayer built while this plugin was enabled"
                    for m in mine if getattr(m, "lancet_parts", None) is not self]
        for m in mine:
            problems += layer_problems(m, m.token_dispatcher.rec.layer) if getattr(m, "lancet_parts", None) is self \
                else []
        if not mine:
            problems.append(f"{FIELD}: no MoE layer was handed over")
        if problems:
            raise ValueError("; ".join(problems))
        blocks, moe = partition_stack(model, mine, self.parts, micro_batch, FIELD)
        first = mine[0]
        policy = partition_policy(self.parts, blocks, moe, first.token_dispatcher.moe_config, first.moe_groups,
                                  profile_dir if profile_dir is not None else str(default_cache_dir()), FIELD)
        executor = BlockExecutor(blocks, moe, self.request.start, policy).install()
        self.executors.append(executor)
        self._covered.update((id(m), executor) for m in mine)
        if executor.kind.caches and getattr(getattr(model, "config", None), "use_cache", False):
            logger.warning("moe_plugins: the model's config.use_cache is on: forwards that do not pass "
                           "use_cache=False keep a KV cache and run without Lancet's batch partitions")
        logger.info("moe_plugins: Lancet's batch partitions (%s) run the blocks after Megatron MoE blocks %s",
                    self.parts, moe)
        return executor

    def patches(self) -> List[Patch]:
        """``TransformerBlock.__init__``, wrapped while the plugin is enabled: a block whose layers hold this
        plugin's MoE layers installs the executor on them (:meth:`wrap_model`, its problems raised there)."""
        from megatron.core.transformer.transformer_block import TransformerBlock
        original, state = TransformerBlock.__init__, self

        @functools.wraps(original)
        def __init__(block, *args, **kwargs):
            original(block, *args, **kwargs)
            mine = [layer.mlp for layer in block.layers
                    if getattr(getattr(layer, "mlp", None), "lancet_parts", None) is state]
            if mine:
                state.wrap_model(block, mine)
        return [Patch(TransformerBlock, "__init__", __init__)]

    def check_covered(self, layer: nn.Module) -> None:
        """A training forward of ``layer`` outside any executor: refused (it would run unpartitioned)."""
        if id(layer) not in self._covered:
            raise ValueError(f"{FIELD} ({self.parts!r}): this MoE layer's model was not handed to "
                             "handle.lancet.partitions.wrap_model(model, moe_layers) before training (a "
                             "TransformerBlock built while the plugin is enabled does it itself); use partitions 1 "
                             "otherwise")

    def forward(self, layer: Any, hidden_LBM: torch.Tensor, *args, **kwargs):
        """``layer``'s (a PluginMoELayer) forward while the request is armed (module docstring): ``(placeholder,
        None)``."""
        for index, name in enumerate(("intermediate_tensors", "padding_mask")):
            if kwargs.get(name, args[index] if len(args) > index else None) is not None:
                raise ValueError(f"{FIELD}: a {name} reached Megatron MoE layer {layer.token_dispatcher.rec.layer}; "
                                 "partitions run without one")
        disp = layer.token_dispatcher
        length, batch, model_dim = hidden_LBM.shape
        probs_SE, map_SE = layer.route(hidden_LBM)                   # stock's gate on the whole batch, sequence-first
        own = disp.routing(probs_SE, map_SE)
        order_X = torch.arange(length * batch, device=hidden_LBM.device).view(length, batch).t().reshape(-1)
        routing = replace(own, expert_SK=own.expert_SK[order_X], slot_SK=own.slot_SK[order_X],
                          weight_SK=own.weight_SK[order_X])          # batch-first token order, whole-batch slots
        x_SM = hidden_LBM.transpose(0, 1).reshape(-1, model_dim)
        call = start_partitions(x_SM, partition_bounds(batch, self.request.parts, length), router=lambda _x: routing,
                                experts=disp.expert_call(), groups=disp.groups,
                                num_experts=layer.config.num_moe_experts, rec=disp.rec)
        return self.request.hand_back(call, hidden_LBM.new_empty(hidden_LBM.shape)), None

    def close(self) -> None:
        executors, self.executors = self.executors, []
        self._covered.clear()
        for executor in executors:
            executor.remove()
