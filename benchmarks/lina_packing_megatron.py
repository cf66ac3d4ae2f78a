"""The ``--host megatron`` ranks of benchmarks/lina_packing.py (run through that script, not on their own).

The model: Linear -> one MoE layer built by Megatron-core's own ``get_moe_module_spec`` (E = 8 ``SequentialMLP``
experts, top-2, capacity factor 1, expert biases, fp32, alltoall dispatcher) -> Linear head, MSE loss, in
Megatron's ``DistributedDataParallel(overlap_grad_reduce=True)`` under the CPU shims, stepped by
``get_megatron_optimizer``'s fp32 Adam (no clipping). A step is ``zero_grad_buffer``, forward, backward,
``finalize_model_grads`` and the optimizer step.

Rows, interleaved in rounds on the same processes: ``megatron`` (stock ``MoELayer``, built before the plugin is
enabled: Megatron's own dispatcher and DDP reduction), and one plugin model (``"lina": {"packing": 2, ...}``)
re-packed between rows by its controller's ``set_packing``: ``p=1``, ``p=2``, ``p=4`` (ep 4, 2, 1; its Adam
state moves with the experts). Then the plugin is disabled and a fresh plugin model with ``"packing": "auto"``
trains ``auto_steps`` steps (checks after steps 10, 14, 18, ...).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path


def rank_main_megatron(cfg: dict) -> None:
    import torch
    from lina_packing import host_result           # the bench script's folder is on sys.path
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from moe_plugins.core.layout import ParallelLayout
    from moe_plugins.patches import megatron as mp
    from moe_plugins.patches.megatron_cpu import megatron_on_cpu, megatron_optimizer_on_cpu
    from moe_plugins.tools.bench.ranks import slowest_seconds
    from moe_plugins.tools.verify_megatron import MegatronVerifySpec, transformer_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    m, h, e, s = cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["tokens"]
    spec = MegatronVerifySpec(world=world, ranks_per_node=cfg["ranks_per_node"], mp=1, ep=world, hidden=m, ffn=h,
                              experts=e, k=2, drop=True, capacity_factor=1.0, dtype="float32", tokens=s)
    gen = torch.Generator().manual_seed(rank)
    x_S1M = torch.randn(s, 1, m, generator=gen)
    t_S11 = torch.sin(x_S1M.sum(-1, keepdim=True))

    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        groups = stack.enter_context(mp.megatron_groups(ParallelLayout(world=world, ranks_per_node=cfg["ranks_per_node"],
                                                                       mp=1, ep=world)))
        pgc = groups.pg_collection
        config = transformer_config(spec)

        def model():
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
            from megatron.core.transformer.module import MegatronModule

            from moe_plugins.patches.megatron_specs import build_layer

            class Net(MegatronModule):
                def __init__(self):
                    super().__init__(config)
                    self.inp, self.head = nn.Linear(m, m), nn.Linear(m, 1)
                    self.moe = build_layer(get_moe_module_spec(use_te=False, num_experts=e), config,
                                           pg_collection=pgc)

                def forward(self, x, t):
                    h_S1M = self.inp(x)
                    y_S1M, _ = self.moe(h_S1M)
                    return F.mse_loss(self.head(torch.tanh(y_S1M + h_S1M)), t)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                net = Net()
            net.moe.set_layer_number(1)
            ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True), net,
                                          pg_collection=pgc)
            with megatron_optimizer_on_cpu():
                opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32,
                                                             clip_grad=0.0), [ddp], use_gloo_process_groups=False,
                                             pg_collection=pgc)
            return ddp, opt

        def step(row):
            from megatron.core.distributed import finalize_model_grads
            ddp, opt = row
            ddp.zero_grad_buffer()
            opt.zero_grad()
            ddp(x_S1M, t_S11).backward()
            finalize_model_grads([ddp], pg_collection=pgc)
            with megatron_optimizer_on_cpu():
                opt.step()

        def section(packing):
            return {"ranks_per_node": cfg["ranks_per_node"], "schedule": "baseline", "pipeline_degree": 1,
                    "lina": {"packing": packing, "micro_op_mb": 1}}

        stock = model()                                      # built before enable(): Megatron's own layer
        times = {name: [] for name in ("megatron", "p=1", "p=2", "p=4")}
        with mp.enable(section(2), groups=groups) as handle:
            plugin = model()
            packer = handle.lina.packing.packers[0]
            rows = {"megatron": (stock, None)} | {f"p={p}": (plugin, p) for p in (1, 2, 4)}
            local = {}
            for round_ in range(cfg["warmup"] + cfg["rounds"]):
                for name, (row, p) in rows.items():
                    if p is not None:
                        packer.controller.set_packing(p)
                    local[name] = row[0].module.moe.num_local_experts
                    took = slowest_seconds(lambda: [step(row) for _ in range(cfg["iters"])]) / cfg["iters"]
                    if round_ >= cfg["warmup"]:
                        times[name].append(took)
        with mp.enable(section("auto"), groups=groups) as handle:
            auto = model()
            controller = handle.lina.packing.packers[0].controller
            result = host_result(times, local, controller, lambda: step(auto), cfg["auto_steps"])
    if rank == 0:
        Path(cfg["result"]).write_text(json.dumps(result))
    dist.destroy_process_group()
