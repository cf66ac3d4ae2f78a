"""Pool jobs for tests/test_lancet_megatron.py: tests/workers/lina_megatron.py's tiny model (dense linears around two
of the plugin's MoE layers, built through Megatron's own ``get_moe_module_spec`` while the plugin is enabled) in
Megatron's ``DistributedDataParallel``, once with the ``lancet`` section (the experts' weight gradients deferred)
and once without, on the same groups, weights and data, under the CPU shims.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from moe_plugins.core.layout import ParallelLayout
from moe_plugins.patches.megatron_cpu import megatron_on_cpu, megatron_optimizer_on_cpu
from moe_plugins.tools.verify_megatron import transformer_config
from tests.workers.lina_megatron import M, RANKS_PER_NODE, _batches, _ddp, _net, _spec, numbered


def _parallel_net(config, seed: int, tp_group):
    """Two blocks of Megatron's own tensor-parallel linears (ColumnParallelLinear M -> 2M, tanh, RowParallelLinear
    2M -> M, biases on; sequence parallel at TP > 1) each before one of the plugin's MoE layers, built while the
    plugin is enabled: the layers Lancet's ``dense_wgrad`` wraps on Megatron."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.module import MegatronModule

    from moe_plugins.patches.megatron_specs import build_layer
    from tests.workers.lina_megatron import E

    def init(w):
        return torch.nn.init.normal_(w, std=0.2)

    class Net(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.up = torch.nn.ModuleList(ColumnParallelLinear(M, 2 * M, config=config, init_method=init, bias=True,
                                                               gather_output=False, tp_group=tp_group)
                                          for _ in range(2))
            self.down = torch.nn.ModuleList(RowParallelLinear(2 * M, M, config=config, init_method=init, bias=True,
                                                              input_is_parallel=True, skip_bias_add=False,
                                                              tp_group=tp_group) for _ in range(2))
            self.moe = torch.nn.ModuleList(build_layer(get_moe_module_spec(use_te=False, num_experts=E), config)
                                           for _ in range(2))

        def forward(self, x):
            for i in range(2):
                h, _ = self.up[i](x)
                d, _ = self.down[i](torch.tanh(h))
                x = x + d
                y, _ = self.moe[i](x)
                x = x + y
            return x

    return numbered(Net, seed)
from tests.workers.megatron import adam_steps


def _plugin(lancet: Optional[Dict[str, Any]], pipeline_degree: int = 1,
            lina: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    section: Dict[str, Any] = {"schedule": "baseline", "pipeline_degree": pipeline_degree}
    if lancet is not None:
        section["lancet"] = lancet
    if lina is not None:
        section["lina"] = lina
    return section


def grads_job(tp: int, ep: int, *, steps: int = 2, accumulate: int = 2, pipeline_degree: int = 1,
              gated: bool = False, dense: bool = False, lina: bool = False) -> Dict[str, Any]:
    """``steps`` steps of ``accumulate`` micro-batches (``no_sync`` on all but the last) in fp64, each ended by DDP's
    ``finish_grad_sync``: the largest difference of every ``main_grad`` between the runs with and without Lancet,
    per step and kind; how many times each parameter's DDP hook ran per backward with Lancet (counted on its
    gradient accumulator); the queue's state and how often it ran behind an exchange. ``dense``: the model of
    Megatron's tensor-parallel linears (:func:`_parallel_net`) with ``dense_wgrad`` on too. ``lina``: the Lancet
    run reduces the gradients as Lina's micro-ops too (one engine: Lancet's exchanges on its pipeline lane, the
    micro-ops on its background lane); the other run keeps Megatron's own reduction."""
    from moe_plugins.patches import megatron as mp
    spec = _spec(tp, ep, "float64")
    runs, hooks, state = [], [], {}
    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        groups = stack.enter_context(mp.megatron_groups(ParallelLayout(world=spec.world, ranks_per_node=RANKS_PER_NODE,
                                                                       mp=tp, ep=ep)))
        config = transformer_config(spec, num_layers=2, gated_linear_unit=gated) if gated else \
            transformer_config(spec, num_layers=2)
        data = _batches(config.params_dtype, steps * accumulate, seed=11)
        if dense:                 # stock sequence-parallel linears all-gather into Megatron's global buffer
            from megatron.core import parallel_state
            if parallel_state._GLOBAL_MEMORY_BUFFER is None:
                parallel_state._set_global_memory_buffer()
                stack.callback(parallel_state.destroy_global_memory_buffer)
        for section in (None, {"defer_wgrad": True, "dense_wgrad": dense}):
            with mp.enable(_plugin(section, pipeline_degree, {"micro_op_mb": 0.001} if lina and section else None),
                           groups=groups, record_timeline=dense or lina) as handle:
                net = _parallel_net(config, 5, groups.pg_collection.tp) if dense else _net(config, seed=5)
                model = _ddp(config, net, groups.pg_collection, bucket_size=200)
                calls: Dict[str, int] = {}
                for n, p in model.module.named_parameters():
                    p.register_post_accumulate_grad_hook(lambda _p, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
                per_step = []
                for step in range(steps):
                    model.zero_grad_buffer()
                    for mb in range(accumulate):
                        calls.clear()
                        with model.no_sync() if mb < accumulate - 1 else nullcontext():
                            x, t = data[step * accumulate + mb]
                            F.mse_loss(model(x), t).backward()
                        if section is not None:
                            hooks.append(dict(calls))
                    model.finish_grad_sync()
                    per_step.append({n: (p.main_grad.clone(), getattr(p, "allreduce", True))
                                     for n, p in model.module.named_parameters()})
                runs.append(per_step)
                if section is not None:
                    lancet = handle.lancet
                    state = {"layers": list(lancet.layers), "queue_empty": lancet.queue.empty(),
                             "items_run": lancet.queue.items_run, "overlap_calls": sum(o.calls for o in lancet.overlaps),
                             "dense_deferred": lancet.dense.deferred if lancet.dense is not None else 0,
                             "dense_names": sorted({s.name for s in lancet.queue.timeline if s.tag == "dense"})
                             if lancet.queue.timeline is not None else []}
                    if lina:                   # micro-ops issued on the background lane of the layers' engine
                        state["micro_ops"] = sum(r.lane == "background" for r in handle.lina.timeline())
                        state["routed"] = handle.lina.routed
            if dense and section is not None:       # disable() put every wrapped layer back: Megatron's own GEMM
                state["restored"] = all("_forward_impl" not in m.__dict__ for m in list(net.up) + list(net.down))
    off, on = runs
    diffs = [{kind: max(float((a - on_step[n][0]).abs().max()) for n, (a, dense) in off_step.items()
                        if dense == (kind == "dense"))
              for kind in ("dense", "expert")} for off_step, on_step in zip(off, on)]
    return {"diffs": diffs, "hooks": hooks, "params": sorted(n for n, _ in on[0].items()), **state,
            "nonzero": {n: any(float(step[n][0].abs().max()) > 0 for step in on) for n in on[0]}}


def train_job(tp: int, ep: int, steps: int = 20) -> Dict[str, Any]:
    """fp32 Adam through Megatron's DDP (overlapped, small buckets), finalize_model_grads and optimizer: the losses
    with Lancet and without."""
    from moe_plugins.patches import megatron as mp
    spec = _spec(tp, ep, "float32")
    losses = {}
    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        groups = stack.enter_context(mp.megatron_groups(ParallelLayout(world=spec.world, ranks_per_node=RANKS_PER_NODE,
                                                                       mp=tp, ep=ep)))
        pgc, config = groups.pg_collection, transformer_config(spec, num_layers=2)
        data = (_batches(torch.float32, 4, seed=21) * steps)[:steps]
        for name, section in (("off", None), ("lancet", {})):
            with mp.enable(_plugin(section), groups=groups):
                model = _ddp(config, _net(config, seed=7), pgc, bucket_size=300)
                losses[name] = adam_steps(model, pgc, data, megatron_optimizer_on_cpu)
    return losses


def refused(section: Dict[str, Any]) -> List[str]:
    """The errors of enabling the plugin with ``section`` and of building a layer from the bare spec provider."""
    from moe_plugins.patches import megatron as mp
    out = []
    for attempt in (lambda: mp.enable(section).disable(),
                    lambda: mp.get_moe_module_spec(use_te=False, num_experts=4, plugin=section)):
        try:
            attempt()
        except ValueError as exc:
            out.append(str(exc))
        else:
            out.append("")
    return out
