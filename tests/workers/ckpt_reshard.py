"""Jobs for tests/test_ckpt_reshard.py, run on pool ranks: a DeepSpeed MoE model saved at one world / EP size
and loaded at another, with the plugin on or off on either side.

The data are the same per *global* batch whatever the world: step s draws G rows from (seed, s) and rank r of
w takes rows [r G/w, (r+1) G/w). Nothing makes the loss depend on how the rows are split: experts have room
for every token (capacity_factor = E, so no token is dropped), the gate's random draws are off and the loss is
the MSE alone (DeepSpeed's aux loss is a per-rank product of means). The mean of the per-rank losses is then
the loss of the global batch, at any size.

Shapes: G global batch, L sequence, M model dim, H FFN hidden, E experts.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm

M, H, E, G, L = 8, 16, 4, 8, 4
SEED = 11
EXPERT = re.compile(r"^(?P<prefix>.*\.deepspeed_experts\.)(?P<local>\d+)\.(?P<suffix>.+)$")


class ReshardModel(nn.Module):
    """Linear -> two DeepSpeed MoE layers (residual) -> Linear head; loss = MSE (no aux term)."""

    def __init__(self, ep: int):
        from deepspeed.moe.layer import MoE
        super().__init__()
        self.inp = nn.Linear(M, M)
        self.moes = nn.ModuleList(
            MoE(hidden_size=M, expert=nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M)), num_experts=E,
                ep_size=ep, k=1, capacity_factor=float(E), eval_capacity_factor=float(E), min_capacity=0,
                use_rts=False) for _ in range(2))
        self.head = nn.Linear(M, 1)

    def forward(self, x_BLM: torch.Tensor, t_BL1: torch.Tensor) -> torch.Tensor:
        h_BLM = self.inp(x_BLM)
        for moe in self.moes:
            m_BLM, _, _ = moe(h_BLM)
            h_BLM = h_BLM + m_BLM
        return F.mse_loss(self.head(torch.tanh(h_BLM)), t_BL1)


def ds_config(stage: int, plugin: Optional[Dict[str, Any]], world: int) -> Dict[str, Any]:
    cfg = {"train_batch_size": G, "train_micro_batch_size_per_gpu": G // world, "gradient_accumulation_steps": 1,
           "steps_per_print": 10 ** 6, "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if plugin is not None:
        cfg["moe_plugins"] = plugin
    return cfg


def global_batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch (the same G rows at every world size)."""
    gen = torch.Generator().manual_seed(SEED * 7919 + step)
    x = torch.randn(G, L, M, generator=gen)
    t = torch.sin(x.sum(-1, keepdim=True))
    rows = G // dist.get_world_size()
    r = dist.get_rank()
    return x[r * rows:(r + 1) * rows], t[r * rows:(r + 1) * rows]


def make_engine(stage: int, plugin: Optional[Dict[str, Any]], ep: int, seed: int):
    import deepspeed
    torch.manual_seed(seed)
    model = ReshardModel(ep)
    with torch.no_grad():                  # every global expert its own weights, from (seed, global id)
        for moe in model.moes:
            local = moe.deepspeed_moe.experts.deepspeed_experts
            first = dist.get_rank() % ep * len(local)     # DeepSpeed's (and the plugin's) EP rank
            for j, expert in enumerate(local):
                gen = torch.Generator().manual_seed(seed * 1009 + first + j)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(stage, plugin, dist.get_world_size()))
    return engine


def train(engine, steps: range) -> List[float]:
    """Per step, the loss of the global batch (mean of the per-rank losses of equal-size slices)."""
    losses = []
    for step in steps:
        loss = engine(*global_batch(step))
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
    return losses


def eval_loss(engine, step: int) -> float:
    with torch.no_grad():
        t = engine(*global_batch(step)).detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def global_state(engine) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every parameter this rank holds, named with *global* expert ids, with its Adam state (stage 0: the
    torch optimizer's per-parameter state): {name: {"param", "exp_avg", "exp_avg_sq", "step"}}."""
    from deepspeed.utils import groups
    names = {id(p): n for n, p in engine.module.named_parameters()}
    state = engine.optimizer.state
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for n, p in engine.module.named_parameters():
        m = EXPERT.match(n)
        if m:
            moe = engine.module.get_submodule(m["prefix"].split(".deepspeed_moe.")[0])
            first = groups._get_expert_parallel_rank(moe.expert_group_name) * moe.num_local_experts
            n = f"{m['prefix']}{first + int(m['local'])}.{m['suffix']}"
        entry = {"param": p.detach().clone()}
        entry.update({k: v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
                      for k, v in state.get(p, {}).items()})
        out[n] = entry
    assert len(names) == len(out)
    return out


def _enabled(plugin: Optional[Dict[str, Any]], stack: ExitStack) -> Any:
    """DeepSpeed's group registry for one model; the plugin's handle (None when off)."""
    import moe_plugins
    stack.enter_context(deepspeed_groups(None))
    return stack.enter_context(moe_plugins.enable()) if plugin is not None else None


def _swaps(handle: Any) -> int:
    return 0 if handle is None else len(handle.swaps)


def save(stage: int, plugin: Optional[Dict[str, Any]], ep: int, path: str, steps: int, more: int) -> Dict[str, Any]:
    """Train ``steps`` steps, save (tag "t"), then the uninterrupted run goes on ``more`` steps."""
    init_deepspeed_comm()
    with ExitStack() as stack:
        handle = _enabled(plugin, stack)
        engine = make_engine(stage, plugin, ep, SEED)
        before = train(engine, range(steps))
        engine.save_checkpoint(path, tag="t", client_state={"step": steps})
        saved = global_state(engine) if stage == 0 else {}
        first = eval_loss(engine, steps)
        after = train(engine, range(steps, steps + more))
        engine.destroy()
    dist.barrier()
    return {"before": before, "state": saved, "eval": first, "after": after, "swaps": _swaps(handle)}


def load(stage: int, plugin: Optional[Dict[str, Any]], ep: int, path: str, steps: int, more: int,
         native: bool) -> Dict[str, Any]:
    """A fresh engine (other weights) loads tag "t" -- DeepSpeed's ``load_checkpoint`` alone when ``native``,
    else through the reshard tool -- and trains ``more`` steps. A refusal comes back as its message."""
    init_deepspeed_comm()
    with ExitStack() as stack:
        handle = _enabled(plugin, stack)
        engine = make_engine(stage, plugin, ep, SEED + 100)
        try:
            if native:
                engine.load_checkpoint(path, tag="t")
            else:
                from moe_plugins.patches import deepspeed_reshard
                deepspeed_reshard.load_checkpoint(engine, path, tag="t")
        except Exception as exc:             # noqa: BLE001 -- the test asserts on the type and message
            engine.destroy()
            return {"error": f"{type(exc).__name__}: {exc}"}
        loaded = global_state(engine) if stage == 0 else {}
        first = eval_loss(engine, steps)
        after = train(engine, range(steps, steps + more))
        engine.destroy()
    return {"state": loaded, "eval": first, "after": after, "swaps": _swaps(handle)}
