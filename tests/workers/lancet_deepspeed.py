"""Jobs for tests/test_lancet_deepspeed.py, run on pool ranks: tests/workers/deepspeed.py's tiny DeepSpeed MoE model
in fp64 under ZeRO-2, trained by stock DeepSpeed, by the plugin, and by the plugin with Lancet's ``lancet`` section
(the experts' weight gradients deferred), from the same weights on the same batches.

Shapes: B batch, L sequence, M model dim.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm, init_experts
from tests.workers.deepspeed import TinyMoEModel, batch, count_zero_hooks, micro_steps


def ds_config(gas: int, plugin: Optional[Dict[str, Any]], stage: int = 2) -> Dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if plugin is not None:
        cfg["moe_plugins"] = plugin
    return cfg


def train(plugin: Optional[Dict[str, Any]], ep: int, k: int, steps: int, gas: int, torch_style: bool,
          seed: int = 3, stage: int = 2) -> Dict[str, Any]:
    """A fresh fp64 ZeRO-``stage`` (1 or 2) engine (the plugin enabled iff ``plugin`` is a section): per micro-step the loss and
    the calls of ZeRO's per-parameter reduction hook (``process_gradients``) by parameter name; the reduced
    gradient partitions at each boundary. ``torch_style``: ``loss.backward()`` instead of ``engine.backward``."""
    import deepspeed

    import moe_plugins
    out: Dict[str, Any] = {}
    with ExitStack() as stack:
        stack.enter_context(deepspeed_groups(None))
        handle = stack.enter_context(moe_plugins.enable()) if plugin is not None else None
        torch.manual_seed(seed)
        model = TinyMoEModel(ep, k).double()
        init_experts(model.moe, seed, ep_rank=dist.get_rank() % ep, tp_rank=0, tp=1)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(gas, plugin, stage))
        calls: Dict[str, int] = {}
        stack.enter_context(count_zero_hooks(engine, calls))

        def loss_of(micro: int) -> torch.Tensor:
            torch.manual_seed(seed * 31 + micro)      # the gate's random draws, the same in every run
            x, t = batch(seed, micro)
            return engine(x.double(), t.double())

        out["losses"], out["grads"], out["hook_calls"] = micro_steps(engine, steps * gas, loss_of, torch_style, calls)
        lancet = handle.lancet if handle is not None else None
        out["queue_empty"] = lancet is None or lancet.queue is None or lancet.queue.empty()
        out["items_run"] = 0 if lancet is None or lancet.queue is None else lancet.queue.items_run
        out["lancet_layers"] = [] if lancet is None else list(lancet.layers)
        out["overlap_calls"] = 0 if lancet is None else sum(o.calls for o in lancet.overlaps)
        engine.destroy()
    epilogue = __import__("deepspeed.runtime.base_optimizer", fromlist=["x"]).BackwardHookStateManager
    out["epilogue_restored"] = not hasattr(epilogue.run_grad_acc_post_hooks, "__wrapped__")
    return out


def compare_runs(ep: int, k: int, steps: int, gas: int, torch_style: bool, degree: int = 1,
                 stage: int = 2) -> Dict[str, Any]:
    """Stock DeepSpeed, the plugin, and the plugin with Lancet, each trained the same way (``degree``: PipeMoE's
    pipeline degree; at 2 the exchanges run on the lane thread, so the dW waits for the end-of-backward flush)."""
    init_deepspeed_comm()
    plugin = {"schedule": "baseline", "pipeline_degree": degree}
    return {"stock": train(None, ep, k, steps, gas, torch_style, stage=stage),
            "plugin": train(plugin, ep, k, steps, gas, torch_style, stage=stage),
            "lancet": train({**plugin, "lancet": {"defer_wgrad": True}}, ep, k, steps, gas, torch_style, stage=stage)}


def refused(section: Dict[str, Any]) -> str:
    """The error ``deepspeed.initialize`` raises for a Lancet section on the tiny model (or "")."""
    init_deepspeed_comm()
    try:
        train(section, 2, 1, 1, 1, False)
    except ValueError as exc:
        return str(exc)
    return ""
