"""What Lina's gradient micro-ops need of a DeepSpeed engine's settings (patches/deepspeed_lina.py): read from its
parsed config before anything is set up, one line per problem naming the field; and how DeepSpeed scales the
gradients around their sum (``GradScaling``, pure), which Lina then does instead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from moe_plugins.core.plugin_config import SECTION
from moe_plugins.lina.config import LinaConfig

CHECKED_VERSION = "0.19.8"
PATH = f"{SECTION}.lina"


def _grad_dtype(engine, model: torch.nn.Module) -> Optional[torch.dtype]:
    if engine.fp16_enabled():
        return torch.float16
    if engine.bfloat16_enabled():
        return torch.bfloat16
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def config_problems(engine, model: torch.nn.Module, lina: LinaConfig, version: str) -> List[str]:
    """Every setting of this DeepSpeed engine Lina cannot reproduce exactly, each naming its field (read from
    the engine's parsed config before anything is set up)."""
    cfg, problems = engine._config, []
    if version != CHECKED_VERSION:
        problems.append(f"{PATH} needs DeepSpeed {CHECKED_VERSION}, the version its hooks were checked against; "
                        f"found {version}")
    stage = engine.zero_optimization_stage()
    if stage not in (0, 1, 2):
        problems.append(f"{PATH} needs zero_optimization.stage 0, 1 or 2 (got {stage})")
    if stage in (1, 2) and not engine.zero_contiguous_gradients():
        problems.append(f"{PATH} needs zero_optimization.contiguous_gradients true with ZeRO {stage} (got false): "
                        "without it DeepSpeed reduces through buffered_reduce_fallback, which Lina does not hook")
    if stage in (1, 2) and getattr(cfg.zero_config, "zenflow", None) is not None:
        problems.append(f"{PATH} does not support zero_optimization.zenflow")
    if stage == 1 and engine.bfloat16_enabled() and engine.get_data_types()[1] == torch.float32:
        problems.append(f"{PATH} does not support bf16 with data_types.grad_accum_dtype fp32 at ZeRO 1: DeepSpeed's "
                        "BF16_Optimizer reduces its own fp32 copies of the gradients, not the gradients Lina reduces")
    grad_dtype, comm_dtype = _grad_dtype(engine, model), engine.communication_data_type
    if stage in (1, 2) and grad_dtype is not None and comm_dtype != grad_dtype:
        problems.append(f"{PATH} needs communication_data_type equal to the gradients' dtype ({grad_dtype}) at "
                        f"ZeRO {stage}; got {comm_dtype}: ZeRO 1/2 keep the sum in it in their partitions, and Lina "
                        "sums the gradients in their own dtype there (ZeRO 0 runs it: Lina sums in it too)")
    sparse = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding) and m.sparse]
    if sparse:
        problems.append(f"{PATH} does not support sparse gradients (nn.Embedding(sparse=True): {', '.join(sparse)})")
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        problems.append(f"{PATH} does not support sequence parallelism (size {engine.sequence_parallel_size})")
    return problems


@dataclass(frozen=True)
class GradScaling:
    """What DeepSpeed does to a dense gradient around its sum, as it does it (``("mul" | "div", x)``): Lina sums
    instead, so it applies ``before`` to each rank's gradient when it submits it and ``after`` to the sum, and
    DeepSpeed's own call runs undivided; the same operations in the same order give the same bits."""
    before: Optional[Tuple[str, float]] = None
    after: Optional[Tuple[str, float]] = None

    @property
    def active(self) -> bool:
        return self.before is not None or self.after is not None

    @staticmethod
    def apply(step: Optional[Tuple[str, float]], grad: torch.Tensor) -> None:
        if step is not None:
            op, x = step
            if op == "mul":
                grad.mul_(x)
            else:
                grad.div_(x)


def zero0_scaling(average: bool, prescale: bool, predivide: float, dp_size: float) -> GradScaling:
    """``DeepSpeedEngine.allreduce_bucket`` (0.19.8, ZeRO 0's dense gradients): with ``prescale_gradients`` each
    gradient is multiplied by 1/dp before the sum; else by 1/predivide before (unless 1) and predivide/dp after
    (unless equal); nothing unless the reduction averages."""
    if not average:
        return GradScaling()
    if prescale:
        return GradScaling(before=("mul", 1.0 / dp_size))
    return GradScaling(before=("mul", 1.0 / predivide) if predivide != 1.0 else None,
                       after=("mul", predivide / dp_size) if predivide != dp_size else None)


def reduce_scatter_scaling(average: bool, dp_size: float) -> GradScaling:
    """ZeRO 1/2's reduce-scatter path (``average_tensor``, the only one DeepSpeed allows with MoE): the bucket
    divided by dp before its sum. It reads neither ``prescale_gradients`` nor ``gradient_predivide_factor``
    (ZeRO 2 refuses them itself)."""
    return GradScaling(before=("div", dp_size)) if average else GradScaling()
