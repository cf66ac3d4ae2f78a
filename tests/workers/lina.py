"""Pool jobs for Lina's core tests: training steps of two MoE layers between dense layers on gloo ranks, the
dense gradients reduced by Lina's GradReducer during backward, checked against a synchronous all-reduce.

Shapes: S tokens, M hidden.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from moe_plugins.core.config import MoEConfig
from moe_plugins.core.engine import build_engine
from moe_plugins.core.experts import ExpertWeights
from moe_plugins.core.groups import process_groups
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.lina.reducer import GradReducer

M, S, E = 16, 32, 4


class Net(torch.nn.Module):
    def __init__(self, groups, engine, dtype):
        super().__init__()
        config = MoEConfig(hidden=M, ffn=2 * M, num_experts=E, k=2, capacity_factor=1.0)
        self.dense = torch.nn.ModuleList(torch.nn.Linear(M, M, dtype=dtype) for _ in range(3))
        self.moe = torch.nn.ModuleList(MoELayer(config, groups, engine=engine, name=f"moe{i}", dtype=dtype)
                                       for i in range(2))
        g = torch.Generator().manual_seed(0)
        for layer in self.moe:
            full = ExpertWeights(*(torch.randn(*shape, generator=g, dtype=dtype) * 0.3 for shape in
                                   ((E, M, 2 * M), (E, 2 * M), (E, 2 * M, M), (E, M))))
            layer.load_full(torch.randn(E, M, generator=g, dtype=dtype), full)

    def forward(self, x_SM):
        aux = 0.0
        for i in range(2):
            x_SM = torch.tanh(self.dense[i](x_SM))
            out = self.moe[i](x_SM)
            x_SM, aux = x_SM + out.y, aux + out.aux_loss
        return self.dense[2](x_SM).pow(2).mean() + 0.01 * aux


def lina_steps(world: int, steps: int, *, priority: bool, micro_op_bytes: int, max_sleep_s: float = 0.0,
               seed: int = 0) -> Dict[str, Any]:
    """``steps`` forward+backward steps; Lina's micro-ops reduce the dense gradients during backward. Per step,
    the largest difference from the same step reduced synchronously afterwards (``torch.distributed``)."""
    torch.manual_seed(seed)
    dtype = torch.float64
    layout = ParallelLayout(world=world, ranks_per_node=max(1, world // 2), ep=world)
    rng = random.Random(seed * 100 + dist.get_rank())
    with process_groups(layout) as groups:
        engine = build_engine(groups, background=True, record_timeline=True, timeout_s=60)
        try:
            net = Net(groups, engine, dtype)
            dense = [p for p in net.dense.parameters()]
            reducer = GradReducer(engine, micro_op_bytes=micro_op_bytes, priority=priority)
            pending: List[Any] = []
            on = [True]

            def submit(p):
                if on[0]:
                    if max_sleep_s:
                        time.sleep(rng.random() * max_sleep_s)
                    pending.append(reducer.submit(p.grad.view(-1), groups.dp))
            for p in dense:
                p.register_post_accumulate_grad_hook(submit)
            diffs = []
            for step in range(steps):
                x_SM = torch.randn(S, M, dtype=dtype, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
                on[0] = True
                net.zero_grad(set_to_none=True)
                net(x_SM).backward()
                for handle in pending:
                    handle.wait()
                pending.clear()
                lina = [p.grad.clone() for p in dense]
                on[0] = False                     # the reference: the same step, reduced synchronously after
                net.zero_grad(set_to_none=True)
                net(x_SM).backward()
                for p in dense:
                    dist.all_reduce(p.grad, group=groups.dp.pg)
                diffs.append(max(float((a - p.grad).abs().max()) for a, p in zip(lina, dense)))
        finally:
            engine.close()
        return {"diffs": diffs, "timeline": [asdict(r) for r in engine.timeline]}
