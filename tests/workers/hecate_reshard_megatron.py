"""Pool jobs for Hecate's re-sharding on Megatron-core (tests/test_hecate_reshard_megatron.py), on 4 ranks (2 nodes x
2) under the CPU shims: stock Megatron's ``MoELayer`` and the plugin's layer, built while the plugin is enabled with
``"hecate": {"reshard_every": n}`` (Megatron's own spec builder, replaced), each behind a dense scale in
Megatron's DistributedDataParallel and stepped by ``get_megatron_optimizer``'s Adam: fp32, or with ``bf16`` its
mixed-precision optimizer (bf16 parameters, fp32 masters).

Every expert gets its own weights (drawn from its global id, :func:`redraw`: Megatron's CPU init gives every EP
rank the same experts, which would hide a misplaced one), and the gate leans to the ``hot`` experts: the tokens
carry a constant direction ``u`` and the hot experts' router rows gain ``skew * u``, so that Algorithm 2 has
experts to move. Experts are compared by global id (slot i of EP rank r holds the i-th of ``local_experts(homes,
r)``).

Shapes: S tokens per rank ([S, 1, M], Megatron's layout), M model dim, E experts.
"""

from __future__ import annotations

import itertools
from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_plugins.hecate.reshard import local_experts
from moe_plugins.patches.megatron_cpu import megatron_on_cpu
from moe_plugins.tools.verify_megatron import MegatronVerifySpec, transformer_config
from tests.megatron_shims_extra import cuda_factories_on_cpu
from tests.workers import megatron as jobs
from tests.workers.ckpt_reshard_megatron import cpu_saver, redraw

RPN, S, M, H, E = 2, 8, 8, 16, 4
HOT, SKEW = (0, 1), 3.0


def section(every: int, extra: int = 1) -> Dict[str, Any]:
    return {"ranks_per_node": RPN, "hecate": {"enabled": True, "extra_experts": extra, "reshard_every": every}}


def config_of(s: MegatronVerifySpec, bf16: Any = False, **more: Any):
    """The layer's TransformerConfig; at TP > 1 without biases (Megatron sums the experts' fc2 bias gradients over
    the TP group, slot by slot: re-sharding refuses that, patches/megatron_config.py); ``bf16``: bf16 parameters
    (``"fp16"``: fp16 ones, under a constant loss scale)."""
    extra: Dict[str, Any] = {"fp16": True, "params_dtype": torch.float16} if bf16 == "fp16" else \
        {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    return transformer_config(s, **({"add_bias_linear": False} if s.mp > 1 else {}), **extra, **more)


def spec(tp: int, ep: int, k: int = 2, dtype: str = "float32") -> MegatronVerifySpec:
    return MegatronVerifySpec(world=dist.get_world_size(), ranks_per_node=RPN, mp=tp, ep=ep, esp=1, experts=E, k=k,
                              drop=False, tokens=S, hidden=M, ffn=H, dtype=dtype, schedule="hecate",
                              exchange="ragged")


def _direction() -> torch.Tensor:
    u = torch.randn(M, generator=torch.Generator().manual_seed(11))
    return u / u.norm()


def data(steps: int, dtype: torch.dtype = torch.float32) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(x, target) per step: tokens with the constant direction u, a learnable target; distinct per rank."""
    teacher = torch.randn(M, M, generator=torch.Generator().manual_seed(3)) / M ** 0.5
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    xs = [torch.randn(S, 1, M, generator=gen) + 2.0 * _direction() for _ in range(4)]
    return [(x.to(dtype), torch.tanh(x @ teacher).to(dtype)) for x in (xs * steps)[:steps]]


@contextmanager
def on_cpu(s: MegatronVerifySpec) -> Iterator[Any]:
    """Megatron under the CPU shims, on the spec's layout groups (yielded)."""
    with megatron_on_cpu(), cuda_factories_on_cpu(), jobs._groups(s) as groups:
        yield groups


def build_stock(s: MegatronVerifySpec, config: Any, groups: Any, seed: int):
    """Megatron's stock layer, every expert drawn from (seed, global id), the gate leaning to HOT."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as stock_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_plugins.patches.megatron_specs import spec_submodules
    layer = MoELayer(config, submodules=spec_submodules(stock_spec(use_te=False, num_experts=E)),
                     pg_collection=groups.pg_collection)
    layer.set_layer_number(1)
    redraw(layer, groups.pg_collection, seed)
    with torch.no_grad():
        layer.router.weight[list(HOT)] += SKEW * _direction().to(layer.router.weight.dtype)
    return layer


def build_plugin(config: Any, state: Dict[str, torch.Tensor]):
    """The plugin's layer from Megatron's own spec builder (the enabled plugin replaces it), holding ``state``."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from moe_plugins.patches.megatron_specs import build_layer
    layer = build_layer(get_moe_module_spec(use_te=False, num_experts=E), config)
    layer.load_state_dict(state)
    layer.set_layer_number(1)
    return layer


def ddp_and_optimizer(config: Any, moe: Any, pgc: Any, distributed: bool = False, net: Any = None,
                      small_buckets: bool = True):
    """Megatron's DDP over a dense scale and ``moe``, and its Adam (``distributed``: its distributed optimizer, with
    buckets of about 1.5 experts (of 4 at M 8, H 16), so that at expert-DP 2 a rank steps parts of the two slots'
    parameters that differ, some split between the ranks)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    net = jobs._net(config, moe) if net is None else net
    net.scale.data = net.scale.data.to(config.params_dtype)      # bf16: the dense parameter in bf16 too
    buckets = {"bucket_size": 500, "overlap_grad_reduce": True} if distributed and small_buckets else {}
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=distributed,
                                                                          **buckets), net, pg_collection=pgc)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=config.params_dtype,
                                                 bf16=config.bf16, fp16=config.fp16, clip_grad=0.0,
                                                 loss_scale=1024.0 if config.fp16 else None,
                                                 use_distributed_optimizer=distributed), [model],
                                 use_gloo_process_groups=False, pg_collection=pgc)
    return model, opt


def step(model, opt, pgc, x: torch.Tensor, t: torch.Tensor) -> float:
    from megatron.core.distributed import finalize_model_grads
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = F.mse_loss(model(x), t)
    loss.backward()
    finalize_model_grads([model], pg_collection=pgc)
    ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError("Megatron's optimizer skipped a step")
    return float(loss.detach())


def homes_of(layer: Any) -> Optional[Tuple[int, ...]]:
    schedule = getattr(getattr(layer, "token_dispatcher", None), "schedule", None)
    return getattr(schedule, "homes", None)


def _stepped(opt: Any) -> Dict[int, torch.Tensor]:
    """Expert parameter id -> the tensor Megatron's optimizer steps in its place, where not the parameter: the fp32
    master (bf16), or the distributed optimizer's flat shard of an fp32 parameter."""
    out: Dict[int, torch.Tensor] = {}
    for chained in getattr(opt, "chained_optimizers", [opt] if opt is not None else []):
        for model_group, shard_group in zip(getattr(chained, "model_fp32_groups", []),
                                            getattr(chained, "shard_fp32_groups", [])):
            out.update((id(p), s) for p, s in zip(model_group, shard_group))
    return out


def whole_pieces(opt: Any, layer: Any) -> Dict[int, Dict[str, torch.Tensor]]:
    """Under Megatron's distributed optimizer: per expert parameter id, its fp32 master (``main_param``, bf16 only)
    and Adam moments whole, summed over its buffer's DP group from each rank's piece placed at its range in
    Megatron's ``gbuf_ranges`` (collective; zeros where no rank steps it). Empty otherwise."""
    found = [c for c in getattr(opt, "chained_optimizers", [opt] if opt is not None else [])
             if hasattr(c, "gbuf_ranges") and any(p in b.param_index_map for b in c.buffers
                                                  for p in layer.experts.parameters())]
    if not found:
        return {}
    chained, stepped = found[0], _stepped(opt)
    keys = sorted(k for s in list(chained.optimizer.state.values())[:1] for k, v in s.items()
                  if torch.is_tensor(v) and v.dim() > 0)
    out = {}
    for p in layer.experts.parameters():
        names = (["main_param"] if p.dtype != torch.float32 else []) + keys
        whole = torch.zeros(len(names), p.numel())
        where = chained.model_param_gbuf_map.get(p)
        if where is not None:
            span = chained.gbuf_ranges[where[0]][where[1]][where[2]]["param_map"][p]["param"]
            main = p.main_param if p.dtype != torch.float32 else stepped[id(p)]
            state = chained.optimizer.state[main]
            parts = ([main] if p.dtype != torch.float32 else []) + [state[k] for k in keys]
            for row, part in zip(whole, parts):
                row[span.start:span.end] = part
        group = next(b.data_parallel_group for b in chained.buffers if p in b.param_index_map)
        dist.all_reduce(whole, group=group)
        out[id(p)] = {name: row.view(p.shape) for name, row in zip(names, whole)}
    return out


def by_expert(layer: Any, pgc: Any, opt: Any = None) -> Dict[str, torch.Tensor]:
    """The experts' parameters (and with ``opt`` their last gradients and Adam moments, and in bf16 their fp32
    masters with the masters' moments) keyed by global id and name."""
    homes, rank, local = homes_of(layer), pgc.ep.rank(), layer.num_local_experts
    ids = local_experts(homes, rank) if homes is not None else [rank * local + i for i in range(local)]
    states = {}
    for chained in getattr(opt, "chained_optimizers", [opt] if opt is not None else []):
        states.update(chained.optimizer.state)
    out, stepped, whole = {}, _stepped(opt), whole_pieces(opt, layer)
    for i, mlp in enumerate(layer.experts.local_experts):
        for name, p in mlp.named_parameters():
            out[f"{ids[i]}.{name}"] = p.detach().clone()
            if opt is not None and getattr(p, "main_grad", None) is not None:
                out[f"{ids[i]}.{name}.main_grad"] = p.main_grad.clone()
            if id(p) in whole:           # the distributed optimizer: its pieces over expert-DP, whole
                out.update((f"{ids[i]}.{name}.{key}", t) for key, t in whole[id(p)].items())
                continue
            main = getattr(p, "main_param", None)
            main = stepped.get(id(p)) if main is None else main
            if main is not None and main.data_ptr() != p.data_ptr():
                out[f"{ids[i]}.{name}.main_param"] = main.detach().clone().view(p.shape)
            for key, value in states.get(main if main is not None else p, {}).items():
                if torch.is_tensor(value) and value.numel() == p.numel() > 1:
                    out[f"{ids[i]}.{name}.{key}"] = value.clone().view(p.shape)
    return out


def train_vs_stock(tp: int, ep: int, every: int, steps: int, forced: Optional[Sequence[int]] = None,
                   bf16: bool = False, distributed: bool = False, alternate: bool = False) -> Dict[str, Any]:
    """``steps`` steps of the stock layer, then of the plugin's re-sharding every ``every`` steps (with ``forced``
    homes: moved there after the first step, whatever Algorithm 2 plans; the experts by global id just before and
    after that move are kept too; ``alternate``: then every re-sharding inside the optimizer step moves them, to
    the stock homes and back in turn, in place of Algorithm 2's plan): losses, homes after each step, experts and
    Adam moments by global id."""
    from moe_plugins.patches import megatron as mp
    s = spec(tp, ep)
    out: Dict[str, Any] = {}
    with on_cpu(s) as groups:
        pgc, config = groups.pg_collection, config_of(s, bf16)
        stock = build_stock(s, config, groups, seed=1)
        initial = {k: v.clone() if torch.is_tensor(v) else v for k, v in stock.state_dict().items()}
        for name in ("stock", "plugin"):
            with ExitStack() as run:
                handle = run.enter_context(mp.enable(section(every), groups=groups)) if name == "plugin" else None
                layer = build_plugin(config, initial) if handle is not None else stock
                model, opt = ddp_and_optimizer(config, layer, pgc, distributed)
                losses, homes = [], []
                for i, (x, t) in enumerate(data(steps, config.params_dtype)):
                    losses.append(step(model, opt, pgc, x, t))
                    if forced is not None and handle is not None and i == 0:
                        before = by_expert(layer, pgc, opt)
                        handle.hecate.reshard([tuple(forced)])
                        around = {"before": before, "after": by_expert(layer, pgc, opt)}
                        if alternate:
                            turns = itertools.cycle([(layer.token_dispatcher.schedule.stock_homes(),),
                                                     (tuple(forced),)])
                            handle.hecate.resharders[0].plan = lambda turns=turns: next(turns)
                    homes.append(homes_of(layer))
                out[name] = {"losses": losses, "homes": homes, "experts": by_expert(layer, pgc, opt)}
                if handle is not None and forced is not None:
                    out[name]["forced"] = around
                if handle is not None:
                    pieces = [[(x.start, x.end) for p in mlp.parameters() for x in [handle.hecate.shards.get(id(p))]
                               if x is not None] for mlp in layer.experts.local_experts]
                    out[name].update(moves=handle.hecate.resharders[0].rounds, pieces=pieces,
                                     stock=layer.token_dispatcher.schedule.stock_homes())
    return out


def checkpoint_across(ckpt_dir: str, saver: str, loader: str, steps: int = 4) -> Dict[str, Any]:
    """A ``saver`` layer ("stock" or "plugin", re-sharding every step) trained ``steps`` steps and saved through
    ``dist_checkpointing.save``; a fresh ``loader`` layer (other weights; a plugin loader trained one step and
    re-sharded first, so that it too sits away from the stock homes) loads it through ``dist_checkpointing.load``.
    Experts by global id after the save and after the load, the homes at both, and the saver's experts before
    the save (the move to the stock owners and back must leave them in place)."""
    from megatron.core import dist_checkpointing

    from moe_plugins.patches import megatron as mp
    s = spec(1, 4)
    out: Dict[str, Any] = {}
    with on_cpu(s) as groups:
        pgc, config = groups.pg_collection, config_of(s)
        metadata = {"dp_cp_group": pgc.dp_cp}
        for role, kind, seed in (("saver", saver, 1), ("loader", loader, 2)):
            with ExitStack() as run:
                handle = run.enter_context(mp.enable(section(1), groups=groups)) if kind == "plugin" else None
                stock = build_stock(s, config, groups, seed)
                layer = build_plugin(config, stock.state_dict()) if handle is not None else stock
                model, opt = ddp_and_optimizer(config, layer, pgc)
                res = out[role] = {}
                if role == "saver":
                    for x, t in data(steps):
                        step(model, opt, pgc, x, t)
                    res["before"] = by_expert(layer, pgc)
                    if handle is not None:
                        res["async_error"] = async_save_error(layer, ckpt_dir, metadata)
                    with cpu_saver():
                        dist_checkpointing.save(layer.sharded_state_dict(metadata=metadata), ckpt_dir)
                    dist.barrier()
                else:
                    if handle is not None:
                        x, t = data(1)[0]
                        step(model, opt, pgc, x, t)
                        handle.hecate.reshard([(3, 2, 1, 0)])
                        res["homes_before"] = homes_of(layer)
                    state = dist_checkpointing.load(layer.sharded_state_dict(metadata=metadata), ckpt_dir)
                    layer.load_state_dict(state)
                res.update(homes=homes_of(layer), experts=by_expert(layer, pgc),
                           stock=layer.token_dispatcher.schedule.stock_homes() if handle is not None else None)
    return out


def async_save_error(layer: Any, ckpt_dir: str, metadata: Dict[str, Any]) -> Optional[str]:
    """The error of an asynchronous ``dist_checkpointing.save`` (refused before anything moves: the write would
    outlive the experts' move back), or None."""
    from megatron.core import dist_checkpointing
    try:
        dist_checkpointing.save(layer.sharded_state_dict(metadata=metadata), ckpt_dir, async_sharded_save=True)
    except ValueError as exc:
        return str(exc)
    return None


def refused_layer() -> Dict[str, Any]:
    """TP 2 x EP 2 with expert biases under sequence parallelism: the error building the plugin's layer raises."""
    from moe_plugins.patches import megatron as mp
    s = spec(2, 2)
    with on_cpu(s) as groups:
        config = transformer_config(s, add_bias_linear=True)
        stock = build_stock(s, config, groups, seed=1)
        with mp.enable(section(2), groups=groups):
            try:
                build_plugin(config, stock.state_dict())
            except ValueError as exc:
                return {"error": str(exc)}
    return {"error": None}


def refused_optimizer(tp: int, ep: int) -> Dict[str, Any]:
    """The distributed optimizer over a re-sharded layer's experts at expert-DP > 1: the error Megatron's optimizer
    build raises."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from moe_plugins.patches import megatron as mp
    s = spec(tp, ep)
    with on_cpu(s) as groups:
        pgc, config = groups.pg_collection, config_of(s)
        stock = build_stock(s, config, groups, seed=1)
        with mp.enable(section(2), groups=groups):
            layer = build_plugin(config, stock.state_dict())
            model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                            jobs._net(config, layer), pg_collection=pgc)
            try:
                get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=torch.float32,
                                                       use_distributed_optimizer=True), [model],
                                       use_gloo_process_groups=False, pg_collection=pgc)
            except ValueError as exc:
                return {"error": str(exc)}
    return {"error": None}


def _shifted_net(config: Any, moe: Any):
    """The tests' net (a dense scale before the MoE layer) with a dense shift of 64 x M elements too, so that
    every rank of a DP group of 4 steps part of the dense parameters (Megatron's distributed optimizer's
    ``state_dict`` asserts one Adam step count per rank: a rank with no dense elements has none)."""
    from megatron.core.transformer.module import MegatronModule

    class ShiftedNet(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.scale = torch.nn.Parameter(torch.ones(config.hidden_size))
            self.shift = torch.nn.Parameter(torch.zeros(64, config.hidden_size))
            self.moe = moe

        def forward(self, x):
            y, _ = self.moe(x * self.scale + self.shift.mean(0))
            return y
    return ShiftedNet()


def optimizer_checkpoint_across(ckpt_dir: str, saver: str, loader: str, sharding: str,
                                steps: int = 4) -> Dict[str, Any]:
    """Under Megatron's distributed optimizer at TP 1 x EP 2 (expert-DP 2): a ``saver`` ("stock" or "plugin",
    re-sharded by hand to (1, 0, 1, 0) after ``steps`` steps) writes the model and its optimizer's sharded state
    (``sharding``: the distributed optimizer's format) through ``dist_checkpointing.save``; a fresh ``loader``
    (other weights, one step; a plugin loader re-sharded to (1, 0, 1, 0) too) reads both back. Experts by global id
    (values, whole masters and moments) after the save and after the load, and the losses of 2 more steps of each
    from there."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from moe_plugins.patches import megatron as mp
    s = spec(1, 2)
    out: Dict[str, Any] = {}
    with on_cpu(s) as groups:
        pgc, config = groups.pg_collection, config_of(s)
        metadata = {"dp_cp_group": pgc.dp_cp, "distrib_optim_sharding_type": sharding}
        for role, kind, seed in (("saver", saver, 1), ("loader", loader, 2)):
            with ExitStack() as run:
                handle = run.enter_context(mp.enable(section(100), groups=groups)) if kind == "plugin" else None
                stock = build_stock(s, config, groups, seed)
                layer = build_plugin(config, stock.state_dict()) if handle is not None else stock
                model, opt = ddp_and_optimizer(config, layer, pgc, True, _shifted_net(config, layer), False)
                for x, t in data(steps if role == "saver" else 1):
                    step(model, opt, pgc, x, t)
                if handle is not None:
                    handle.hecate.reshard([(1, 0, 1, 0)])
                res = out[role] = {"homes": homes_of(layer)}
                model_sd = layer.sharded_state_dict(prefix="moe.", metadata=metadata)    # Net's own reads global TP
                for name in ("scale", "shift"):
                    model_sd[name] = ShardedTensor.from_rank_offsets(name, getattr(model.module, name),
                                                                     replica_id=(0, 0, dist.get_rank()))
                if role == "saver":
                    res["experts"] = by_expert(layer, pgc, opt)
                    sharded = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=metadata)}
                    with cpu_saver():
                        dist_checkpointing.save(sharded, ckpt_dir)
                    dist.barrier()
                else:
                    sharded = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True,
                                                                                      metadata=metadata)}
                    state = dist_checkpointing.load(sharded, ckpt_dir)
                    model.module.load_state_dict(state["model"])
                    with torch.no_grad():       # fp32: Megatron copies into views of the parameters
                        opt.load_state_dict(state["optimizer"])
                    res.update(experts=by_expert(layer, pgc, opt), loaded_homes=homes_of(layer))
                res["after"] = [step(model, opt, pgc, x, t) for x, t in data(steps + 2)[steps:]]
    return out
