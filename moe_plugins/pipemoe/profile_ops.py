"""PipeMoE's op for ``moe-plugins profile``: what the pipelined runner costs per chunk (``chunk``)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from moe_plugins.core.baseline import BaselineSchedule
from moe_plugins.core.config import MoEConfig
from moe_plugins.core.engine import build_engine
from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.profile_ops import ProfileBench
from moe_plugins.pipemoe.runner import build_executor

CHUNK_DEGREES = (1, 2, 3, 4, 6, 8)


def CHUNK_OP(spec, groups: MoEProcessGroups, device: torch.device, stack) -> Optional[ProfileBench]:
    """Forward + backward of a tiny baseline MoE layer at each degree in CHUNK_DEGREES, all degrees on one
    engine's pipeline lane (collective to build: every rank builds it in the same order); x = the degree."""
    if "chunk" not in spec.ops:
        return None
    dtype = spec.torch_dtype
    layout = groups.layout
    config = MoEConfig(hidden=32, ffn=32 * layout.esp, num_experts=2 * layout.ep, k=1, capacity_factor=1.0,
                       min_capacity=max(CHUNK_DEGREES))
    engine = build_engine(groups, pipeline=True)
    stack.callback(engine.close)
    layers = [MoELayer(config, groups, schedule=BaselineSchedule, dtype=dtype, executor=build_executor(r, None, engine),
                       engine=engine).to(device) for r in CHUNK_DEGREES]
    gen = torch.Generator().manual_seed(0)
    x_SM = torch.randn(16 * config.num_experts, config.hidden, generator=gen).to(device=device, dtype=dtype)
    for layer in layers:
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen).to(p))

    def setup(i: int) -> Callable[[], None]:
        def run() -> None:
            out = layers[i](x_SM.detach().requires_grad_(True))
            (out.y.sum() + out.aux_loss).backward()
        return run
    return ProfileBench("chunk", lambda i: float(CHUNK_DEGREES[i]), setup, points=len(CHUNK_DEGREES))
