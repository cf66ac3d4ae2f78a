"""Pool jobs for the Megatron-core host tests: stock ``MoELayer`` (alltoall dispatcher) and the plugin's layer side
by side on the same process groups, weights and tokens, under the CPU shims. The layer-level comparison is
``moe-plugins verify --host megatron``'s (:mod:`moe_plugins.tools.verify_megatron`); training, checkpoints and
construction-time validation are here.

Shapes: s tokens per rank (Megatron's [s, b=1, M] layout; sequence parallel: distinct per TP rank), M model dim.
"""

from __future__ import annotations

import io
from contextlib import ExitStack, nullcontext
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_plugins.patches.megatron_cpu import megatron_on_cpu
from moe_plugins.patches.megatron_specs import spec_submodules
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.plugin_config import PluginConfig
from moe_plugins.tools.verify_megatron import MegatronVerifySpec, build_pair, compare_on_rank, transformer_config

from tests.megatron_shims_extra import cuda_factories_on_cpu

RANKS_PER_NODE = 2


def _groups(spec: MegatronVerifySpec):
    """The spec's Megatron groups for the duration of a block (destroyed after: gloo keeps threads per group)."""
    from moe_plugins.patches.megatron import megatron_groups
    return megatron_groups(ParallelLayout(world=spec.world, ranks_per_node=spec.ranks_per_node, mp=spec.mp,
                                          ep=spec.ep, esp=spec.esp))


def _layout_key(spec: MegatronVerifySpec) -> Tuple[int, int, int]:
    return spec.mp, spec.ep, spec.esp


def equivalence_job(specs: List[MegatronVerifySpec]) -> List[Dict[str, Any]]:
    """Every spec on this rank, each layout's process groups built once."""
    out, built = [], {}
    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        for spec in specs:
            if _layout_key(spec) not in built:
                built[_layout_key(spec)] = stack.enter_context(_groups(spec))
            out.append(dict(compare_on_rank(spec, built[_layout_key(spec)]), spec=spec))
    return out


def assert_equivalent(results: List[Dict[str, Any]], tol: float) -> None:
    """Every rank's comparison from :func:`equivalence_job` within ``tol`` (outputs, input and weight gradients,
    aux loss), with the same routing, the same gradient names and no separate bias."""
    bad = []
    for r in results:
        errs = {key: r[key] for key in ("max_err_out", "max_err_grad_in", "max_err_grad_w", "max_err_aux")}
        if max(errs.values()) > tol or not (r["routing_equal"] and r["grad_names_equal"] and r["bias_none"]):
            bad.append((r["spec"], r["rank"], errs, r["routing_equal"], r["grad_names_equal"]))
    assert not bad, bad


def _maxerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _forward_backward(layer, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y, _ = layer(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}


# ---- checkpoints -------------------------------------------------------------------------------------------

def _roundtrip(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _param_attrs(layer) -> Dict[str, Tuple[Any, Any]]:
    return {n: (getattr(p, "allreduce", True), getattr(p, "sequence_parallel", False))
            for n, p in layer.named_parameters()}


def checkpoint_job(spec: MegatronVerifySpec) -> Dict[str, Any]:
    """Plugin -> stock and stock -> plugin through torch.save/torch.load, after the plugin's weights moved away
    from their initial values; each loaded layer reproduces the saved one's output and gradients."""
    with megatron_on_cpu(), _groups(spec) as groups:
        config = transformer_config(spec)
        stock, plugin = build_pair(spec, config, groups)
        with torch.no_grad():
            for p in plugin.parameters():
                p.add_(0.01 * torch.randn_like(p))
        fresh_stock, fresh_plugin = build_pair(spec, config, groups)
        fresh_stock.load_state_dict(_roundtrip(plugin.state_dict()))         # plugin -> stock
        fresh_plugin.load_state_dict(_roundtrip(fresh_stock.state_dict()))    # stock -> plugin
        gen = torch.Generator().manual_seed(77 + dist.get_rank())
        x = torch.randn(spec.tokens, 1, spec.hidden, generator=gen, dtype=torch.float64)
        g = torch.randn_like(x)
        saved, *loaded = [_forward_backward(m, x, g) for m in (plugin, fresh_stock, fresh_plugin)]
    errs = [max(_maxerr(saved[0], r[0]), _maxerr(saved[1], r[1]), max(_maxerr(saved[2][n], r[2][n]) for n in r[2]))
            for r in loaded]
    attrs = _param_attrs(stock)
    return {"keys": list(stock.state_dict()), "plugin_keys": list(plugin.state_dict()),
            "attrs_equal": attrs == _param_attrs(plugin), "err_plugin_to_stock": errs[0],
            "err_stock_to_plugin": errs[1], "expert_params": sorted(n for n, a in attrs.items() if a[0] is False)}


# ---- training through Megatron's DDP and optimizer ------------------------------------------------------------

def _net(config, moe):
    from megatron.core.transformer.module import MegatronModule

    class Net(MegatronModule):
        """A replicated per-channel scale (a dense parameter, sequence parallel with TP) before the MoE layer."""

        def __init__(self):
            super().__init__(config)
            self.scale = torch.nn.Parameter(torch.ones(config.hidden_size))
            self.scale.sequence_parallel = config.sequence_parallel
            self.moe = moe

        def forward(self, x):
            y, _ = self.moe(x * self.scale)
            return y
    return Net()


def _train(config, moe, pgc, data, overlap: bool) -> Tuple[List[float], int]:
    """Losses of every step, and how many parameters DDP put in its expert-parallel buffers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=64 if overlap else None)
    model = DistributedDataParallel(config, ddp_config, _net(config, moe), pg_collection=pgc)
    return adam_steps(model, pgc, data), sum(len(buffer.params) for buffer in model.expert_parallel_buffers)


def adam_steps(model, pgc, data, optimizer_context=nullcontext, distributed: bool = False) -> List[float]:
    """fp32 Adam steps of a Megatron DDP model on ``data`` ((x, target) pairs, MSE): zero the grad buffer,
    backward, ``finalize_model_grads``, Megatron's optimizer (built and stepped inside ``optimizer_context``;
    ``distributed``: its distributed optimizer, for a DDP built with ``use_distributed_optimizer``).
    Returns every step's loss."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    with optimizer_context():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=torch.float32,
                                                     clip_grad=0.0, use_distributed_optimizer=distributed), [model],
                                     use_gloo_process_groups=False, pg_collection=pgc)
    losses = []
    for x, t in data:
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = F.mse_loss(model(x), t)
        loss.backward()
        finalize_model_grads([model], pg_collection=pgc)
        with optimizer_context():
            ok, _, _ = opt.step()
        if not ok:
            raise RuntimeError("Megatron's optimizer skipped a step")
        losses.append(float(loss.detach()))
    return losses


def training_job(spec: MegatronVerifySpec, steps: int, overlap: bool) -> Dict[str, Any]:
    """The same model twice (stock MoELayer, plugin layer; same initial weights, same data), each trained through
    Megatron's DistributedDataParallel, finalize_model_grads and get_megatron_optimizer (Adam, fp32)."""
    teacher_MM = torch.randn(spec.hidden, spec.hidden, generator=torch.Generator().manual_seed(3)) / spec.hidden ** 0.5
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    batches = [torch.randn(spec.tokens, 1, spec.hidden, generator=gen) for _ in range(4)]
    data = [(x, torch.tanh(x @ teacher_MM)) for x in (batches * steps)[:steps]]      # a learnable target
    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        stack.enter_context(cuda_factories_on_cpu())
        groups = stack.enter_context(_groups(spec))
        config = transformer_config(spec)
        stock, plugin = build_pair(spec, config, groups)
        stock_losses, stock_experts = _train(config, stock, groups.pg_collection, data, overlap)
        plugin_losses, plugin_experts = _train(config, plugin, groups.pg_collection, data, overlap)
    return {"stock": stock_losses, "plugin": plugin_losses, "expert_buffer_params": (stock_experts, plugin_experts)}


# ---- construction-time validation -----------------------------------------------------------------------------

def bad_layer_job() -> Dict[str, Any]:
    """PluginMoELayer with several unsupported settings: one ValueError naming all, raised before any module is
    built (building draws the initial weights from the RNG, which stays untouched)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as stock_spec

    from moe_plugins.patches.megatron_layer import PluginMoELayer
    spec = MegatronVerifySpec(world=dist.get_world_size(), ranks_per_node=RANKS_PER_NODE, ep=2, esp=2, k=2)
    with megatron_on_cpu(), _groups(spec) as groups:
        config = transformer_config(spec, moe_input_jitter_eps=0.01)
        config.moe_token_dispatcher_type = "flex"                 # set after TransformerConfig's own checks
        config.overlap_moe_expert_parallel_comm = True
        before = torch.get_rng_state()
        try:
            PluginMoELayer(config, submodules=spec_submodules(stock_spec(use_te=False, num_experts=spec.experts)),
                           plugin=PluginConfig(schedule="baseline-tp", pipeline_degree="auto", esp=1), groups=groups)
        except ValueError as exc:
            message = str(exc)
        else:
            message = ""
        rng_untouched = torch.equal(before, torch.get_rng_state())
    return {"message": message, "rng_untouched": rng_untouched}


def mismatched_groups_job() -> str:
    """A ProcessGroupCollection whose EP groups do not follow the layout is refused, naming the ranks."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as stock_spec

    from moe_plugins.patches.megatron_layer import PluginMoELayer
    world = dist.get_world_size()
    spec = MegatronVerifySpec(world=world, ranks_per_node=RANKS_PER_NODE, ep=2, k=2)
    message = ""
    with megatron_on_cpu(), _groups(spec) as groups:
        pgc = groups.pg_collection
        strided = [dist.new_group([r for r in range(world) if r % 2 == parity]) for parity in range(2)]
        pgc.ep = strided[dist.get_rank() % 2]                     # EP over {0,2},{1,3}; the layout has {0,1},{2,3}
        try:
            submodules = spec_submodules(stock_spec(use_te=False, num_experts=4))
            PluginMoELayer(transformer_config(spec), submodules=submodules, pg_collection=pgc, plugin=PluginConfig())
        except ValueError as exc:
            message = str(exc)
        finally:
            dist.destroy_process_group(strided[dist.get_rank() % 2])
    return message


# ---- the Megatron-LM flag path, through Megatron's own layer spec ---------------------------------------------

def flag_path_job(flag: str) -> Dict[str, Any]:
    """``--moe-plugins`` as a Megatron-LM script uses it: parse the flag, enable from the parsed arguments, build a
    TransformerLayer from Megatron's unchanged ``get_gpt_layer_local_spec``, disable. Its MoE layer (which
    TransformerLayer did not hand a pg_collection) must sit on the layout's groups and match the stock layer's."""
    import argparse

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from moe_plugins.patches import megatron as mp
    spec = MegatronVerifySpec(world=dist.get_world_size(), ranks_per_node=RANKS_PER_NODE, ep=2, esp=2, k=2,
                              drop=False, tokens=8)
    parser = mp.extra_args_provider(argparse.ArgumentParser())
    args = parser.parse_args([mp.FLAG, flag])
    args.__dict__.update(world_size=spec.world, tensor_model_parallel_size=spec.mp, expert_model_parallel_size=spec.ep,
                         expert_tensor_parallel_size=spec.esp, num_experts=spec.experts, hidden_size=spec.hidden,
                         ffn_hidden_size=spec.ffn, moe_router_topk=spec.k, moe_token_dispatcher_type="alltoall")
    with megatron_on_cpu(), _groups(spec) as groups:
        config = transformer_config(spec, num_attention_heads=2)
        layers = []
        handle = None
        try:
            for use_flag in (False, True):         # stock first; the plugin's layer built and run under enable
                handle = mp.enable_from_args(args, groups=groups) if use_flag else None
                layer_spec = get_gpt_layer_local_spec(num_experts=spec.experts)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(3)
                    layers.append(TransformerLayer(config, submodules=layer_spec.submodules, layer_number=1,
                                                   pg_collection=groups.pg_collection))
            stock, ours = layers
            ours.load_state_dict(stock.state_dict())
            gen = torch.Generator().manual_seed(dist.get_rank())
            x = torch.randn(spec.tokens, 1, spec.hidden, generator=gen, dtype=torch.float64)
            g = torch.randn_like(x)
            (ys, gxs, gws), (yp, gxp, gwp) = [_forward_backward(layer.mlp, x, g) for layer in layers]
            moe = ours.mlp
            engines = handle.engines
            on_handles_engine = engines is not None and moe.token_dispatcher.engine in engines.engines.values()
        finally:
            mp.disable()
    err = max(_maxerr(ys, yp), _maxerr(gxs, gxp), max(_maxerr(gws[n], gwp[n]) for n in gws))
    return {"stock_class": type(stock.mlp).__name__, "class": type(moe).__name__, "specs_built": handle.specs_built,
            "ep_ranks": list(moe.moe_groups.ep.ranks), "esp_ranks": list(moe.moe_groups.esp.ranks),
            "layout_ep": list(groups.groups.ep.ranks), "layout_esp": list(groups.groups.esp.ranks),
            "grad_names_equal": sorted(gws) == sorted(gwp), "err": err, "active_after": mp.active() is not None,
            "degree": moe.token_dispatcher.degree, "has_engines": engines is not None,
            "on_handles_engine": on_handles_engine, "engines_closed": engines is not None and engines.closed
            and not engines.engines}


def auto_job(spec: MegatronVerifySpec, schedule: str, profile_dir: str, exchange: str = "padded") -> Dict[str, Any]:
    """``pipeline_degree: "auto"`` through Megatron: the plugin layer finds the profile cached for its layout in
    ``profile_dir``, picks a degree, and still matches the stock layer. ``exchange``: the section's."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as stock_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_plugins.patches.megatron_engines import LayoutEngines
    from moe_plugins.patches.megatron_layer import PluginMoELayer
    from moe_plugins.tools.verify_megatron import _run
    with megatron_on_cpu(), _groups(spec) as groups, LayoutEngines() as engines:
        config = transformer_config(spec)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1000 + spec.seed)
            submodules = spec_submodules(stock_spec(use_te=False, num_experts=spec.experts))
            stock = MoELayer(config, submodules=submodules, pg_collection=groups.pg_collection)
            plugin = PluginMoELayer(config, submodules=submodules,
                                    plugin=PluginConfig(schedule=schedule, pipeline_degree="auto", exchange=exchange),
                                    groups=groups,
                                    profile_dir=profile_dir, engines=engines)
        plugin.load_state_dict(stock.state_dict())
        for layer in (stock, plugin):
            layer.set_layer_number(1)
        gen = torch.Generator().manual_seed(7 + dist.get_rank())
        x = torch.randn(spec.tokens, 1, spec.hidden, generator=gen, dtype=torch.float64)
        g = torch.randn(spec.tokens, 1, spec.hidden, generator=gen, dtype=torch.float64)
        a, b = _run(stock, x, g), _run(plugin, x, g)
        degree = plugin.token_dispatcher.degree          # an int where "auto" settled without a profile
        decisions = sorted(set(degree.decisions.values())) if hasattr(degree, "decisions") else [degree]
        source = getattr(degree, "source", "")
    shared = sorted(set(a["grads"]) & set(b["grads"]))
    return {"err_out": _maxerr(a["y"], b["y"]), "err_grad_in": _maxerr(a["grad_x"], b["grad_x"]),
            "err_grad_w": max(_maxerr(a["grads"][n], b["grads"][n]) for n in shared), "decisions": decisions,
            "source": source}
