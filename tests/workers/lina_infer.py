"""Jobs for tests/test_lina_infer.py, run on pool ranks: a stack of DeepSpeed MoE layers (fp64, residual) run in
eval mode by stock DeepSpeed and by the plugin with Lina's inference section, on the same batches; and the same
through ``deepspeed.initialize``.

Skew: every token carries a batch-dependent direction ``c_b`` (the hot expert's gate row, so that expert takes
most tokens, and a different one per batch: the estimate is often wrong and phase two re-plans) and a fixed one
``z`` that the gate of a *dead* expert points away from (that expert gets no token at all).

Shapes: T tokens per rank, M model dim, H FFN hidden, E experts, L MoE layers.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

M, H = 16, 24


def make_layers(num_layers: int, num_experts: int, ep: int, k: int, eval_capacity: float, drop: bool, seed: int,
                dead: int) -> nn.ModuleList:
    """``num_layers`` DeepSpeed MoE layers in fp64, with gate rows that make skew (module docstring)."""
    from deepspeed.moe.layer import MoE
    torch.manual_seed(seed)
    expert = nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M))
    layers = nn.ModuleList([MoE(hidden_size=M, expert=expert, num_experts=num_experts, ep_size=ep, k=k,
                                capacity_factor=1.0, eval_capacity_factor=eval_capacity, min_capacity=0,
                                drop_tokens=drop, use_rts=True) for _ in range(num_layers)])
    layers = layers.to(torch.float64)
    z = directions(seed)[0]
    with torch.no_grad():
        for i, moe in enumerate(layers):
            gen = torch.Generator().manual_seed(seed * 101 + i)
            w = moe.deepspeed_moe.gate.wg.weight
            rows = torch.stack([hot_direction(seed, e) for e in range(num_experts)])
            w.copy_(2.0 * rows + 0.3 * torch.randn(rows.shape, generator=gen, dtype=torch.float64))
            w[dead] = -3.0 * z
    return layers


def directions(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 7)
    d = torch.randn(64, M, generator=gen, dtype=torch.float64)
    return d / d.norm(dim=1, keepdim=True)


def hot_direction(seed: int, expert: int) -> torch.Tensor:
    return directions(seed)[1 + expert]


def batch(seed: int, b: int, tokens: int, num_experts: int, dead: int, hot_scale: float = 4.0) -> torch.Tensor:
    hot = [e for e in range(num_experts) if e != dead][b % (num_experts - 1)]
    gen = torch.Generator().manual_seed(seed * 7919 + b * 104729 + dist.get_rank())
    x = 0.5 * torch.randn(tokens, M, generator=gen, dtype=torch.float64)
    return x + hot_scale * hot_direction(seed, hot) + 4.0 * directions(seed)[0]


def forward(layers: nn.ModuleList, x_TM: torch.Tensor, seed: int) -> List[Dict[str, torch.Tensor]]:
    """Each layer's MoE output, expert counts and every token's top-1 expert (the gate's first choice, as
    ``moe-plugins lina-profile`` records it) for one batch; the gate's random draws seeded per batch."""
    torch.manual_seed(seed)
    out, h = [], x_TM
    with torch.no_grad():
        for moe in layers:
            logits = h.float() @ moe.deepspeed_moe.gate.wg.weight.float().t()
            top1 = torch.argmax(torch.softmax(logits, dim=1), dim=1)
            m, _, counts = moe(h.unsqueeze(0))
            out.append({"y": m.squeeze(0).clone(), "counts": counts.clone(), "top1": top1})
            h = h + m.squeeze(0)
    return out


def side(plugin: Optional[Dict[str, Any]], case: Dict[str, Any]) -> Dict[str, Any]:
    """Build, set up and run the stack on this rank: stock when ``plugin`` is None."""
    from moe_plugins import lina
    from moe_plugins.core.plugin_config import PluginConfig
    from moe_plugins.lina.infer import STATE_ATTR
    from moe_plugins.patches import deepspeed as adapter
    from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_experts
    seed, ep, num_experts = case["seed"], dist.get_world_size(), case["experts"]
    with ExitStack() as stack:
        groups = stack.enter_context(deepspeed_groups(None))
        if plugin is not None:
            stack.enter_context(adapter.enable(PluginConfig.from_dict(plugin)))
        layers = make_layers(case["layers"], num_experts, ep, case["k"], case["eval_capacity"], case["drop"], seed,
                             case["dead"])
        for moe in layers:
            moe.set_deepspeed_parallelism()
            ep_rank = dist.get_rank(group=groups._EXPERT_PARALLEL_GROUP[moe.expert_group_name])
            init_experts(moe, seed, ep_rank, 0, 1)
        layers.eval()
        runs, placements = [], []
        for b in range(case["batches"]):
            if b == case.get("rescale_at"):
                with torch.no_grad():                  # in place: the replicas' fingerprints must see it
                    for p in layers.parameters():
                        if getattr(p, "allreduce", True) is False:
                            p.mul_(0.9)
            x = batch(seed, b, case["tokens"], num_experts, case["dead"], case.get("hot_scale", 4.0))
            runs.append(forward(layers, x, seed + b))
            schedulers = [getattr(moe.deepspeed_moe, STATE_ATTR, None) for moe in layers]
            placements.append([None if s is None or s.placement is None else
                               (list(s.placement.replica_counts),
                                None if s.estimated is None else list(s.estimated.replica_counts))
                               for s in schedulers])
        stats = lina.inference_stats(layers) if plugin is not None else []
        lina.reset_inference_stats(layers)
        reset = lina.inference_stats(layers) if plugin is not None else []
    return {"runs": runs, "placements": placements, "stats": stats, "reset": reset}


def compare_stack(section: Dict[str, Any], case: Dict[str, Any]) -> Dict[str, Any]:
    """Stock, then the plugin with ``section``, on this rank: the largest output difference, the dropped rows
    (all-zero MoE outputs, top-1) on both sides, global expert counts, placements and statistics."""
    from moe_plugins.tools.verify_deepspeed import init_deepspeed_comm
    init_deepspeed_comm()
    stock = side(None, case)
    if case.get("profile"):
        section = profile(stock["runs"], section, case)
    plugin = side(section, case)
    errs, zero_rows, same_zero, global_counts = [], [], True, []
    for s_run, p_run in zip(stock["runs"], plugin["runs"]):
        for s, p in zip(s_run, p_run):
            errs.append(float((s["y"] - p["y"]).abs().max()))
            zs, zp = s["y"].abs().sum(1) == 0, p["y"].abs().sum(1) == 0
            same_zero &= bool(torch.equal(zs, zp))
            zero_rows.append(int(zs.sum()))
            counts = s["counts"].clone()
            dist.all_reduce(counts)
            global_counts.append(counts.tolist())
    return {"max_err": max(errs), "same_zero": same_zero, "zero_rows": sum(zero_rows),
            "global_counts": global_counts, "placements": plugin["placements"], "stats": plugin["stats"],
            "reset": plugin["reset"]}


def profile(runs: List[List[Dict[str, torch.Tensor]]], section: Dict[str, Any], case: Dict[str, Any]
            ) -> Dict[str, Any]:
    """A popularity table of the stock run's routing (every rank's tokens), written by rank 0 to
    ``case["profile"]``: the section with it as its table."""
    from moe_plugins.lina.popularity import ModelFacts, build_table, save_table
    mine = [row for run in runs for row in torch.stack([layer["top1"] for layer in run], 1).tolist()]
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        facts = ModelFacts(num_layers=case["layers"], num_experts=case["experts"], top_k=case["k"])
        save_table(build_table([r for rows in every for r in rows], facts, start_layer=1), case["profile"])
    dist.barrier()
    inference = {**section["lina"]["inference"], "table": case["profile"]}
    return {**section, "lina": {**section["lina"], "inference": inference}}


def refused_stack(section: Dict[str, Any], case: Dict[str, Any]) -> Dict[str, Any]:
    """The plugin's stack with ``section``: the ValueError a bad table gives (at swap or at the first batch), and
    whether the host is as it was after the plugin is disabled."""
    from moe_plugins.tools.verify_deepspeed import init_deepspeed_comm
    from tests.workers.bad_configs import HostState
    init_deepspeed_comm()
    before = HostState.capture(megatron=False)
    message = None
    try:
        side(section, case)
    except ValueError as exc:
        message = str(exc)
    return {"message": message, "changed": before.differences(HostState.capture(megatron=False))}


class StackModel(nn.Module):
    """The stack behind an input and a head, for ``deepspeed.initialize`` (fp32: DeepSpeed's engine)."""

    def __init__(self, case: Dict[str, Any]):
        super().__init__()
        self.inp = nn.Linear(M, M)
        self.moes = make_layers(case["layers"], case["experts"], dist.get_world_size(), case["k"],
                                case["eval_capacity"], case["drop"], case["seed"], case["dead"]).float()
        self.head = nn.Linear(M, 1)

    def forward(self, x_BTM: torch.Tensor) -> torch.Tensor:
        h = self.inp(x_BTM)
        for moe in self.moes:
            h = h + moe(h)[0]
        return self.head(h)


def engine_side(plugin: Optional[Dict[str, Any]], case: Dict[str, Any]) -> Dict[str, Any]:
    import deepspeed

    import moe_plugins
    from moe_plugins import lina
    from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_experts
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
    if plugin is not None:
        config["moe_plugins"] = plugin
    with ExitStack() as stack:
        groups = stack.enter_context(deepspeed_groups(None))
        if plugin is not None:
            stack.enter_context(moe_plugins.enable())
        torch.manual_seed(case["seed"])
        model = StackModel(case)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        for moe in model.moes:
            ep_rank = dist.get_rank(group=groups._EXPERT_PARALLEL_GROUP[moe.expert_group_name])
            init_experts(moe, case["seed"], ep_rank, 0, 1)
        engine.eval()
        outs = []
        for b in range(case["batches"]):
            x = batch(case["seed"], b, case["tokens"], case["experts"], case["dead"]).float().unsqueeze(0)
            torch.manual_seed(case["seed"] + b)
            with torch.no_grad():
                outs.append(engine(x).detach().clone())
        stats = lina.inference_stats(engine.module)
        engine.destroy()
    return {"outs": outs, "stats": stats}


def compare_engines(section: Dict[str, Any], case: Dict[str, Any]) -> Dict[str, Any]:
    from moe_plugins.tools.verify_deepspeed import init_deepspeed_comm
    init_deepspeed_comm()
    stock = engine_side(None, case)
    plugin = engine_side(section, case)
    err = max(float((a - b).abs().max()) for a, b in zip(stock["outs"], plugin["outs"]))
    scale = max(float(a.abs().max()) for a in stock["outs"])
    return {"max_err": err, "scale": scale, "stats": plugin["stats"]}
