"""Pool jobs for Hecate's pooled slots on Megatron-core (``"hecate": {"reshard_every": n, "pool_slots": true}``,
tests/test_hecate_pool_megatron.py), on 4 ranks (2 nodes x 2, TP 1, EP 4) under the CPU shims: two MoE layers
(stock Megatron's ``MoELayer``s, and the plugin's built from Megatron's own spec builder while enabled) after a
dense scale, in Megatron's DistributedDataParallel, stepped by ``get_megatron_optimizer``'s fp32 Adam. Four
experts per layer: one per layer and rank, two slots per rank. Each layer's experts have their own weights
(:func:`~tests.workers.hecate_reshard_megatron.build_stock`, seeds 1 and 2) and its gate leans to experts 0 and 1.

Shapes: S tokens per rank ([S, 1, M], Megatron's layout), M model dim.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_plugins.tools.verify_megatron import transformer_config
from tests.workers.hecate_reshard_megatron import build_plugin, build_stock, config_of, data, on_cpu, spec

UNEVEN = ((0, 0, 1, 1), (2, 2, 3, 3))      # rank 0 holds experts 0 and 1 of layer 0, none of layer 1 ...


def section(every: int) -> Dict[str, Any]:
    return {"ranks_per_node": 2, "hecate": {"enabled": True, "extra_experts": 1, "reshard_every": every,
                                            "pool_slots": True}}


def _net(config: Any, moes: List[Any]):
    from megatron.core.transformer.module import MegatronModule

    class Net(MegatronModule):
        """A replicated per-channel scale, then the MoE layers in turn (each one's output the next one's input)."""

        def __init__(self):
            super().__init__(config)
            self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
            self.moes = torch.nn.ModuleList(moes)

        def forward(self, x):
            y = x * self.scale
            for moe in self.moes:
                y = y + moe(y)[0]
            return y
    return Net()


def _train(config: Any, layers: List[Any], pgc: Any, steps: int, handle: Any, forced: bool) -> Dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, \
        finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), _net(config, layers), pg_collection=pgc)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=config.params_dtype,
                                                 bf16=config.bf16, clip_grad=0.0), [model],
                                 use_gloo_process_groups=False, pg_collection=pgc)
    losses: List[float] = []
    around: Dict[str, Any] = {}
    for i, (x, t) in enumerate(data(steps, config.params_dtype)):
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = F.mse_loss(model(x), t)
        loss.backward()
        finalize_model_grads([model], pg_collection=pgc)
        if not opt.step()[0]:
            raise RuntimeError("Megatron's optimizer skipped a step")
        losses.append(float(loss.detach()))
        if forced and handle is not None and i == 0:
            around["before"] = experts_by_id(model.module.moes, opt, handle)
            handle.hecate.reshard([list(h) for h in UNEVEN])
            around["after"] = experts_by_id(model.module.moes, opt, handle)
    return {"losses": losses, "opt": opt, "forced": around}


def experts_by_id(layers: List[Any], opt: Any, handle: Any) -> Dict[str, torch.Tensor]:
    """Every local expert's parameters, ``main_grad`` and Adam moments (in bf16 also its fp32 master, which keys
    the moments) keyed by (layer, global id, name), wherever the pool keeps them."""
    states = {}
    for chained in getattr(opt, "chained_optimizers", [opt]):
        states.update(chained.optimizer.state)
    rank, out = dist.get_rank(), {}
    for index, layer in enumerate(layers):
        schedule = getattr(layer.token_dispatcher, "schedule", None)
        homes = getattr(schedule, "homes", None)
        ids = [e for e, h in enumerate(homes) if h == rank] if homes is not None else [rank]
        pooled = handle.hecate.slots_of(layer) if handle is not None else None
        modules = pooled if pooled is not None else list(layer.experts.local_experts)
        for e, mlp in zip(ids, modules):
            for name, p in mlp.named_parameters():
                key = f"{index}.{e}.{name}"
                out[key] = p.detach().clone()
                out[f"{key}.main_grad"] = p.main_grad.clone()
                main = getattr(p, "main_param", None)
                if main is not None:
                    out[f"{key}.main_param"] = main.detach().clone()
                for k, v in states.get(main if main is not None else p, {}).items():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        out[f"{key}.{k}"] = v.clone()
    return out


def pooled_vs_stock(steps: int, every: int, forced: bool, bf16: bool = False) -> Dict[str, Any]:
    """``steps`` steps of two stock layers, then of the plugin's with pooled slots re-sharded every ``every`` steps
    (``forced``: moved to UNEVEN by hand after the first step, the experts by (layer, id) kept just before and
    after): losses, homes, how many experts of each layer this rank holds, experts by (layer, id); and, for the
    plugin, each layer's state dict written under ``stock_homes()`` (the stock layout) against stock's after the
    same steps. ``bf16``: bf16 parameters under Megatron's mixed-precision Adam."""
    from moe_plugins.patches import megatron as mp
    s = spec(1, 4)
    out: Dict[str, Any] = {}
    with on_cpu(s) as groups:
        pgc, config = groups.pg_collection, config_of(s, bf16, num_layers=2)
        stocks = [build_stock(s, config, groups, seed=seed) for seed in (1, 2)]
        for i, layer in enumerate(stocks):
            layer.set_layer_number(i + 1)
        initial = [{k: v.clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()}
                   for layer in stocks]
        for name in ("stock", "plugin"):
            with ExitStack() as run:
                handle = run.enter_context(mp.enable(section(every), groups=groups)) if name == "plugin" else None
                layers = [build_plugin(config, state) for state in initial] if handle is not None else stocks
                for i, layer in enumerate(layers):
                    layer.set_layer_number(i + 1)
                res = _train(config, layers, pgc, steps, handle, forced)
                out[name] = {"losses": res["losses"], "experts": experts_by_id(layers, res["opt"], handle),
                             "forced": res["forced"]}
                if handle is not None:
                    schedules = [layer.token_dispatcher.schedule for layer in layers]
                    out[name].update(homes=[s.homes for s in schedules], rounds=handle.hecate.resharders[0].rounds,
                                     held=[len(handle.hecate.slots_of(layer)) for layer in layers])
                    with handle.hecate.stock_homes():
                        out[name]["state"] = [_tensors(layer.state_dict()) for layer in layers]
                    out[name]["homes_after"] = [s.homes for s in schedules]
                else:
                    out[name]["state"] = [_tensors(layer.state_dict()) for layer in layers]
    return out


def _tensors(state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items() if torch.is_tensor(v)}


def _sharded(layers: List[Any], metadata: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for i, layer in enumerate(layers):
        out.update(layer.sharded_state_dict(prefix=f"moes.{i}.", metadata=metadata))
    return out


def checkpoint_to_stock(ckpt_dir: str, steps: int = 3) -> Dict[str, Any]:
    """The plugin's two pooled layers trained ``steps`` steps (moved to UNEVEN after the first) and saved through
    ``dist_checkpointing.save``; two fresh stock layers (other weights) load it through ``dist_checkpointing.load``.
    Experts by (layer, id) of the saver (read through the pool) before and after the save and of the loader, and
    the saver's homes after the save."""
    from megatron.core import dist_checkpointing

    from moe_plugins.patches import megatron as mp
    from tests.workers.ckpt_reshard_megatron import cpu_saver
    s = spec(1, 4)
    with on_cpu(s) as groups:
        pgc, config = groups.pg_collection, transformer_config(s, num_layers=2)
        metadata = {"dp_cp_group": pgc.dp_cp}
        with mp.enable(section(100), groups=groups) as handle:
            layers = [build_plugin(config, build_stock(s, config, groups, seed=seed).state_dict())
                      for seed in (1, 2)]
            for i, layer in enumerate(layers):
                layer.set_layer_number(i + 1)
            res = _train(config, layers, pgc, steps, handle, forced=True)
            before = experts_by_id(layers, res["opt"], handle)
            with cpu_saver():
                dist_checkpointing.save(_sharded(layers, metadata), ckpt_dir)
            dist.barrier()
            after = experts_by_id(layers, res["opt"], handle)
            homes = [layer.token_dispatcher.schedule.homes for layer in layers]
        loaders = [build_stock(s, config, groups, seed=seed) for seed in (3, 4)]
        for i, layer in enumerate(loaders):
            layer.set_layer_number(i + 1)
        state = dist_checkpointing.load(_sharded(loaders, metadata), ckpt_dir)
        for i, layer in enumerate(loaders):
            layer.load_state_dict({k[len(f"moes.{i}."):]: v for k, v in state.items() if k.startswith(f"moes.{i}.")})
        loaded = {}
        for i, layer in enumerate(loaders):
            for name, p in layer.experts.local_experts[0].named_parameters():
                loaded[f"{i}.{dist.get_rank()}.{name}"] = p.detach().clone()
    weights = {k: v for k, v in before.items() if k.count(".") == 3}      # (layer, id, module, param): the weights
    return {"before": weights, "after": {k: after[k] for k in weights}, "loaded": loaded, "homes": homes}


def two_optimizers_error() -> str:
    """Two pooled layers, each in its own DDP model stepped by its own optimizer: the error at the second
    optimizer's first step ("" when none)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, \
        finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from moe_plugins.patches import megatron as mp
    s = spec(1, 4)
    with on_cpu(s) as groups:
        pgc, config = groups.pg_collection, transformer_config(s, num_layers=2)
        with mp.enable(section(100), groups=groups):
            layers = [build_plugin(config, build_stock(s, config, groups, seed=seed).state_dict())
                      for seed in (1, 2)]
            x, t = data(1)[0]
            try:
                for i, layer in enumerate(layers):
                    layer.set_layer_number(i + 1)
                    model = DistributedDataParallel(config, DistributedDataParallelConfig(), _net(config, [layer]),
                                                    pg_collection=pgc)
                    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0,
                                                                 params_dtype=torch.float32), [model],
                                                 use_gloo_process_groups=False, pg_collection=pgc)
                    model.zero_grad_buffer()
                    F.mse_loss(model(x), t).backward()
                    finalize_model_grads([model], pg_collection=pgc)
                    opt.step()
            except ValueError as exc:
                return str(exc)
    return ""
