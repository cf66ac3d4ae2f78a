"""Jobs for tests/test_lancet_wgrad.py, run on pool ranks: a small model (Linear -> the core's expert FFN ->
Linear head) trained through ``deepspeed.initialize`` with ZeRO stage 2, stock and with Lancet's deferred weight
gradients (the expert FFN through ``deferred_partial_ffn``, both Linears wrapped by ``dense_wgrad``).

Shapes: B batch, L sequence, M model dim, H FFN hidden, E experts, N rows per expert (B * L / E).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_plugins.core.experts import ExpertWeights, init_full_weights, partial_ffn
from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.lancet import WgradQueue, deferred_partial_ffn, dense_wgrad
from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm
from tests.workers.deepspeed import count_zero_hooks, micro_steps

M, H, E, B, L = 8, 16, 4, 2, 8


class ExpertStack(nn.Module):
    """Linear -> expert FFN on E row groups (+ b2, residual) -> Linear head; MSE loss. ``queue`` set: the
    experts' weight gradients are deferred to it."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(M, M), nn.Linear(M, 1)
        w = init_full_weights(E, M, H, torch.Generator().manual_seed(5))
        self.w1_EMH, self.b1_EH = nn.Parameter(w.w1_EMH), nn.Parameter(w.b1_EH)
        self.w2_EHM, self.b2_EM = nn.Parameter(w.w2_EHM), nn.Parameter(w.b2_EM)
        self.queue: Optional[WgradQueue] = None

    def forward(self, x_BLM: torch.Tensor, t_BL1: torch.Tensor) -> torch.Tensor:
        h_BLM = self.inp(x_BLM)
        x_ENM = h_BLM.reshape(E, -1, M)
        w = ExpertWeights(self.w1_EMH, self.b1_EH, self.w2_EHM, self.b2_EM)
        y_ENM = partial_ffn(x_ENM, w, "gelu") if self.queue is None else \
            deferred_partial_ffn(x_ENM, w, "gelu", self.queue)
        m_BLM = (y_ENM + self.b2_EM.unsqueeze(1)).reshape(B, L, M)
        return F.mse_loss(self.head(torch.tanh(m_BLM + h_BLM)), t_BL1)


def ds_config(gas: int) -> Dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": 2}}


def batch(step: int):
    gen = torch.Generator().manual_seed(step * 104729 + dist.get_rank())
    x = torch.randn(B, L, M, generator=gen)
    return x, torch.sin(x.sum(-1, keepdim=True))


def flush_before_epilogue(optimizer, queue: WgradQueue) -> Patcher:
    """ZeRO's post-backward callback (``run_grad_acc_post_hooks``, queued when backward starts) flushes the queue
    first, so every deferred gradient reaches its hook before DeepSpeed's epilogue reads the reduced partitions."""
    state = optimizer._backward_hook_state
    original = state.run_grad_acc_post_hooks

    def run_grad_acc_post_hooks():
        queue.flush()
        return original()

    return Patcher([Patch(state, "run_grad_acc_post_hooks", run_grad_acc_post_hooks)])


def train(deferred: bool, steps: int, gas: int, torch_style: bool = False) -> Dict[str, Any]:
    """One fresh ZeRO-2 engine, ``gas`` micro-steps per step; counts each call of the optimizer's per-parameter
    reduction hook (``process_gradients``, what ZeRO-2's post-accumulate-grad hook calls) per micro-step.
    ``torch_style``: ``loss.backward()`` instead of ``engine.backward(loss)``. DeepSpeed then runs its epilogue
    from an autograd callback queued when backward starts, ahead of the queue's own end-of-backward flush, so
    the deferred gradients would miss it: :func:`flush_before_epilogue` is what a host adapter must add."""
    import deepspeed
    torch.manual_seed(0)
    model = ExpertStack()
    queue = WgradQueue()
    with ExitStack() as stack:
        stack.enter_context(deepspeed_groups(None))
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(gas))
        optimizer = engine.optimizer
        calls: Dict[str, int] = {}
        stack.enter_context(count_zero_hooks(engine, calls))
        if deferred:
            model.queue = queue
            stack.enter_context(dense_wgrad(queue, {"inp": model.inp, "head": model.head}))
            if torch_style:
                stack.enter_context(flush_before_epilogue(optimizer, queue))
        losses, grads, hook_calls = micro_steps(engine, steps * gas, lambda micro: engine(*batch(micro)), torch_style,
                                                calls)
        engine.destroy()
    return {"losses": losses, "grads": grads, "hook_calls": hook_calls, "deferred_items": queue.items_run,
            "queue_empty": queue.empty()}


def train_pair(steps: int, gas: int, torch_style: bool = False):
    init_deepspeed_comm()
    return train(False, steps, gas, torch_style), train(True, steps, gas, torch_style)


class _Exchange(torch.autograd.Function):
    """Identity whose backward stands in for a layer's backward exchange: it issues an all-to-all on the
    engine's pipeline lane, runs the queue while it is in flight (``run_while``), then waits."""

    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return grad, None


def run_while_exchange(delay_s: float) -> Dict[str, Any]:
    """Linear -> exchange -> Linear head in fp64, stock and with both Linears' dW deferred; rank 1 issues the
    exchange ``delay_s`` late, so on rank 0 it is in flight while ``run_while`` runs the head's dW."""
    import time
    from moe_plugins.core.engine import PIPELINE, build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.core.layout import ParallelLayout
    world, rank = dist.get_world_size(), dist.get_rank()
    out: Dict[str, Any] = {"ran": [], "exchanged": []}
    with process_groups(ParallelLayout(world=world, ranks_per_node=1, ep=world)) as groups:
        engine = build_engine(groups, pipeline=True, timeout_s=60)
        try:
            queue = WgradQueue()

            def exchange():
                if rank == 1:
                    time.sleep(delay_s)
                sent = torch.arange(world, dtype=torch.float64) + 10 * rank
                handle = engine.issue("all_to_all", groups.ep, sent, lane=PIPELINE, phase="backward")
                out["in_flight_before"] = not handle.done()
                out["ran"] += queue.run_while(handle)
                out["exchanged"] = handle.wait().tolist()

            grads = {}
            for deferred in (False, True):
                torch.manual_seed(0)
                inp, head = nn.Linear(M, H).double(), nn.Linear(H, 1).double()
                x = torch.randn(B, M, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
                with ExitStack() as stack:
                    if deferred:
                        stack.enter_context(dense_wgrad(queue, {"inp": inp, "head": head}))
                    hook = exchange if deferred else (lambda: None)
                    head(_Exchange.apply(torch.tanh(inp(x)), hook)).square().sum().backward()
                grads[deferred] = [p.grad.clone() for p in (*inp.parameters(), *head.parameters())]
        finally:
            engine.close()
    out["max_err"] = max(float((a - b).abs().max()) for a, b in zip(grads[False], grads[True]))
    out["queue_empty"] = queue.empty()
    return out
