"""Pool job for tests/test_lancet_parts_megatron.py: the recipes' GPT-2-MoE (or BERT-MoE) with Megatron-core MoE layers
(``recipes.megatron_moe``'s layers, built in fp64) in Megatron's ``DistributedDataParallel``, dropout 0.1 and eager
attention, trained by stock Megatron and by the plugin with Lancet's batch partitions, from the same weights,
batches and RNG state, under the CPU shims.

Shapes: B samples per rank, L tokens per sample.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from moe_plugins.core.layout import ParallelLayout
from moe_plugins.patches.megatron_cpu import megatron_on_cpu
from tests.workers.lina_megatron import _ddp
from tests.workers.profiles import measure_ep_profile

VOCAB, SEQ, B, RPN, LR = 64, 8, 4, 2, 0.05


def _model(ep: int, pgc: Any, bert: bool, k: int = 2, capacity_factor: float = 1.0, tp: int = 1):
    """The HF model (fp64) with Megatron MoE layers on every other block (built from the spec Megatron hands out:
    the plugin's while it is enabled), wrapped as the MegatronModule DDP takes, and those layers."""
    from moe_plugins.patches.megatron_specs import build_layer
    from moe_plugins.recipes import models
    from moe_plugins.recipes.megatron_moe import (MegatronMoE, MegatronMoESettings, activation_of, init_experts,
                                                  moe_spec, transformer_config)
    from moe_plugins.recipes.train_megatron import wrap
    size = models.ModelSize(layers=4, hidden=16, heads=2, ffn=24, seq_len=SEQ, experts=4, k=k,
                            capacity_factor=capacity_factor)
    settings = MegatronMoESettings(tp=tp, ep=ep, ranks_per_node=RPN)
    layers: List[Any] = []
    numbers = [i + 1 for i in models.moe_layer_indices(size)]

    def factory(hidden, expert):
        number = numbers[len(layers)]
        config = transformer_config(size, settings, activation_of(expert), params_dtype=torch.float64)
        layer = build_layer(moe_spec(size, settings), config, layer_number=number, pg_collection=pgc)
        layer.set_layer_number(number)
        init_experts(layer.experts, config, 3, number, pgc.ep.rank(), 0)
        layers.append(layer)
        return MegatronMoE(layer, pgc.tp, tp)

    torch.manual_seed(0)
    build = models.build_bert_moe if bert else models.build_gpt2_moe
    extra = {} if bert else {"use_cache": False}
    hf = build(size, VOCAB, factory, dropout=0.1, attn_implementation="eager", **extra).double()
    return wrap(layers[0].config, hf), layers


def _skew(layers: List[Any]) -> None:
    """Lean every router to expert 0 (a skewed gate: capacity drops every step)."""
    with torch.no_grad():
        for layer in layers:
            layer.router.weight[0] += 2.0


def train(section: Optional[Dict[str, Any]], *, ep: int = 4, steps: int = 3, accumulate: int = 1,
          bert: bool = False, skew: bool = False, profile_dir: Optional[str] = None) -> Dict[str, Any]:
    """``steps`` steps of ``accumulate`` micro-batches (``no_sync`` on all but the last), each ended by DDP's
    ``finish_grad_sync`` and an SGD update on ``main_grad``: per micro-step the loss and the DDP hook's calls per
    parameter (counted on its gradient accumulator), per step every ``main_grad``; the executor's ranges and, with
    ``"tune"``, its decisions. ``profile_dir``: a cost profile is measured and cached there first (``"auto"``)."""
    from moe_plugins.patches import megatron as mp
    world = dist.get_world_size()
    out: Dict[str, Any] = {"losses": [], "grads": [], "hooks": []}
    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        layout = ParallelLayout(world=world, ranks_per_node=RPN, ep=ep)
        groups = stack.enter_context(mp.megatron_groups(layout))
        pgc = groups.pg_collection
        if profile_dir is not None:
            measure_ep_profile(layout, profile_dir)
        handle = stack.enter_context(mp.enable(section, groups=groups, record_timeline="lina" in section)) \
            if section is not None else None
        module, layers = _model(ep, pgc, bert)
        if skew:
            _skew(layers)
        _count_drops(layers, out.setdefault("dropped", []))
        if handle is not None:
            handle.lancet.partitions.wrap_model(module, layers, micro_batch=B, profile_dir=profile_dir)
        model = _ddp(module.config, module, pgc, bucket_size=2000)
        calls: Dict[str, int] = {}
        for n, p in model.module.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
        gen = torch.Generator().manual_seed(100 + dist.get_rank())
        torch.manual_seed(7 + dist.get_rank())                        # dropout: the same draws in both runs
        for _ in range(steps):
            model.zero_grad_buffer()
            for mb in range(accumulate):
                calls.clear()
                ids = torch.randint(0, VOCAB, (B, SEQ), generator=gen)
                with model.no_sync() if mb < accumulate - 1 else nullcontext():
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                out["losses"].append(float(loss))
                out["hooks"].append(dict(calls))
            model.finish_grad_sync()
            out["grads"].append({n: p.main_grad.clone() for n, p in model.module.named_parameters()})
            with torch.no_grad():
                for p in model.module.parameters():
                    p.sub_(LR * p.main_grad)
        if handle is not None:
            if handle.lina is not None:
                out["micro_ops"] = sum(r.lane == "background" for r in handle.lina.timeline())
                out["routed"] = handle.lina.routed
            out["local_experts"] = sorted({len(layer.experts.local_experts) for layer in layers})
            executor = handle.lancet.partitions.executors[0]
            out.update(ranges=executor.ranges_run, stock_calls=executor.stock_calls,
                       chosen=sorted(set(executor.chosen)), blocks=[type(b).__name__ for b in executor.blocks],
                       tuned=executor.parts.decisions() if hasattr(executor.parts, "decisions") else None)
    if handle is not None:
        out["restored"] = all("forward" not in b.__dict__ for b in executor.blocks)
    return out


def _count_drops(layers: List[Any], into: List[int]) -> None:
    """Every router call appends the routes it dropped (S k minus the routes its map keeps)."""
    for layer in layers:
        k = layer.config.moe_router_topk
        layer.router.register_forward_hook(
            lambda _m, args, out, k=k: into.append(int(args[0].shape[0] * args[0].shape[1] * k - out[1].sum())))


def _copying(wrapper: Any):
    """A MegatronMoE forward that returns a batch-first copy of the layer's output (made contiguous)."""
    def forward(x_BLM):
        y_LBM, _ = wrapper.layer(x_BLM.transpose(0, 1).contiguous())
        return y_LBM.transpose(0, 1).contiguous(), x_BLM.new_zeros(()), None
    return forward


def refused(section: Dict[str, Any], ep: int = 4, tp: int = 1, **extra) -> str:
    """The error of handing the model (at TP ``tp``) to the executor (``micro_batch``), of a training forward without
    that (``skip_wrap``), or of a training forward whose MoE wrapper returns a copy of the output (``copying``)."""
    from moe_plugins.patches import megatron as mp
    world = dist.get_world_size()
    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        groups = stack.enter_context(mp.megatron_groups(ParallelLayout(world=world, ranks_per_node=RPN, mp=tp,
                                                                       ep=ep)))
        handle = stack.enter_context(mp.enable(section, groups=groups))
        module, layers = _model(ep, groups.pg_collection, False, tp=tp)
        try:
            if extra.get("skip_wrap"):
                module(input_ids=torch.zeros(B, SEQ, dtype=torch.long))
            else:
                handle.lancet.partitions.wrap_model(module, layers, micro_batch=extra.get("micro_batch", B))
            if extra.get("copying"):
                from moe_plugins.recipes.megatron_moe import MegatronMoE
                for wrapper in [m for m in module.modules() if isinstance(m, MegatronMoE)]:
                    wrapper.forward = _copying(wrapper)
                module(input_ids=torch.zeros(B, SEQ, dtype=torch.long))
        except ValueError as exc:
            return str(exc)
    return ""
