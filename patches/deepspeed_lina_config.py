"""What Lina's gradient micro-ops need of a DeepSpeed engine's settings (patches/deepspeed_lina.py): read from its
parsed config before anything is set up, one line per problem naming the field."""

from __future__ import annotations

from typing import List, Optional

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
    if grad_dtype is not None and comm_dtype != grad_dtype:
        problems.append(f"{PATH} needs communication_data_type equal to the gradients' dtype ({grad_dtype}); got "
                        f"{comm_dtype}: Lina sums the gradients in their own dtype")
    if cfg.prescale_gradients:
        problems.append(f"{PATH} does not support prescale_gradients (true): Lina sums before DeepSpeed divides")
    if cfg.gradient_predivide_factor != 1.0:
        problems.append(f"{PATH} does not support gradient_predivide_factor ({cfg.gradient_predivide_factor}) != 1")
    sparse = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding) and m.sparse]
    if sparse:
        problems.append(f"{PATH} does not support sparse gradients (nn.Embedding(sparse=True): {', '.join(sparse)})")
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        problems.append(f"{PATH} does not support sequence parallelism (size {engine.sequence_parallel_size})")
    return problems
