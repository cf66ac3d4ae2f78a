"""Pool jobs for Hecate's re-sharding on DeepSpeed (tests/test_hecate_reshard.py): tests/workers/deepspeed.py's
tiny MoE model trained through ``deepspeed.initialize`` with ``"hecate": {"reshard_every": n}`` and without the
plugin, and checkpoints written while the experts sit away from their stock owners."""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm
from tests.workers import deepspeed as jobs


def section(every: int, extra: Any = 1, degree: int = 1) -> Dict[str, Any]:
    return {"ranks_per_node": 2, "pipeline_degree": degree,
            "hecate": {"enabled": True, "extra_experts": extra, "reshard_every": every}}


def make_engine(stage: int, plugin: Optional[Dict[str, Any]], ep: int, k: int, seed: int,
                hot: Sequence[int] = (0, 1), skew: float = 1.5, half: Any = False):
    """jobs.make_engine's model, dropless, its gate leaning to the ``hot`` experts (0 and 1: both on node 0 at
    EP 4): their logits gain ``skew`` through the input layer's bias, whatever the token, so that the experts no
    copy serves crowd one node (or rank) and Algorithm 2 has something to move."""
    return jobs.make_engine(stage, plugin, ep, k, seed, prepare=partial(_lean, hot=hot, skew=skew), half=half)


def _lean(model: torch.nn.Module, hot: Sequence[int], skew: float) -> None:
    gate = model.moe.deepspeed_moe.gate
    gate.drop_tokens = False
    with torch.no_grad():
        bias = model.inp.bias
        gate.wg.weight[list(hot)] += skew * bias / bias.dot(bias)


def _layer(handle, engine):
    return handle.swapped_layers.get(engine.module.moe.deepspeed_moe) if handle is not None else None


def _train_tracking(engine, layer, seed: int, steps: range, forced: Optional[Any] = None,
                    dtype: torch.dtype = torch.float32, masters: bool = False) -> Dict[str, Any]:
    """jobs.train, one step at a time, with the homes after each step; ``forced`` (the engine's resharder, homes): moved
    there after the first step, whatever Algorithm 2 would plan (in bf16 the experts by global id with their fp32
    masters and moments are kept just before and after that move)."""
    losses, homes, around = [], [], {}
    for step in steps:
        losses += jobs.train(engine, seed, range(step, step + 1), dtype)
        if forced is not None and step == steps.start:
            if masters:
                around["before"] = by_expert(engine, layer.schedule.homes, masters=True)
            optimizer, extra = forced[0]._moving()          # what the engine's own re-shards move (ZeRO's state)
            forced[0].resharder.reshard(optimizer, [forced[1]], extra)
            if masters:
                around["after"] = by_expert(engine, layer.schedule.homes, masters=True)
        homes.append(layer.schedule.homes if layer is not None else None)
    return {"losses": losses, "homes": homes, "forced": around}


def by_expert(engine, homes, masters: bool = False) -> Dict[str, torch.Tensor]:
    """The experts' parameters keyed by global id (``homes``: the layer's homes; None: stock's); ``masters``: also
    their fp32 masters and Adam moments, read whole through DeepSpeed's ``safe_get_full_*`` (collective)."""
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state
    zero = engine.optimizer
    unfused = jobs.zero0_masters(zero) if masters else {}        # ZeRO 0's 16-bit optimizers
    if masters and not unfused:  # DeepSpeed links the parameters to their optimizer state fragments lazily
        from moe_plugins.patches.deepspeed_zero_state import layout      # ZeRO 1/2's names or BF16_Optimizer's
        for params, flat in zip(*layout(zero)[:2]):
            lazy_init_hp_params_optimizer_state(params, flat, zero.optimizer.state)
    moe = engine.module.moe
    rank = groups._get_expert_parallel_rank(moe.expert_group_name)
    ids = ([e for e, h in enumerate(homes) if h == rank] if homes is not None else
           [rank * moe.num_local_experts + i for i in range(moe.num_local_experts)])
    out = {}
    for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        for n, p in expert.named_parameters():
            out[f"{ids[i]}.{n}"] = p.detach().clone()
            if id(p) in unfused:          # ZeRO 0: the master (and moments) of each parameter
                out.update((f"{ids[i]}.{n}.{key}", v.clone()) for key, v in unfused[id(p)].items())
            elif masters:
                out[f"{ids[i]}.{n}.fp32"] = safe_get_full_fp32_param(p).clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    out[f"{ids[i]}.{n}.{key}"] = safe_get_full_optimizer_state(p, key).clone()
    return out


def train_vs_stock(stage: int, every: int, ep: int, k: int, seed: int, steps: int,
                   forced: Optional[Sequence[int]] = None, degree: int = 1, half: Any = False) -> Dict[str, Any]:
    """``steps`` steps of the stock engine, then of the plugin's with re-sharding every ``every`` steps (and,
    with ``forced``, a move to those homes after the first step): losses, homes, experts by global id (in
    ``half`` precision, jobs.HALF_DTYPES, with their fp32 masters and moments), the steps skipped (fp16)."""
    import moe_plugins
    init_deepspeed_comm()
    out: Dict[str, Any] = {}
    for name, plugin in (("off", None), ("on", section(every, degree=degree))):
        with ExitStack() as stack:
            stack.enter_context(deepspeed_groups(None))
            handle = stack.enter_context(moe_plugins.enable()) if plugin is not None else None
            engine = make_engine(stage, plugin, ep, k, seed, half=half)
            layer = _layer(handle, engine)
            force = (handle.hecate.resharders[0], tuple(forced)) if forced and handle else None
            out[name] = _train_tracking(engine, layer, seed, range(steps), force, jobs.HALF_DTYPES[half], bool(half))
            homes = layer.schedule.homes if layer is not None else None
            out[name]["experts"] = by_expert(engine, homes, masters=bool(half))
            out[name]["optimizer"] = type(engine.optimizer).__name__
            out[name]["offload"] = bool(engine.zero_cpu_offload())
            out[name]["skipped"] = engine.skipped_steps
            out[name]["dtype"] = next(engine.module.parameters()).dtype
            if handle is not None:
                out[name]["moves"] = handle.hecate.resharders[0].resharder.rounds
                out[name]["stock"] = layer.schedule.stock_homes()
            engine.destroy()
        out[name]["wrapped_after"] = sorted(k for k in ("step", "save_checkpoint") if k in engine.__dict__)
    return out


def checkpoint_across(save_plugin: Optional[Dict[str, Any]], load_plugin: Optional[Dict[str, Any]], ep: int,
                      k: int, path: str, steps: int = 4, stage: int = 0, half: Any = False) -> Dict[str, Any]:
    """Train ``steps`` steps under ``save_plugin`` and save; go on 2 steps. A fresh engine (another seed) under
    ``load_plugin`` loads the checkpoint and runs the same 2 steps. The experts by global id after the save and
    after the load, and the homes at the save; ``half``: as jobs.make_engine's (``"offload"``: ZeRO-Offload)."""
    import moe_plugins
    init_deepspeed_comm()
    seed, results = 5, {}
    for role, plugin, init_seed in (("saver", save_plugin, seed), ("loader", load_plugin, seed + 100)):
        with ExitStack() as stack:
            stack.enter_context(deepspeed_groups(None))
            handle = stack.enter_context(moe_plugins.enable()) if plugin is not None else None
            engine = make_engine(stage, plugin, ep, k, init_seed, half=half)
            layer = _layer(handle, engine)
            if role == "saver":
                jobs.train(engine, seed, range(steps))
                engine.save_checkpoint(path, tag="t")
            else:
                if layer is not None:          # a loader away from its stock homes too: train once, re-shard
                    jobs.train(engine, init_seed, range(1))
                engine.load_checkpoint(path, tag="t")
            homes = layer.schedule.homes if layer is not None else None
            results[role] = {"homes": homes, "experts": by_expert(engine, homes),
                             "stock": layer.schedule.stock_homes() if layer is not None else None,
                             "after": jobs.train(engine, seed, range(steps, steps + 2))}
            engine.destroy()
    dist.barrier()
    return results


def homes_moved(homes: List[Any], stock: Any) -> bool:
    return any(h != stock for h in homes)


def round_trip(results: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """For a checkpoint job's per-rank results (a "saver" and a "loader", each with its experts by id and its
    losses after the save): check that every rank's resumed losses equal the saver's (1e-5) and that the loader
    holds the saver's experts bitwise; the saver's experts by id."""
    saved, loaded = {}, {}
    for res in results:
        saved.update(res["saver"]["experts"])
        loaded.update(res["loader"]["experts"])
        rel = max(abs(a - b) / abs(a) for a, b in zip(res["saver"]["after"], res["loader"]["after"]))
        assert rel <= 1e-5, (res["saver"]["after"], res["loader"]["after"])          # the resumed run's losses
    assert set(saved) == set(loaded) and all(torch.equal(saved[n], loaded[n]) for n in saved)
    return saved
