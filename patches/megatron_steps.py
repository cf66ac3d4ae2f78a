"""One hook point for work at Megatron-core's optimizer-step boundary: ``FP32Optimizer.step_with_ready_grads``
(a ``ChainedOptimizer`` steps each of its optimizers through it), used by Hecate's re-sharding
(patches/megatron_hecate_reshard.py) and Lina's packing (patches/megatron_lina_packing.py), which refuse each
other, so one replacement is active at a time."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from moe_plugins.core.patcher import Patch


def after_fp32_steps(on_step: Callable[[torch.optim.Optimizer], None]) -> Patch:
    """The patch of ``FP32Optimizer.step_with_ready_grads`` that calls ``on_step(torch_optimizer)`` after every
    successful step of an optimizer that holds a torch optimizer."""
    from megatron.core.optimizer.optimizer import FP32Optimizer
    original = FP32Optimizer.step_with_ready_grads

    @functools.wraps(original)
    def step_with_ready_grads(opt) -> bool:
        ok = original(opt)
        if ok and opt.optimizer is not None:
            on_step(opt.optimizer)
        return ok
    return Patch(FP32Optimizer, "step_with_ready_grads", step_with_ready_grads)


__all__ = ["after_fp32_steps"]
