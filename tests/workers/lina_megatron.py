"""Pool jobs for Lina in Megatron-core's DDP: a tiny model (dense linears around two of the plugin's MoE layers,
built through Megatron's own ``get_moe_module_spec`` while the plugin is enabled) wrapped in Megatron's
``DistributedDataParallel``, once with the plugin's ``lina`` section and once without, on the same groups,
weights and data, under the CPU shims.

Shapes: s tokens per rank and micro-batch (Megatron's [s, b=1, M] layout), M model dim.
"""

from __future__ import annotations

import copy
import io
import time
from contextlib import ExitStack, nullcontext
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_plugins.core.layout import ParallelLayout
from moe_plugins.patches.megatron_cpu import megatron_on_cpu, megatron_optimizer_on_cpu
from moe_plugins.tools.verify_megatron import MegatronVerifySpec, transformer_config
from tests.workers.megatron import adam_steps

M, FFN, E, S = 16, 32, 4, 8
RANKS_PER_NODE = 2


def _spec(tp: int, ep: int, dtype: str) -> MegatronVerifySpec:
    return MegatronVerifySpec(world=dist.get_world_size(), ranks_per_node=RANKS_PER_NODE, mp=tp, ep=ep, hidden=M,
                              ffn=FFN, experts=E, k=2, drop=True, capacity_factor=1.25, dtype=dtype, tokens=S)


def _net(config, seed: int, tied: bool = False):
    """Three dense linears around two MoE layers, built while the plugin is enabled (the MoE spec comes from
    Megatron's own get_moe_module_spec, which the plugin hooks). Same seed, same weights. ``tied``: the last
    linear's weight is the first's (as GPT ties its output layer to the embedding): one parameter used twice."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.module import MegatronModule

    from moe_plugins.patches.megatron_specs import build_layer

    class Net(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.dense = torch.nn.ModuleList(torch.nn.Linear(M, M, dtype=config.params_dtype) for _ in range(3))
            for p in self.dense.parameters():          # replicated over TP (tokens are per TP rank): summed there
                p.sequence_parallel = config.sequence_parallel
            self.moe = torch.nn.ModuleList(build_layer(get_moe_module_spec(use_te=False, num_experts=E), config)
                                           for _ in range(2))
            if tied:
                self.dense[2].weight = self.dense[0].weight

        def forward(self, x):
            for i in range(2):
                x = torch.tanh(self.dense[i](x))
                y, _ = self.moe[i](x)
                x = x + y
            return self.dense[2](x)

    return numbered(Net, seed)


def numbered(net_class, seed: int):
    """``net_class()`` built from ``seed`` (the caller's random state left as it was), its MoE layers (``.moe``)
    numbered from 1 as Megatron numbers layers (it tracks aux losses of numbered layers only)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = net_class()
    for i, layer in enumerate(net.moe):
        layer.set_layer_number(i + 1)
    return net


def _ddp(config, net, pgc, *, bucket_size: int, overlap: bool = True, **ddp_kw):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=bucket_size, **ddp_kw)
    return DistributedDataParallel(config, ddp_config, net, pg_collection=pgc)


def _batches(dtype: torch.dtype, n: int, seed: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    teacher_MM = torch.randn(M, M, generator=torch.Generator().manual_seed(3), dtype=torch.float64) / M ** 0.5
    out = []
    for _ in range(n):
        x = torch.randn(S, 1, M, generator=gen, dtype=torch.float64)
        out.append((x.to(dtype), torch.tanh(x @ teacher_MM).to(dtype)))
    return out


def _plugin(lina: Optional[Dict[str, Any]], pipeline_degree: int = 1) -> Dict[str, Any]:
    section: Dict[str, Any] = {"schedule": "baseline", "pipeline_degree": pipeline_degree}
    if lina is not None:
        section["lina"] = lina
    return section


def _records(handle) -> List[Dict[str, Any]]:
    return [asdict(r) for r in handle.lina.timeline()] if handle.lina is not None else []


# ---- gradients: Lina on against Lina off ---------------------------------------------------------------------

def grads_job(tp: int, ep: int, lina: Dict[str, Any], *, dtype: str = "float64", steps: int = 2,
              accumulate: int = 2, overlap: bool = True, bucket_size: int = 200,
              pipeline_degree: int = 1, tied: bool = False, distributed: bool = False) -> Dict[str, Any]:
    """``steps`` steps of ``accumulate`` micro-batches (``no_sync`` on all but the last), each ended by DDP's
    ``finish_grad_sync``; the largest difference of every ``main_grad`` between the two runs, per step and per
    kind (dense / expert), the Lina run's timeline and step bounds, and how many bucket groups Lina routed.
    ``pipeline_degree`` > 1: PipeMoE's runner, its exchanges on the shared engine's pipeline lane. ``tied``: one
    dense weight used at both ends of the model. ``distributed``: DDP for Megatron's distributed optimizer (the
    buckets reduce-scattered: each rank's shard of ``main_grad`` is the sum, the rest its own gradient)."""
    from moe_plugins.patches import megatron as mp
    spec = _spec(tp, ep, dtype)
    runs, timeline, bounds, routed = [], [], [], 0
    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        groups = stack.enter_context(mp.megatron_groups(ParallelLayout(world=spec.world, ranks_per_node=RANKS_PER_NODE,
                                                                       mp=tp, ep=ep)))
        config = transformer_config(spec, num_layers=2)
        data = _batches(config.params_dtype, steps * accumulate, seed=11)
        for section in (None, lina):
            with mp.enable(_plugin(section, pipeline_degree), groups=groups, record_timeline=True) as handle:
                model = _ddp(config, _net(config, seed=5, tied=tied), groups.pg_collection, bucket_size=bucket_size,
                             overlap=overlap, use_distributed_optimizer=distributed)
                per_step = []
                for step in range(steps):
                    start = time.perf_counter_ns()
                    model.zero_grad_buffer()
                    for mb in range(accumulate):
                        with model.no_sync() if mb < accumulate - 1 else nullcontext():
                            x, t = data[step * accumulate + mb]
                            F.mse_loss(model(x), t).backward()
                    model.finish_grad_sync()
                    bounds.append((start, time.perf_counter_ns()))
                    per_step.append({n: (p.main_grad.clone(), getattr(p, "allreduce", True))
                                     for n, p in model.module.named_parameters()})
                runs.append(per_step)
                if section is not None:
                    timeline, routed = _records(handle), handle.lina.routed
                    bounds = bounds[steps:]
    off, on = runs
    diffs = [{kind: max(float((a - on_step[n][0]).abs().max()) for n, (a, dense) in off_step.items()
                        if dense == (kind == "dense"))
              for kind in ("dense", "expert")} for off_step, on_step in zip(off, on)]
    return {"diffs": diffs, "timeline": timeline, "bounds": bounds, "routed": routed,
            "params": len(on[0]),
            "nonzero": all(float(g.abs().max()) > 0 for step in on for g, _ in step.values())}


# ---- training, and checkpoints both ways ------------------------------------------------------------------------

def _train(config, model, pgc, data, distributed: bool = False) -> List[float]:
    return adam_steps(model, pgc, data, megatron_optimizer_on_cpu, distributed)


def _saved(module) -> Dict[str, torch.Tensor]:
    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _probe(module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(x).detach().clone()


def train_job(tp: int, ep: int, lina: Dict[str, Any], steps: int = 20, distributed: bool = False) -> Dict[str, Any]:
    """fp32 Adam through Megatron's DDP (overlapped, small buckets), finalize_model_grads and optimizer: losses
    with Lina and without. Then checkpoints: the trained Lina model's state dict loads into a fresh Lina-off model
    and the trained Lina-off model's into a fresh Lina model, each reproducing the saved model's outputs."""
    from moe_plugins.patches import megatron as mp
    spec = _spec(tp, ep, "float32")
    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        groups = stack.enter_context(mp.megatron_groups(ParallelLayout(world=spec.world, ranks_per_node=RANKS_PER_NODE,
                                                                       mp=tp, ep=ep)))
        pgc, config = groups.pg_collection, transformer_config(spec, num_layers=2)
        data = _batches(torch.float32, 4, seed=21)
        data = (data * steps)[:steps]
        probe = _batches(torch.float32, 1, seed=99)[0][0]
        with mp.enable(_plugin(lina), groups=groups) as handle:
            model = _ddp(config, _net(config, seed=7), pgc, bucket_size=300, use_distributed_optimizer=distributed)
            lina_losses = _train(config, model, pgc, data, distributed)
            lina_state, lina_out = _saved(model.module), _probe(model.module, probe)
            routed = handle.lina.routed
        with mp.enable(_plugin(None), groups=groups):
            model = _ddp(config, _net(config, seed=7), pgc, bucket_size=300, use_distributed_optimizer=distributed)
            off_losses = _train(config, model, pgc, data, distributed)
            off_state, off_out = _saved(model.module), _probe(model.module, probe)
            fresh = _net(config, seed=8)
            fresh.load_state_dict(lina_state)                                    # Lina -> off
            lina_to_off = float((_probe(fresh, probe) - lina_out).abs().max())
        with mp.enable(_plugin(lina), groups=groups):
            fresh = _net(config, seed=9)
            fresh.load_state_dict(off_state)                                     # off -> Lina
            off_to_lina = float((_probe(fresh, probe) - off_out).abs().max())
    return {"lina": lina_losses, "off": off_losses, "routed": routed, "lina_to_off": lina_to_off,
            "off_to_lina": off_to_lina, "keys_equal": list(lina_state) == list(off_state)}


# ---- bad input --------------------------------------------------------------------------------------------------

def bad_ddp_job(lina: Dict[str, Any]) -> Dict[str, Any]:
    """Megatron's DDP over a Lina model with unsupported settings, then with a dense group that is not the
    layout's: each refused before Megatron's DDP is built (no parameter got a ``main_grad``)."""
    from moe_plugins.patches import megatron as mp
    spec = _spec(2, 2, "float32")
    messages = []
    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        groups = stack.enter_context(mp.megatron_groups(ParallelLayout(world=spec.world, ranks_per_node=RANKS_PER_NODE,
                                                                       mp=2, ep=2)))
        config = transformer_config(spec, num_layers=2)
        with mp.enable(_plugin(lina), groups=groups) as handle:
            net = _net(config, seed=1)
            wrong = copy.copy(groups.pg_collection)
            wrong.dp = wrong.dp_cp = dist.group.WORLD          # the layout's dense DP group is {0, 2} or {1, 3}
            attempts = [(groups.pg_collection, dict(use_distributed_optimizer=True, average_in_collective=True,
                                                    reduce_scatter_with_fp32_accumulation=True,
                                                    delay_wgrad_compute=True)),
                        (wrong, {})]
            for pgc, kw in attempts:
                try:
                    _ddp(config, net, pgc, bucket_size=200, **kw)
                except ValueError as exc:
                    messages.append(str(exc))
                else:
                    messages.append("")
            untouched = not any(hasattr(p, "main_grad") for p in net.parameters())
            routed = handle.lina.routed
            stock_err = _stock_model_falls_through(config, groups)
            routed_after = handle.lina.routed
    return {"messages": messages, "untouched": untouched, "routed": routed, "routed_after": routed_after,
            "stock_err": stock_err}


def _stock_model_falls_through(config, groups) -> float:
    """While Lina is on, a model without the plugin's MoE layers keeps Megatron's own reduction: its main_grad
    is the DP mean of the local gradients. Returns the largest difference from that mean."""
    from megatron.core.transformer.module import MegatronModule

    class Plain(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.linear = torch.nn.Linear(M, M)

        def forward(self, x):
            return self.linear(x)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        net = Plain()
    x = torch.randn(S, 1, M, generator=torch.Generator().manual_seed(dist.get_rank()))
    reference = copy.deepcopy(net.linear)
    reference(x).pow(2).sum().backward()
    model = _ddp(config, net, groups.pg_collection, bucket_size=200)
    model(x).pow(2).sum().backward()
    model.finish_grad_sync()
    err = 0.0
    for p, ref in ((net.linear.weight, reference.weight), (net.linear.bias, reference.bias)):
        mean = ref.grad.clone()
        dist.all_reduce(mean, group=groups.pg_collection.dp)
        err = max(err, float((p.main_grad - mean / groups.layout.dp).abs().max()))
    return err
