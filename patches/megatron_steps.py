"""One hook point for work at Megatron-core's optimizer-step boundary: ``step_with_ready_grads`` of
``FP32Optimizer`` (a ``ChainedOptimizer`` steps each of its optimizers through it) and, for Megatron's
mixed-precision optimizer (bf16/fp16 parameters with fp32 master copies), of ``MixedPrecisionOptimizer``; both used
by Hecate's re-sharding (patches/megatron_hecate_reshard.py) and Lina's packing (patches/megatron_lina_packing.py),
which refuse each other, so one replacement of each is active at a time."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from moe_plugins.core.patcher import Patch


def _after(cls: Any, on_step: Callable[[torch.optim.Optimizer], None]) -> Patch:
    original = cls.step_with_ready_grads

    @functools.wraps(original)
    def step_with_ready_grads(opt) -> bool:
        ok = original(opt)
        if ok and opt.optimizer is not None:
            on_step(opt.optimizer)
        return ok
    return Patch(cls, "step_with_ready_grads", step_with_ready_grads)


def after_fp32_steps(on_step: Callable[[torch.optim.Optimizer], None]) -> Patch:
    """The patch of ``FP32Optimizer.step_with_ready_grads`` that calls ``on_step(torch_optimizer)`` after every
    successful step of an optimizer that holds a torch optimizer."""
    from megatron.core.optimizer.optimizer import FP32Optimizer
    return _after(FP32Optimizer, on_step)


def after_mixed_precision_steps(on_step: Callable[[torch.optim.Optimizer], None]) -> Patch:
    """The same for ``MixedPrecisionOptimizer.step_with_ready_grads`` (after its copy of the masters to the model
    parameters): ``on_step`` gets the torch optimizer, which holds the fp32 masters."""
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
    return _after(MixedPrecisionOptimizer, on_step)


__all__ = ["after_fp32_steps", "after_mixed_precision_steps"]
