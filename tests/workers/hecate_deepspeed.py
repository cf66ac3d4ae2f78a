"""Pool jobs for tests/test_hecate_deepspeed.py: Hecate (schedule ``hecate``) on DeepSpeed's MoE layer against stock
DeepSpeed, on gloo ranks: one fp64 forward and backward (with what Hecate did on each rank), training with every
parameter's gradient accumulations counted, and checkpoints across Hecate on and off.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from moe_plugins.core.ledger import CommLedger
from moe_plugins.tools.verify import AUX_COEF, make_problem
from moe_plugins.tools.verify_deepspeed import (DeepSpeedVerifySpec, build_moe, compare_sides, deepspeed_groups,
                                                gloo_compat, init_deepspeed_comm, init_experts, reduced_grads,
                                                report)
from tests.workers import deepspeed as jobs


def _grad_counter(params) -> Counter:
    """Counts, per parameter name, how often autograd accumulated its gradient (the event DeepSpeed ZeRO's
    gradient hooks run on: ``register_post_accumulate_grad_hook``)."""
    counts: Counter = Counter()
    for name, p in params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, name=name: counts.update([name]))
    return counts


def _skew_gate(moe, spec: DeepSpeedVerifySpec, x_DSM: torch.Tensor) -> None:
    """Bias DeepSpeed's gate towards expert 0 as verify's ``skew`` biases the reference gate (the same on every
    rank and side: it depends on the seed and the problem only)."""
    if spec.skew:
        mean_M = x_DSM.mean((0, 1)).to(moe.deepspeed_moe.gate.wg.weight.dtype)
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight[0] += spec.skew * mean_M / mean_M.norm()


def _side(spec: DeepSpeedVerifySpec, section: Optional[Dict[str, Any]], ledger: Optional[CommLedger],
          gelu: str = "none") -> Dict[str, Any]:
    """verify_deepspeed.run_side (no mpu) with the gate skewed and the experts' GELU approximated by ``gelu``
    ("tanh": GPT-2's gelu_new): stock DeepSpeed when ``section`` is None, else the plugin, which also returns what
    Hecate did on this rank (placement, load, computed rows) and each parameter's gradient accumulations."""
    from moe_plugins.patches import deepspeed as adapter
    with ExitStack() as stack:
        groups = stack.enter_context(deepspeed_groups(None))
        stack.enter_context(gloo_compat())
        handle = stack.enter_context(adapter.enable(section, ledger=ledger)) if section is not None else None
        torch.manual_seed(spec.seed)
        moe = build_moe(spec, None)
        for expert in moe.deepspeed_moe.experts.deepspeed_experts:
            expert[1] = torch.nn.GELU(approximate=gelu)
        moe.set_deepspeed_parallelism()
        name = moe.expert_group_name
        ep_rank = dist.get_rank(group=groups._EXPERT_PARALLEL_GROUP[name])
        init_experts(moe, spec.seed, ep_rank, 0, 1)
        prob, dp_rank = make_problem(spec), dist.get_rank()
        _skew_gate(moe, spec, prob.x_DSM)
        x = prob.x_DSM[dp_rank].clone().requires_grad_(True)
        own_SM = x.detach().reshape(-1, spec.hidden)
        calls: List[Dict[str, Any]] = []
        moe.deepspeed_moe.gate.register_forward_hook(lambda _m, inp, out: calls.append(
            {"capacity": int(out[1]), "dropped": int((out[3] < 0).sum()), "own": bool(torch.equal(inp[0], own_SM))}))
        accumulated = _grad_counter(moe.named_parameters())
        torch.manual_seed(spec.seed + 1)
        y, l_aux, exp_counts = moe(x)
        ((y * prob.g_DSM[dp_rank]).sum() + AUX_COEF * l_aux).backward()
        dense, experts = reduced_grads(moe, groups._EXPERT_DATA_PARALLEL_GROUP[name], ep_rank, 0)
        out = {"y": y.detach(), "grad_x": x.grad, "aux": l_aux.detach(), "counts": exp_counts.detach(),
               "calls": calls, "dense_grads": dense, "expert_grads": experts, "keys": list(moe.state_dict()),
               "attrs": {n: (getattr(p, "allreduce", None), getattr(p, "group_name", None))
                         for n, p in moe.named_parameters()},
               "accumulated": dict(accumulated), "params": [n for n, p in moe.named_parameters() if p.requires_grad]}
        if handle is not None:
            schedule = handle.swapped_layers[moe.deepspeed_moe].schedule
            last = schedule.last
            out.update(swaps=list(handle.swaps), hecate={
                "ep_rank": schedule.groups.ep.rank, "ep_ranks": list(schedule.groups.ep.ranks),
                "copies_E": [list(c) for c in last.placement.copies_E], "load_E": list(last.load_E),
                "rows_E": list(last.rows_E), "extra": last.extra_copies(), "activation": schedule.activation})
        return out


def fp64_against_stock(spec: DeepSpeedVerifySpec, section: Dict[str, Any],
                       gelu: str = "none") -> Optional[Dict[str, Any]]:
    """Stock DeepSpeed, then Hecate through the adapter (``section``), on the same tokens, weights (the gate
    skewed by ``spec.skew``) and RNG state. Rank 0 gets verify_deepspeed's report plus, per rank, what Hecate did
    and the gradient accumulations."""
    init_deepspeed_comm()
    ledger = CommLedger()
    stock = _side(spec, None, None, gelu)
    plugin = _side(spec, section, ledger, gelu)
    mine = {"rank": dist.get_rank(), **compare_sides(stock, plugin), "swaps": plugin["swaps"],
            "expert_grads": (stock["expert_grads"], plugin["expert_grads"]), "ledger": ledger.summary(),
            "hecate": plugin["hecate"], "accumulated": plugin["accumulated"], "params": plugin["params"]}
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank():
        return None
    return {**report(spec, gathered), "ranks": [{k: r[k] for k in ("hecate", "accumulated", "params")}
                                                for r in gathered]}


def _count_zero_hooks(engine, stack: ExitStack) -> Counter:
    """Counts, per parameter name, DeepSpeed ZeRO 1/2's own gradient hook (``process_gradients``, looked up on
    the optimizer at each call) where the engine registered it, until ``stack`` closes; an empty counter where
    it did not."""
    counts: Counter = Counter()
    if getattr(engine.optimizer, "_grad_acc_hooks", None):
        stack.enter_context(jobs.count_zero_hooks(engine, counts))
    return counts


def train_counted(stage: int, plugin: Optional[Dict[str, Any]], ep: int, k: int, seed: int,
                  steps: int) -> Dict[str, Any]:
    """tests/workers/deepspeed.py's training run (``deepspeed.initialize``, the plugin enabled iff ``plugin``),
    with each parameter's gradient accumulations and ZeRO hook calls counted over the run."""
    import moe_plugins
    init_deepspeed_comm()
    with ExitStack() as stack:
        stack.enter_context(deepspeed_groups(None))
        handle = stack.enter_context(moe_plugins.enable()) if plugin is not None else None
        engine = jobs.make_engine(stage, plugin, ep, k, seed)
        accumulated = _grad_counter(engine.module.named_parameters())
        zero_hooks = _count_zero_hooks(engine, stack)
        losses = jobs.train(engine, seed, range(steps))
        layer = handle.swapped_layers.get(engine.module.moe.deepspeed_moe) if handle is not None else None
        extra = layer.schedule.last.extra_copies() if layer is not None else None
        swaps = list(handle.swaps) if handle is not None else []
        params = [n for n, p in engine.module.named_parameters() if p.requires_grad]
        engine.destroy()
    return {"losses": losses, "accumulated": dict(accumulated), "zero_hooks": dict(zero_hooks), "params": params,
            "extra_copies": extra, "swaps": swaps}


def train_on_and_off(stage: int, plugin: Dict[str, Any], ep: int, k: int, seed: int, steps: int) -> Dict[str, Any]:
    return {"off": train_counted(stage, None, ep, k, seed, steps),
            "on": train_counted(stage, plugin, ep, k, seed, steps)}


def refusal(section: Dict[str, Any]) -> Dict[str, Any]:
    """What setting up a DeepSpeed MoE layer says under Hecate when its experts are Linear -> Tanh -> Linear (an
    activation Hecate's functional FFN does not have), and whether anything was swapped or registered first."""
    from deepspeed.moe.layer import MoE
    from torch import nn

    from moe_plugins.patches import deepspeed as adapter
    init_deepspeed_comm()
    with deepspeed_groups(None) as groups, gloo_compat(), adapter.enable(section) as handle:
        expert = nn.Sequential(nn.Linear(jobs.M, jobs.H), nn.Tanh(), nn.Linear(jobs.H, jobs.M))
        moe = MoE(hidden_size=jobs.M, expert=expert, num_experts=jobs.E, ep_size=2, k=1)
        try:
            moe.set_deepspeed_parallelism()
            error = None
        except ValueError as exc:
            error = str(exc)
        return {"error": error, "swaps": list(handle.swaps), "swapped": len(handle.swapped_layers),
                "registered": moe.expert_group_name in groups._EXPERT_PARALLEL_GROUP}
