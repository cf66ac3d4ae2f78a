"""Pool jobs for Lina's expert packing on DeepSpeed (tests/test_lina_packing_deepspeed.py): tests/workers/deepspeed.py's
tiny MoE model (4 experts) at ZeRO 0 trained through ``deepspeed.initialize`` with ``"lina": {"packing": p}`` and
without the plugin, and checkpoints written by one and read by the other."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from moe_plugins.core.ledger import CommLedger
from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm
from tests.workers import deepspeed as jobs


def section(packing: Union[int, str], **extra: Any) -> Dict[str, Any]:
    return {"ranks_per_node": 2, "lina": {"packing": packing, "micro_op_mb": 0.25}, **extra}


def by_expert(engine) -> Dict[str, torch.Tensor]:
    """The experts' parameters and their Adam moments keyed by global id, on whatever layout the layer is (at ZeRO
    1/2 the moments gathered whole from ZeRO's partitions: collective; in bf16 at ZeRO 0 the fp32 master of
    DeepSpeed's FP16_UnfusedOptimizer and its moments, as ``fp32`` and by key)."""
    from deepspeed.utils import groups

    from moe_plugins.patches.deepspeed_zero_state import snapshot
    moe = engine.module.moe
    rank = groups._get_expert_parallel_rank(moe.expert_group_name)
    zero = snapshot(engine.optimizer).values if engine.zero_optimization_stage() else None
    if zero is None:                                          # FP16_UnfusedOptimizer: a master per parameter
        zero = jobs.zero0_masters(engine.optimizer) or None
    out = {}
    for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        for n, p in expert.named_parameters():
            out[f"{rank * moe.num_local_experts + i}.{n}"] = p.detach().clone()
            state = engine.optimizer.state.get(p, {}) if zero is None else zero[id(p)]
            for key, v in sorted(state.items()):
                if torch.is_tensor(v) and v.shape == p.shape and (key != "fp32" or p.dtype != torch.float32):
                    out[f"{rank * moe.num_local_experts + i}.{n}.{key}"] = v.clone()
    return out


def _packer(handle, engine):
    if handle is None:
        return None
    return next(s.packer for s in handle.lina.engines if s.ds_engine is engine)


def _loss_scale(opt: Any) -> Optional[float]:
    """The loss scale of DeepSpeed's optimizer ``opt`` (ZeRO's ``cur_scale``, FP16_UnfusedOptimizer's
    ``loss_scale_config``), None for a torch optimizer."""
    config = getattr(opt, "loss_scale_config", None)
    scale = config.cur_scale if config is not None else getattr(opt, "cur_scale", None)
    return None if scale is None else float(scale)


def train_vs_stock(packing: Union[int, str], ep: int, k: int, seed: int, steps: int, stage: int = 0,
                   gas: int = 1, degree: int = 1, lancet: Optional[Dict[str, Any]] = None,
                   half: Any = False) -> Dict[str, Any]:
    """``steps`` micro-batches of the stock engine, then of the plugin's with ``packing`` (ZeRO ``stage``,
    ``gas`` micro-batches per optimizer step): losses, the packing after every one, the controller's decisions,
    the experts by global id, and what the engine holds after ``destroy`` (``degree``: PipeMoE's; ``lancet``: a
    Lancet section beside it; ``half``: DeepSpeed's bf16 or fp16 (jobs.HALF_DTYPES), the fp32 masters among the
    experts' keys, and in fp16 the steps skipped and the loss scale after each step)."""
    import moe_plugins
    init_deepspeed_comm()
    out: Dict[str, Any] = {}
    extra = {"lancet": lancet} if lancet is not None else {}
    for name, plugin in (("off", None), ("on", section(packing, pipeline_degree=degree, **extra))):
        with ExitStack() as stack:
            stack.enter_context(deepspeed_groups(None))
            handle = stack.enter_context(moe_plugins.enable(ledger=CommLedger())) if plugin is not None else None
            engine = jobs.make_engine(stage, plugin, ep, k, seed, gas=gas, half=half)
            packer = _packer(handle, engine)
            losses, packings, scales = [], [], []
            for step in range(steps):
                losses += jobs.train(engine, seed, range(step, step + 1), jobs.HALF_DTYPES[half])
                packings.append(packer.controller.packing if packer is not None else 1)
                scales.append(_loss_scale(engine.optimizer))
            res: Dict[str, Any] = {"losses": losses, "packings": packings, "experts": by_expert(engine),
                                   "skipped": engine.skipped_steps, "scales": scales,
                                   "offload": bool(engine.zero_cpu_offload()),
                                   "predivide": engine.gradient_predivide_factor()}
            if packer is not None:
                ctl = packer.controller
                res["decisions"] = [(s, t.expert_mean_s, t.a2a_mean_s, a, b) for s, t, a, b in ctl.decisions]
                res["local_experts"] = len(engine.module.moe.deepspeed_moe.experts.deepspeed_experts)
                res["optimizer_params"] = sum(len(g["params"]) for g in engine.optimizer.param_groups)
                res["group_names"] = sorted({p.group_name for p in engine.module.parameters()
                                             if hasattr(p, "group_name")})
                res["regroups"] = [f"{r.phase}:{r.op}@{r.group}" for r in handle.ledger.records if r.phase == "regroup"]
                swapped = handle.swapped_layers[engine.module.moe.deepspeed_moe]
                res["lane"] = (getattr(swapped.lane, "degree", 1), swapped.schedule.rec.engine is packer.reducer.engine,
                               swapped.groups.layout.ep)
                res["lancet_runs"] = sum(o.calls for o in handle.lancet.overlaps)
                if jobs.HALF_DTYPES[half] != torch.float32:   # unpacked, packed again: the masters carried whole
                    with ctl.unpacked():
                        res["unpacked_experts"] = by_expert(engine)
                    res["experts_after"] = by_expert(engine)
            engine.destroy()
            res["wrapped_after"] = sorted(n for n in ("step", "save_checkpoint", "_configure_optimizer")
                                          if n in engine.__dict__)
            out[name] = res
    return out


def checkpoint_across(save: Optional[Dict[str, Any]], load: Optional[Dict[str, Any]], ep: int, path: str,
                      steps: int = 4, via_tool: bool = False, stage: int = 0) -> Dict[str, Any]:
    """Train ``steps`` steps under ``save`` (a section or None: stock) and save; go on 2 steps. A fresh engine
    (another seed) under ``load`` loads the checkpoint (``via_tool``: through the recipes' resume,
    patches/deepspeed_reshard.load_checkpoint) and runs the same 2 steps. The experts by global id (with their Adam
    moments) after the save and after the load, and the two runs' last losses."""
    from moe_plugins.patches import deepspeed_reshard
    import moe_plugins
    init_deepspeed_comm()
    seed, results = 5, {}
    for role, plugin, init_seed in (("saver", save, seed), ("loader", load, seed + 100)):
        with ExitStack() as stack:
            stack.enter_context(deepspeed_groups(None))
            handle = stack.enter_context(moe_plugins.enable()) if plugin is not None else None
            engine = jobs.make_engine(stage, plugin, ep, 1, init_seed)
            if role == "saver":
                jobs.train(engine, seed, range(steps))
                engine.save_checkpoint(path, tag="t")
            else:
                jobs.train(engine, init_seed, range(1))      # optimizer state of its own, overwritten by the load
                if via_tool:
                    deepspeed_reshard.load_checkpoint(engine, path, "t")
                else:
                    engine.load_checkpoint(path, tag="t")
            packer = _packer(handle, engine)
            results[role] = {"experts": by_expert(engine), "after": jobs.train(engine, seed, range(steps, steps + 2)),
                             "packing": packer.controller.packing if packer is not None else 1}
            engine.destroy()
    dist.barrier()
    return results


def refused(plugin: Dict[str, Any], stage: int = 0, ep: int = 4) -> Dict[str, Any]:
    """``deepspeed.initialize`` under ``plugin``: its error (None: none), and whether DeepSpeed's group registry
    and the expert modules are as before."""
    import moe_plugins
    from deepspeed.utils import groups
    init_deepspeed_comm()
    error = None
    with deepspeed_groups(None), moe_plugins.enable():
        registry = dict(groups._EXPERT_PARALLEL_GROUP)
        try:
            engine = jobs.make_engine(stage, plugin, ep, 1, 0)
            engine.destroy()
        except ValueError as exc:
            error = str(exc)
        extra = sorted(set(groups._EXPERT_PARALLEL_GROUP) - set(registry) - {f"ep_size_{ep}"})
    return {"error": error, "extra_groups": extra}


def local_counts(results: List[Dict[str, Any]]) -> List[int]:
    return [r["on"]["local_experts"] for r in results]
