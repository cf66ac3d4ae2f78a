"""Pool jobs for Hecate's pooled slots on DeepSpeed (``"hecate": {"reshard_every": n, "pool_slots": true}``,
tests/test_hecate_pool.py): the recipes' GPT-2-MoE (2 MoE layers of 4 experts at EP 4: one expert per layer and
rank, two slots per rank) in fp64 (fp32 at ZeRO 0, which reduces no fp64 gradients), trained by stock DeepSpeed and by the plugin with the experts moved across the
layers' modules (one rank holding two experts of a layer and none of the other), and checkpoints written there.

Shapes: B samples per rank, L tokens per sample.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm
from tests.workers.lancet_blocks_deepspeed import SEQ, VOCAB, _model

B = 4
UNEVEN = ((0, 0, 1, 1), (2, 2, 3, 3))      # rank 0 holds experts 0 and 1 of layer 0, none of layer 1 ...


def section(every: int = 100) -> Dict[str, Any]:
    return {"ranks_per_node": 2, "hecate": {"enabled": True, "reshard_every": every, "pool_slots": True}}


def _engine(stage: int, plugin: Optional[Dict[str, Any]], seed: int = 0):
    import deepspeed
    torch.manual_seed(seed)
    model = _model().to(torch.float64 if stage else torch.float32)     # stage 0 reduces no fp64 gradients
    config = {"train_micro_batch_size_per_gpu": B, "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.003, "torch_adam": True}}}
    if plugin is not None:
        config["moe_plugins"] = plugin
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine, steps: range) -> List[float]:
    from recipes.models import moe_aux_loss
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        ids = torch.randint(0, VOCAB, (B, SEQ), generator=gen)
        torch.manual_seed(77 + step)                     # dropout's draws, the same in every run
        loss = engine(input_ids=ids, labels=ids).loss + 0.01 * moe_aux_loss(engine.module)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _moes(engine) -> List[torch.nn.Module]:
    return [m for m in engine.module.modules() if type(m).__name__ == "MOELayer"]


def experts_by_id(engine, handle) -> Dict[str, torch.Tensor]:
    """Every local expert's parameters keyed by (layer, global expert id), wherever the pool keeps them."""
    out = {}
    rank = dist.get_rank()
    for layer, moe in enumerate(_moes(engine)):
        pool = handle.hecate.pools.get(moe) if handle is not None else None
        if pool is None:
            ids, modules = [rank], list(moe.experts.deepspeed_experts)     # stock: expert e on rank e (EP 4)
        else:
            homes = handle.swapped_layers[moe].schedule.homes
            ids, modules = [e for e, h in enumerate(homes) if h == rank], pool.experts_of(moe)
        for e, module in zip(ids, modules):
            for n, p in module.named_parameters():
                out[f"{layer}.{e}.{n}"] = p.detach().clone()
    return out


def _force(handle, homes_LE: Sequence[Sequence[int]]) -> None:
    resharder = handle.hecate.resharders[0]
    optimizer, extra = resharder._moving()
    resharder.resharder.reshard(optimizer, [tuple(h) for h in homes_LE], extra)


def pooled_vs_stock(stage: int, steps: int, every: int = 100) -> Dict[str, Any]:
    """``steps`` steps of stock DeepSpeed and of the plugin, whose experts are moved to :data:`UNEVEN` after the
    first step (and re-sharded by Algorithm 2 with pooled slots every ``every`` steps): losses, each layer's homes
    and experts per rank, the experts by (layer, id)."""
    import moe_plugins
    init_deepspeed_comm()
    out: Dict[str, Any] = {}
    for name, plugin in (("off", None), ("on", section(every))):
        with ExitStack() as stack:
            stack.enter_context(deepspeed_groups(None))
            handle = stack.enter_context(moe_plugins.enable()) if plugin is not None else None
            engine = _engine(stage, plugin)
            losses = _train(engine, range(1))
            if handle is not None:
                _force(handle, UNEVEN)
            losses += _train(engine, range(1, steps))
            res: Dict[str, Any] = {"losses": losses, "experts": experts_by_id(engine, handle)}
            if handle is not None:
                schedules = [handle.swapped_layers[m].schedule for m in _moes(engine)]
                res["homes"] = [s.homes for s in schedules]
                res["held"] = [len(handle.hecate.pools[m].experts_of(m)) for m in _moes(engine)]
                res["rounds"] = handle.hecate.resharders[0].resharder.rounds
            engine.destroy()
        out[name] = res
    return out


def pooled_checkpoint(path: str, stage: int, save_pooled: bool) -> Dict[str, Any]:
    """Train 3 steps and save (the saver pooled with its experts at :data:`UNEVEN`, or stock), go on 2 steps; a
    fresh engine (another seed) of the other kind loads the checkpoint (a pooled loader moved to UNEVEN before and
    after loading) and runs the same 2 steps. Both runs' losses after the save, and the experts by id after saving and loading."""
    import moe_plugins
    init_deepspeed_comm()
    results = {}
    for role, pooled, seed in (("saver", save_pooled, 0), ("loader", not save_pooled, 9)):
        with ExitStack() as stack:
            stack.enter_context(deepspeed_groups(None))
            handle = stack.enter_context(moe_plugins.enable()) if pooled else None
            engine = _engine(stage, section() if pooled else None, seed)
            if role == "saver":
                _train(engine, range(1))
                if handle is not None:
                    _force(handle, UNEVEN)
                _train(engine, range(1, 3))
                engine.save_checkpoint(path, tag="t")
            else:
                if handle is not None:
                    _train(engine, range(1))
                    _force(handle, UNEVEN)
                engine.load_checkpoint(path, tag="t")          # to the stock homes, then the stock files
                if handle is not None:
                    _force(handle, UNEVEN)
            homes = [handle.swapped_layers[m].schedule.homes for m in _moes(engine)] if handle is not None else None
            results[role] = {"experts": experts_by_id(engine, handle), "homes": homes,
                             "after": _train(engine, range(3, 5))}
            engine.destroy()
    dist.barrier()
    return results
