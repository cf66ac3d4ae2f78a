"""Lancet's dense weight gradients on Megatron-core (``"lancet": {"defer_wgrad": true, "dense_wgrad": true}``): the
model's ``ColumnParallelLinear`` and ``RowParallelLinear`` layers (attention's QKV and projection, dense MLPs, an
untied output layer) compute dX at once in backward and queue dW (and db) on the plugin's Lancet queue, which the
MoE layers' backward exchanges run while they fly (docs/lancet.md, docs/megatron.md).

How: while the plugin is enabled, both classes' ``__init__`` are wrapped (:func:`dense_patches`, through the
core's ``Patcher``, restored on ``disable()``); each instance built then gets an instance ``_forward_impl`` (the
classes' own calls ``linear_with_grad_accumulation_and_async_allreduce``, or its frozen-weight twin) that is
:func:`deferred_forward_impl`, which keeps that function's communication with Megatron's own mappings and defers
the GEMM's dW:

- ``sequence_parallel``: the input all-gathered over TP in forward, its gradient reduce-scattered in backward
  (``gather_from_sequence_parallel_region``);
- ``allreduce_dgrad``: the input gradient all-reduced over TP (``copy_to_tensor_model_parallel_region``);
- then ``F.linear(x, W, b)`` as Lancet's ``deferred_linear``: dW delivered later through autograd, so Megatron
  DDP's hooks (``main_grad``) see each gradient once, as in stock.

Left stock, each logged: expert linears (``is_expert``: the MoE layer's experts defer on their own), layers
without their own weight (an output layer tied to the embedding), and layers whose ``_forward_impl`` is not
Megatron's function (Transformer Engine). Refused at build, naming the layer: ``gradient_accumulation_fusion``
(its fused kernel writes ``main_grad`` inside the GEMM) and ``defer_embedding_wgrad_compute`` (Megatron's own
deferral of the output layer's dW). :meth:`DenseLayers.restore` puts every wrapped instance back.

A model whose dense layers are plain ``torch.nn.Linear`` / transformers' ``Conv1D`` (the recipes' HF GPT-2 and
BERT around Megatron's MoE layers) hands them over with :meth:`DenseLayers.wrap_model` (the DeepSpeed adapter's
wrap, ``moe_plugins.lancet.dense``); the Megatron recipe does.
"""

from __future__ import annotations

import logging
import weakref
from functools import partial
from typing import Any, Callable, List, Optional

import torch

from moe_plugins.core.patcher import Patch
from moe_plugins.core.plugin_config import SECTION
from moe_plugins.lancet.wgrad import deferred_linear
from moe_plugins.lancet.wgrad_queue import WgradQueue

logger = logging.getLogger("moe_plugins.megatron")
FIELD = f"{SECTION}.lancet.dense_wgrad"
TAG = "dense"


def deferred_forward_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
                          grad_output_buffer: Any = None, wgrad_deferral_limit: Any = None, tp_group: Any = None,
                          gtp_remat_size: int = 1, *, queue: WgradQueue, name: str) -> torch.Tensor:
    """Megatron's ``linear_with_grad_accumulation_and_async_allreduce`` (same arguments; ``gtp_remat_size``:
    megatron-core 0.19's) with dW deferred."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)
    if gradient_accumulation_fusion or grad_output_buffer is not None or gtp_remat_size != 1:
        raise ValueError(f"{FIELD}: layer {name} runs gradient_accumulation_fusion, a grad_output_buffer or "
                         f"GTP-sharded weights (gtp_remat_size {gtp_remat_size}), which Lancet's deferred dW does not")
    x = input
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    elif allreduce_dgrad:
        x = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return deferred_linear(x, weight, bias, queue, name=name, tag=TAG)


class DenseLayers:
    """The Megatron linear layers whose dW one enabled plugin defers (weak references: a model freed is freed)."""

    def __init__(self, queue: WgradQueue) -> None:
        self.queue = queue
        self._wrapped: List[weakref.ref] = []
        self._patchers: List[Any] = []
        self.deferred = 0
        self.stock: List[str] = []

    def adopt(self, module: Any) -> None:
        """A ColumnParallelLinear / RowParallelLinear just built: defer its dW, or log why it stays stock."""
        from megatron.core.tensor_parallel import layers as tp_layers
        name = f"{type(module).__name__}.{self.deferred + len(self.stock)}"
        config = getattr(module, "config", None)
        if getattr(module, "gradient_accumulation_fusion", False) or getattr(config, "defer_embedding_wgrad_compute",
                                                                             False):
            raise ValueError(f"{FIELD} (True): Megatron layer {name} runs gradient_accumulation_fusion or "
                             "defer_embedding_wgrad_compute, whose kernels write main_grad themselves; turn them off "
                             "or dense_wgrad off")
        why = ("an expert layer (the MoE layer defers its experts)" if getattr(module, "is_expert", False) else
               "no weight of its own (tied)" if getattr(module, "weight", None) is None else
               "its _forward_impl is not Megatron's (a subclass, or wrapped already)"
               if "_forward_impl" in module.__dict__ or type(module)._forward_impl not in
               (tp_layers.ColumnParallelLinear._forward_impl, tp_layers.RowParallelLinear._forward_impl) else None)
        if why is not None:
            self.stock.append(name)
            logger.debug("moe_plugins: Lancet leaves %s's dW stock: %s", name, why)
            return
        module._forward_impl = partial(deferred_forward_impl, queue=self.queue, name=name)
        self._wrapped.append(weakref.ref(module))
        self.deferred += 1

    def wrap_model(self, model: torch.nn.Module, moe_layers: List[torch.nn.Module]) -> int:
        """Also defer the dW of ``model``'s ``torch.nn.Linear`` and transformers' ``Conv1D`` modules outside
        ``moe_layers`` (a model whose dense layers are not Megatron's, as the recipes' HF GPT-2 and BERT; tied
        weights stay stock), until :meth:`restore`. Returns how many."""
        from moe_plugins.lancet.dense import defer_model_dense
        patcher, names = defer_model_dense(self.queue, model, moe_layers, field=f"{FIELD} (True)", logger=logger,
                                           tag=TAG)
        self._patchers.append(patcher)
        self.deferred += len(names)
        return len(names)

    def restore(self) -> None:
        """Every wrapped layer runs Megatron's own ``_forward_impl`` again (the instance attribute removed), and
        the modules :meth:`wrap_model` wrapped their own forward."""
        patchers, self._patchers = self._patchers, []
        for patcher in patchers:
            patcher.restore()
        wrapped, self._wrapped = self._wrapped, []
        for ref in wrapped:
            module = ref()
            if module is not None:
                module.__dict__.pop("_forward_impl", None)


def dense_patches(layers: DenseLayers) -> List[Patch]:
    """Both classes' ``__init__`` wrapped: each instance built while the patches hold is adopted."""
    from megatron.core.tensor_parallel import layers as tp_layers
    return [Patch(cls, "__init__", _adopting(cls.__init__, layers))
            for cls in (tp_layers.ColumnParallelLinear, tp_layers.RowParallelLinear)]


def _adopting(original: Callable, layers: DenseLayers) -> Callable:
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        layers.adopt(self)
    __init__.__wrapped__ = original
    return __init__
