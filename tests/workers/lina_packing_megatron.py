"""Pool jobs for Lina's expert packing on Megatron-core (tests/test_lina_packing_megatron.py), on 4 ranks (2 nodes x
2) under the CPU shims: the model of tests/workers/lina_megatron.py (dense linears around two of the plugin's MoE
layers, built through Megatron's own spec builder while the plugin is enabled) in Megatron's DDP, stepped by
``get_megatron_optimizer``'s fp32 Adam, once with ``"lina": {}`` (packing 1) and once packed.

Every expert gets its own weights, drawn from (seed, layer, global id) (Megatron's CPU init gives every EP rank the
same experts, which would hide a misplaced one); experts are compared by global id (the layer's
``local_expert_indices``).
"""

from __future__ import annotations

import dataclasses
import zlib
from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_plugins.core.layout import ParallelLayout
from moe_plugins.patches.megatron_cpu import megatron_on_cpu, megatron_optimizer_on_cpu
from moe_plugins.tools.verify_megatron import transformer_config
from tests.workers.ckpt_reshard_megatron import cpu_saver
from tests.workers.hecate_reshard_megatron import whole_pieces
from tests.workers.lina_megatron import RANKS_PER_NODE, _batches, _ddp, _net, _spec


def _plugin(packing: Any, degree: Any = 1, **extra: Any) -> Dict[str, Any]:
    return {"schedule": "baseline", "pipeline_degree": degree, "lina": {"packing": packing, "micro_op_mb": 0.001},
            **extra}


@contextmanager
def _on_cpu(spec: Any) -> Iterator[Any]:
    """Megatron under the CPU shims, on the spec's layout groups (yielded)."""
    from moe_plugins.patches import megatron as mp
    with megatron_on_cpu(), mp.megatron_groups(ParallelLayout(world=spec.world, ranks_per_node=RANKS_PER_NODE,
                                                              mp=spec.mp, ep=spec.ep, esp=spec.esp)) as groups:
        yield groups


def _shard(layer: Any) -> str:
    """The expert-TP shard a rank holds of the layer's experts ("" at expert-TP 1), part of an expert's key."""
    group = layer.experts.tp_group
    return f".etp{group.rank()}" if group.size() > 1 else ""


def _redraw(net: Any, seed: int) -> None:
    with torch.no_grad():
        for n, layer in enumerate(net.moe):
            for i, expert in zip(layer.local_expert_indices, layer.experts.local_experts):
                for name, p in expert.named_parameters():
                    key = f"{n}.{i}.{name}{_shard(layer)}"
                    gen = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(key.encode()))
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))


def by_expert(net: Any, opt: Any = None, grads: bool = False) -> Dict[str, torch.Tensor]:
    """Every expert's parameters (with ``grads`` their ``main_grad``, with ``opt`` Adam's moments and in bf16 the
    fp32 masters; under the distributed optimizer both made whole from the ranks' pieces, collective) by layer,
    global id and name."""
    states: Dict[Any, Any] = {}
    for chained in getattr(opt, "chained_optimizers", [opt] if opt is not None else []):
        states.update(chained.optimizer.state)
    out = {}
    for n, layer in enumerate(net.moe):
        whole = whole_pieces(opt, layer) if opt is not None else {}
        for i, expert in zip(layer.local_expert_indices, layer.experts.local_experts):
            for name, p in expert.named_parameters():
                key = f"{n}.{i}.{name}{_shard(layer)}"
                out[key] = p.detach().clone()
                if grads:
                    out[f"{key}.main_grad"] = p.main_grad.clone()
                if id(p) in whole:                       # the distributed optimizer's pieces, whole
                    out.update((f"{key}.{k}", v) for k, v in whole[id(p)].items())
                    continue
                main = getattr(p, "main_param", None)       # bf16: the fp32 master, keying Adam's state
                if main is not None:
                    out[f"{key}.main_param"] = main.detach().clone()
                for k, v in states.get(main if main is not None else p, {}).items():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        out[f"{key}.{k}"] = v.clone()
    return out


def _half(bf16: Any) -> Dict[str, Any]:
    """The TransformerConfig settings of ``bf16``: True for bf16 parameters, ``"fp16"`` for fp16 ones."""
    return {"fp16": True, "params_dtype": torch.float16} if bf16 == "fp16" else \
        {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}


def _optimizer(model: Any, pgc: Any, clip: float, bf16: Any = False, distributed: bool = False) -> Any:
    """Megatron's Adam: fp32 (``FP32Optimizer``), or with ``bf16`` its mixed-precision optimizer (fp32 masters;
    ``"fp16"``: fp16 parameters under a constant loss scale of 1024); ``distributed``: its distributed optimizer."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    half = _half(bf16)
    dtype = half.get("params_dtype", torch.float32)
    with megatron_optimizer_on_cpu():
        return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=dtype,
                                                      bf16="bf16" in half, fp16="fp16" in half,
                                                      loss_scale=1024.0 if "fp16" in half else None,
                                                      clip_grad=clip, use_distributed_optimizer=distributed),
                                      [model], use_gloo_process_groups=False, pg_collection=pgc)


def _step(model: Any, opt: Any, pgc: Any, x: torch.Tensor, t: torch.Tensor) -> Dict[str, float]:
    from megatron.core.distributed import finalize_model_grads
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = F.mse_loss(model(x), t)
    loss.backward()
    finalize_model_grads([model], pg_collection=pgc)
    with megatron_optimizer_on_cpu():
        opt.prepare_grads()
        norm = opt.get_grad_norm()            # what clipping would scale by (clipping itself asserts CUDA grads)
        ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError("Megatron's optimizer skipped a step")
    return {"loss": float(loss.detach()), "norm": float(norm)}


def train_job(packing: Any, steps: int = 20, ep: int = 4, degree: int = 1, lancet: bool = False,
              bf16: bool = False, distributed: bool = False, tp: int = 1, etp: int = 1) -> Dict[str, Any]:
    """``steps`` fp32 Adam steps (``bf16``: bf16 parameters, Megatron's mixed-precision Adam; ``distributed``: its
    distributed optimizer; with either, what ``stock_homes`` gave or its refusal, and the experts after it) of the
    model with packing 1,
    then with ``packing``: per step loss and Megatron's
    gradient norm (what ``clip_grad`` scales by; clipping itself asserts CUDA gradients, so it is off), experts (values, last main_grad, Adam moments) by global id,
    how many experts each rank holds after, the controller's decisions, and the packed model's sharded
    checkpoint keys' global expert count. ``etp``: expert-TP (each expert's hidden dim sharded over it)."""
    from moe_plugins.patches import megatron as mp
    spec = dataclasses.replace(_spec(tp, ep, "float32"), esp=etp)
    out: Dict[str, Any] = {}
    with _on_cpu(spec) as groups:
        pgc = groups.pg_collection
        extra = _half(bf16)
        if tp > 1:                  # refused with packing: Megatron sums expert biases over TP peers (see the patch)
            extra["add_bias_linear"] = False
        config = transformer_config(spec, num_layers=2, **extra)
        data = (_batches(config.params_dtype, 4, seed=21) * steps)[:steps]
        for name, p in (("stock", 1), ("packed", packing)):
            extra = {"lancet": {"defer_wgrad": True}} if lancet else {}
            with mp.enable(_plugin(p, degree, **extra), groups=groups) as handle:
                net = _net(config, seed=7)
                _redraw(net, seed=3)
                model = _ddp(config, net, pgc, bucket_size=300, use_distributed_optimizer=distributed)
                opt = _optimizer(model, pgc, 0.0, bf16, distributed)
                runs = [_step(model, opt, pgc, x, t) for x, t in data]
                res = out[name] = {"losses": [r["loss"] for r in runs], "norms": [r["norm"] for r in runs],
                                   "experts": by_expert(net, opt, grads=True),
                                   "local": [layer.num_local_experts for layer in net.moe]}
                if lancet:                    # Lancet's dW ran behind exchanges of the packed layout too
                    res["overlap_calls"] = sum(o.calls for o in handle.lancet.overlaps)
                if handle.lina.packing is not None:
                    packer = handle.lina.packing.packers[0]
                    res.update(packing=packer.controller.packing, regroups=packer.regroups,
                               decisions=[(s, a, b) for s, _, a, b in packer.controller.decisions],
                               global_experts=_sharded_experts(net.moe[0], pgc))
                    if bf16 or distributed:
                        try:              # (under the distributed optimizer a regroup rebuilds it: the CPU shim)
                            with megatron_optimizer_on_cpu(), handle.lina.packing.stock_homes():
                                res["stock_local"] = [layer.num_local_experts for layer in net.moe]
                                res["stock_experts"] = by_expert(net, opt, grads=True)
                        except ValueError as exc:
                            res["stock_homes_error"] = str(exc)
                        res["local_after"] = [layer.num_local_experts for layer in net.moe]
                        res["experts_after"] = by_expert(net, opt, grads=True)
    return out


def grads_job(packings: List[int], accumulate: int = 2) -> Dict[str, Any]:
    """fp64: one step of ``accumulate`` micro-batches (``no_sync`` on all but the last) through Megatron's DDP at
    each packing: the model's output on the first micro-batch, every expert's ``main_grad`` by global id and the
    dense ``main_grad``s, per packing."""
    from contextlib import nullcontext

    from moe_plugins.patches import megatron as mp
    spec = _spec(1, 4, "float64")
    out: Dict[str, Any] = {}
    with _on_cpu(spec) as groups:
        pgc, config = groups.pg_collection, transformer_config(spec, num_layers=2)
        data = _batches(torch.float64, accumulate, seed=31)
        for packing in packings:
            with mp.enable(_plugin(packing), groups=groups):
                net = _net(config, seed=7)
                _redraw(net, seed=3)
                model = _ddp(config, net, pgc, bucket_size=300)
                model.zero_grad_buffer()
                for mb, (x, t) in enumerate(data):
                    with model.no_sync() if mb < accumulate - 1 else nullcontext():
                        y = model(x)
                        if mb == 0:
                            first = y.detach().clone()
                        F.mse_loss(y, t).backward()
                model.finish_grad_sync()
                grads = {k: v for k, v in by_expert(net, grads=True).items() if k.endswith("main_grad")}
                dense = {n: p.main_grad.clone() for n, p in net.named_parameters() if getattr(p, "allreduce", True)}
                out[str(packing)] = {"out": first, "experts": grads, "dense": dense,
                                     "local": net.moe[0].num_local_experts}
    return out


def _sharded_experts(layer: Any, pgc: Any) -> List[int]:
    """The global expert indices Megatron's own ``sharded_state_dict`` gives this rank's experts."""
    found = set()
    for key, sh in layer.experts.sharded_state_dict(prefix="e.", metadata={"dp_cp_group": pgc.dp_cp}).items():
        if key.endswith("linear_fc1.weight"):
            found.add(sh.global_offset[0])
    return sorted(found)


def checkpoint_job(ckpt_dir: str, saver: Any, loader: Any, steps: int = 3) -> Dict[str, Any]:
    """A model at packing ``saver`` trained ``steps`` steps and written through ``dist_checkpointing.save`` (its
    model sharded state dict), read into a fresh model at packing ``loader`` (other weights) through
    ``dist_checkpointing.load``. Both models' outputs on a probe batch, and their experts by global id; and a
    per-rank ``state_dict()`` written inside ``stock_homes()`` loads into a stock model with the same outputs."""
    from megatron.core import dist_checkpointing

    from moe_plugins.patches import megatron as mp
    spec = _spec(1, 4, "float32")
    out: Dict[str, Any] = {}
    with _on_cpu(spec) as groups:
        pgc, config = groups.pg_collection, transformer_config(spec, num_layers=2)
        probe = _batches(torch.float32, 1, seed=99)[0][0]
        metadata = {"dp_cp_group": pgc.dp_cp}
        for role, packing, seed in (("saver", saver, 7), ("loader", loader, 8)):
            with mp.enable(_plugin(packing), groups=groups) as handle:
                net = _net(config, seed=seed)
                _redraw(net, seed=seed)
                model = _ddp(config, net, pgc, bucket_size=300)
                opt = _optimizer(model, pgc, 0.0)
                res = out[role] = {}
                if role == "saver":
                    for x, t in _batches(torch.float32, steps, seed=5):
                        _step(model, opt, pgc, x, t)
                    with cpu_saver():
                        dist_checkpointing.save(_moe_sharded(net, metadata), ckpt_dir)
                    dist.barrier()
                    dense = {k: v.clone() for k, v in net.dense.state_dict().items()}
                    packed = handle.lina.packing
                    with packed.stock_homes() if packed is not None else ExitStack():
                        res["state"] = {k: v.clone() for k, v in net.state_dict().items() if torch.is_tensor(v)}
                else:
                    state = dist_checkpointing.load(_moe_sharded(net, metadata), ckpt_dir)
                    net.load_state_dict({**state, **{f"dense.{k}": v for k, v in dense.items()}})
                with torch.no_grad():
                    res["out"] = net(probe).clone()
                res.update(experts=by_expert(net), local=net.moe[0].num_local_experts)
        with mp.enable(_plugin(1), groups=groups):
            stock = _net(config, seed=9)
            stock.load_state_dict(out["saver"].pop("state"))
            with torch.no_grad():
                out["stock_files_out"] = stock(probe).clone()
    return out


def _moe_sharded(net: Any, metadata: Dict[str, Any]) -> Dict[str, Any]:
    """The MoE layers' sharded state dict (Megatron's own, by global expert id; the dense linears are plain torch
    modules without one: the job carries them over itself)."""
    out: Dict[str, Any] = {}
    for n, layer in enumerate(net.moe):
        out.update(layer.sharded_state_dict(prefix=f"moe.{n}.", metadata=metadata))
    return out


def _steps_from_groups(opt: Any) -> None:
    """Adam's ``step`` of every parameter from its group's, as Megatron's ``dp_reshardable`` load leaves it: that
    format keeps the step in the param groups (TE's FusedAdam reads it there), while torch's Adam (CPU) counts it
    per parameter, which the load leaves as the loader's own (stock Megatron, stock to stock too: the second
    resumed step then parts by 2%)."""
    for chained in opt.chained_optimizers:
        for group in chained.optimizer.param_groups:
            for p in group["params"] if "step" in group else []:
                state = chained.optimizer.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"].fill_(group["step"])


def optimizer_checkpoint_job(ckpt_dir: str, saver: Any, loader: Any, homes: bool, steps: int = 12) -> Dict[str, Any]:
    """Under Megatron's distributed optimizer: a model at packing ``saver`` trained ``steps`` steps ("auto" regroups
    at step 10) writes its model and optimizer sharded state (the distributed optimizer's ``dp_reshardable``
    format, keyed by its buffers' layout) through ``dist_checkpointing.save``; a fresh model at packing ``loader``
    (other weights, one step) reads both. With ``homes`` both do it inside ``stock_homes()`` (stock files), else as
    they stand (packed files, for the same packing). Experts by global id (values, whole moments) after the save
    and after the load, the packing at each, and the losses of 2 more steps from there."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from moe_plugins.patches import megatron as mp
    spec = _spec(1, 4, "float32")
    out: Dict[str, Any] = {}
    with _on_cpu(spec) as groups:
        pgc, config = groups.pg_collection, transformer_config(spec, num_layers=2)
        metadata = {"dp_cp_group": pgc.dp_cp, "distrib_optim_sharding_type": "dp_reshardable"}
        data = (_batches(torch.float32, 4, seed=21) * (steps + 2))[:steps + 2]
        for role, packing, seed in (("saver", saver, 7), ("loader", loader, 8)):
            with mp.enable(_plugin(packing), groups=groups) as handle:
                net = _net(config, seed=seed)
                _redraw(net, seed=seed)
                model = _ddp(config, net, pgc, bucket_size=300, use_distributed_optimizer=True)
                opt = _optimizer(model, pgc, 0.0, distributed=True)
                for x, t in data[:steps if role == "saver" else 1]:
                    _step(model, opt, pgc, x, t)
                packed = handle.lina.packing
                res = out[role] = {"packing": packed.packers[0].controller.packing if packed is not None else 1}
                with ExitStack() as around:        # (a regroup rebuilds the distributed optimizer: the CPU shim)
                    if homes and packed is not None:
                        around.enter_context(megatron_optimizer_on_cpu())
                        around.enter_context(packed.stock_homes())
                    model_sd = _moe_sharded(net, metadata)
                    for name, param in net.dense.named_parameters():      # replicated on every rank: rank 0 writes
                        model_sd[f"dense.{name}"] = ShardedTensor.from_rank_offsets(
                            f"dense.{name}", param, replica_id=(0, 0, dist.get_rank()))
                    loading = role == "loader"
                    sharded = {"model": model_sd,
                               "optimizer": opt.sharded_state_dict(model_sd, is_loading=loading, metadata=metadata)}
                    if not loading:
                        with cpu_saver():
                            dist_checkpointing.save(sharded, ckpt_dir)
                        dist.barrier()
                    else:
                        state = dist_checkpointing.load(sharded, ckpt_dir)
                        net.load_state_dict(state["model"], strict=False)
                        with torch.no_grad():       # fp32: Megatron copies into views of the parameters
                            opt.load_state_dict(state["optimizer"])
                        _steps_from_groups(opt)
                res["experts"] = by_expert(net, opt)
                res["after"] = [_step(model, opt, pgc, x, t)["loss"] for x, t in data[steps:]]
    return out


def refused_job(case: str) -> Optional[str]:
    """The error of one refused setting: a plugin section (``enable``) or a model (Megatron's DDP)."""
    from moe_plugins.patches import megatron as mp
    sections = {"schedule": _plugin(2, schedule="parm-s1"), "degree": _plugin(2, "auto"),
                "divide": _plugin(3), "tp": _plugin(2)}
    tp = 2 if case == "tp" else 1
    spec = _spec(tp, 2 if tp == 2 else 4, "float32")
    with _on_cpu(spec) as groups:
        config = transformer_config(spec, num_layers=2)
        try:
            with mp.enable(sections[case], groups=groups):
                _ddp(config, _net(config, seed=1), groups.pg_collection, bucket_size=300)
        except ValueError as exc:
            return str(exc)
    return None


def regroup_by_hand(bf16: bool, steps: int = 2) -> Dict[str, Any]:
    """Under Megatron's distributed optimizer with ``"auto"``: ``steps`` steps, then a regroup to packing 2 by hand
    (``set_packing``, outside the step): every expert's values and whole master (bf16) and moments by global id
    before and after it, and the losses of 2 more steps."""
    from moe_plugins.patches import megatron as mp
    spec = _spec(1, 4, "float32")
    with _on_cpu(spec) as groups:
        pgc = groups.pg_collection
        config = transformer_config(spec, num_layers=2, **_half(bf16))
        data = _batches(config.params_dtype, 4, seed=21)
        with mp.enable(_plugin("auto", 1), groups=groups) as handle:
            net = _net(config, seed=7)
            _redraw(net, seed=3)
            model = _ddp(config, net, pgc, bucket_size=300, use_distributed_optimizer=True)
            opt = _optimizer(model, pgc, 0.0, bf16, True)
            for x, t in data[:steps]:
                _step(model, opt, pgc, x, t)
            before = by_expert(net, opt)
            with megatron_optimizer_on_cpu():                   # as around the step (where "auto" regroups)
                handle.lina.packing.packers[0].controller.set_packing(2)
            after = by_expert(net, opt)
            losses = [_step(model, opt, pgc, x, t)["loss"] for x, t in data[steps:steps + 2]]
            return {"before": before, "after": after, "losses": losses,
                    "local": [layer.num_local_experts for layer in net.moe]}
