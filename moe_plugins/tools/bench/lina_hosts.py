"""The host rows of the training-step contention bench: the step's network trained through the real hosts.

- ``deepspeed`` / ``deepspeed@lina,kib=N`` (or ``mb=X``): the network with DeepSpeed's own MoE layers
  (``deepspeed.moe.layer.MoE``, ep_size = world, deterministic gating: no RTS, no second-expert sampling)
  under ``deepspeed.initialize`` (ZeRO 0, fp32, gloo on CPU) with the plugin enabled (schedule ``baseline``);
  ``@lina`` adds ``"lina": {"micro_op_mb": ...}`` to the ``moe_plugins`` section. A step is
  ``loss = engine(x, g)`` and ``engine.backward(loss)``: DeepSpeed's backward ends in its epilogue's
  ``allreduce_gradients`` (ZeRO 0: ``_reduce_non_expert_gradients``, one flat all-reduce of the dense
  gradients; with Lina it waits for Lina's micro-ops instead), so the step's time includes the reduction
  finished. No optimizer step (as in the core rows); the gradients are zeroed before each step.
- ``megatron`` / ``megatron@lina,kib=N``: the network with the plugin's MoE layers built through Megatron-core's
  ``get_moe_module_spec`` (``moe_plugins.patches.megatron.enable``, CPU shims), in Megatron's
  ``DistributedDataParallel(overlap_grad_reduce=True)`` (``bucket_mb=X``: its bucket size; default Megatron's),
  stock reduction or Lina's. A step is ``zero_grad_buffer``, forward, backward, ``finish_grad_sync``.

Same shapes, weights and tokens as the core rows: dense pairs, gates and this rank's experts are copied from the
context's :class:`~moe_plugins.tools.bench.lina_step.StepNet` (Megatron's router gets no bias). Megatron's
router picks the same experts with the same weights (k > 1: softmax over the top-k logits), but drops over
capacity by probability, not by position, and its switch aux loss (coefficient 0.01, through its auto-scaler)
is not the core's: its network is the closest Megatron one, not the same. Its gradients are compared with the
``megatron`` row's (``megatron@lina``), not with ``sync``'s (trial, 2 x 2 ranks: 4e-3 of 21 with f = 4, where
nothing is dropped; 1.8 with f = 1).
DeepSpeed's gate (top-2 over the softmax, renormalised; drops by position) is the core's; its averaged
gradients are multiplied by the DP size to compare with ``sync``'s sums.

Bytes: NIC bytes as every row. Model bytes come from each host's ledger, which holds the plugin's exchanges and
Lina's micro-ops; a stock host's own all-reduce (DeepSpeed's, Megatron DDP's) is not an engine op, so the stock
host rows' model bytes and reduce ms leave it out (their NIC bytes include it).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.ledger import CommLedger
from moe_plugins.tools.bench.lina_plan import MB, StepRowSpec, bucket_bytes_of, micro_op_bytes_of
from moe_plugins.tools.bench.lina_step import AUX_COEF, StepContext, StepRow


def lina_section(spec: StepRowSpec) -> Optional[Dict[str, Any]]:
    """The row's ``lina`` section (None: stock), its micro-op size from ``kib=`` / ``mb=``. Lina truncates
    ``micro_op_mb * 10^6`` to bytes; half a byte more keeps the size exact through the float."""
    if spec.option("lina") is None:
        return None
    return {"micro_op_mb": (micro_op_bytes_of(spec) + 0.5) / MB}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]).detach().clone()


# ---- DeepSpeed -------------------------------------------------------------------------------------------------

class DeepSpeedStepNet(nn.Module):
    """The step's network with DeepSpeed's MoE layers, holding the StepNet's weights; forward returns the loss."""

    def __init__(self, ctx: StepContext):
        from deepspeed.moe.layer import MoE
        super().__init__()
        cfg = ctx.net.moe[0].config
        m, h = cfg.hidden, cfg.ffn
        self.dense = copy.deepcopy(ctx.net.dense)
        expert = nn.Sequential(nn.Linear(m, h), nn.GELU(), nn.Linear(h, m))
        self.moe = nn.ModuleList(
            MoE(hidden_size=m, expert=expert, num_experts=cfg.num_experts, ep_size=dist.get_world_size(), k=cfg.k,
                capacity_factor=cfg.capacity_factor, eval_capacity_factor=cfg.capacity_factor, min_capacity=0,
                drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)
            for _ in ctx.net.moe)
        with torch.no_grad():
            for ds, core in zip(self.moe, ctx.net.moe):
                ds.deepspeed_moe.gate.wg.weight.copy_(core.wg_EM)
                for j, mod in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):   # this rank's experts
                    mod[0].weight.copy_(core.w1_EMH[j].t())
                    mod[0].bias.copy_(core.b1_EH[j])
                    mod[2].weight.copy_(core.w2_EHM[j].t())
                    mod[2].bias.copy_(core.b2_EM[j])

    def forward(self, x_SM: torch.Tensor, g_SM: torch.Tensor) -> torch.Tensor:
        aux = x_SM.new_zeros(())
        for dense, moe in zip(self.dense, self.moe):
            x_SM = x_SM + dense(x_SM)
            y_SM, a, _ = moe(x_SM)
            x_SM, aux = x_SM + y_SM, aux + a
        return ((x_SM + self.dense[-1](x_SM)) * g_SM).sum() + AUX_COEF * aux

    def dense_grads(self) -> torch.Tensor:
        """The dense gradients in StepNet's order: the dense pairs, then the gates."""
        params = list(self.dense.parameters()) + [moe.deepspeed_moe.gate.wg.weight for moe in self.moe]
        return _flat(p.grad for p in params)


def _deepspeed_ledger(ctx: StepContext) -> CommLedger:
    """One plugin enable (and its ledger) for every DeepSpeed row: each engine's section decides its schedule and
    Lina. Undone, with DeepSpeed's group registries, when the run ends."""
    if "deepspeed" not in ctx.hosts:
        import moe_plugins
        from moe_plugins.patches.deepspeed_host import init_deepspeed_comm
        from moe_plugins.tools.verify_deepspeed import deepspeed_groups
        init_deepspeed_comm()
        ledger = CommLedger()
        ctx.host_stack.enter_context(deepspeed_groups(None))
        ctx.host_stack.enter_context(moe_plugins.enable(ledger=ledger))
        ctx.hosts["deepspeed"] = ledger
    return ctx.hosts["deepspeed"]


def build_deepspeed(spec: StepRowSpec, ctx: StepContext) -> StepRow:
    import deepspeed
    ledger = _deepspeed_ledger(ctx)
    section: Dict[str, Any] = {"schedule": "baseline"}
    lina = lina_section(spec)
    if lina is not None:
        section["lina"] = lina
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "Adam", "params": {"lr": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": 0}, "moe_plugins": section}
    net = DeepSpeedStepNet(ctx)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    ctx.host_stack.callback(engine.destroy)
    world = dist.get_world_size()

    def step() -> None:
        net.zero_grad(set_to_none=True)
        engine.backward(engine(ctx.x_SM, ctx.g_SM))

    notes = ("deepspeed.initialize, ZeRO 0, DeepSpeed MoE layers swapped by the plugin (schedule baseline); "
             "timed: engine(x) + engine.backward(loss), which ends in DeepSpeed's allreduce_gradients; no optimizer "
             "step",
             f"Lina micro-ops of {int(lina['micro_op_mb'] * MB)} B" if lina else
             "stock reduction: DeepSpeed's own all-reduce, not in the ledger (model bytes and reduce ms leave it out)")
    return StepRow(spec.label, spec.name, step, notes, grads=lambda: net.dense_grads() * world,
                   timeline=ledger.records)


# ---- Megatron-core ----------------------------------------------------------------------------------------------

def _megatron_groups(ctx: StepContext) -> Any:
    """The CPU shims and Megatron groups of the step's layout (MP 1, EP = world), shared by the Megatron rows."""
    if "megatron_groups" not in ctx.hosts:
        from moe_plugins.patches import megatron as mp
        from moe_plugins.patches.megatron_cpu import megatron_on_cpu
        layout = ctx.groups.layout
        ctx.host_stack.enter_context(megatron_on_cpu())
        ctx.hosts["megatron_groups"] = ctx.host_stack.enter_context(
            mp.megatron_groups(ParallelLayout(world=layout.world, ranks_per_node=layout.ranks_per_node, mp=1,
                                              ep=layout.world)))
    return ctx.hosts["megatron_groups"]


def megatron_config(ctx: StepContext) -> Any:
    """Megatron's TransformerConfig of the step's MoE layers: fp32, drop at capacity f, expert biases, aux loss
    coefficient 0.01, no z-loss."""
    from moe_plugins.tools.verify_megatron import MegatronVerifySpec, transformer_config
    cfg = ctx.net.moe[0].config
    spec = MegatronVerifySpec(world=dist.get_world_size(), ranks_per_node=ctx.groups.layout.ranks_per_node, mp=1,
                              ep=dist.get_world_size(), hidden=cfg.hidden, ffn=cfg.ffn, experts=cfg.num_experts,
                              k=cfg.k, drop=True, capacity_factor=cfg.capacity_factor, dtype="float32",
                              tokens=ctx.x_SM.shape[0])
    return transformer_config(spec, num_layers=len(ctx.net.moe), moe_aux_loss_coeff=AUX_COEF, moe_z_loss_coeff=None)


def megatron_step_net(ctx: StepContext, config: Any) -> nn.Module:
    """The step's network in Megatron's [s, b=1, M] layout, its MoE layers from Megatron's own
    ``get_moe_module_spec`` (the plugin's while it is enabled), holding the StepNet's weights; returns the loss."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.module import MegatronModule

    from moe_plugins.patches.megatron_specs import build_layer

    class MegatronStepNet(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.dense = copy.deepcopy(ctx.net.dense)
            self.moe = nn.ModuleList(build_layer(get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts),
                                                 config) for _ in ctx.net.moe)

        def forward(self, x_S1M: torch.Tensor, g_S1M: torch.Tensor) -> torch.Tensor:
            for dense, moe in zip(self.dense, self.moe):
                x_S1M = x_S1M + dense(x_S1M)
                y_S1M, _ = moe(x_S1M)
                x_S1M = x_S1M + y_S1M
            return ((x_S1M + self.dense[-1](x_S1M)) * g_S1M).sum()

    net = MegatronStepNet()
    with torch.no_grad():
        for i, (layer, core) in enumerate(zip(net.moe, ctx.net.moe)):
            layer.set_layer_number(i + 1)
            layer.router.weight.copy_(core.wg_EM)
            layer.router.bias = None        # add_bias_linear (for the experts' biases) gives the router one too
            for j, mlp in enumerate(layer.experts.local_experts):                   # this rank's experts
                mlp.linear_fc1.weight.copy_(core.w1_EMH[j].t())
                mlp.linear_fc1.bias.copy_(core.b1_EH[j])
                mlp.linear_fc2.weight.copy_(core.w2_EHM[j].t())
                mlp.linear_fc2.bias.copy_(core.b2_EM[j])
    return net


def _megatron_model(ctx: StepContext, spec: StepRowSpec, ledger: CommLedger) -> Any:
    """Enable the plugin (with the row's Lina section), build the network and Megatron's DDP over it. With Lina
    the plugin stays enabled until the run ends (its engine and DDP patches live as long); stock: disabled at once
    (the layers built keep running), so that a Lina row can enable it after."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from moe_plugins.patches import megatron as mp
    groups = _megatron_groups(ctx)
    lina = lina_section(spec)
    # the padded exchange, as every other row of this bench runs (Megatron's default would be the ragged one)
    section: Dict[str, Any] = {"schedule": "baseline", "pipeline_degree": 1, "exchange": "padded",
                               **({"lina": lina} if lina else {})}
    bucket = bucket_bytes_of(spec)
    handle = mp.enable(section, groups=groups, ranks_per_node=ctx.groups.layout.ranks_per_node, ledger=ledger)
    try:
        config = megatron_config(ctx)
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=bucket // 4 or None)
        model = DistributedDataParallel(config, ddp_config, megatron_step_net(ctx, config),
                                        pg_collection=groups.pg_collection)
    finally:
        if lina is None:
            handle.disable()
    if lina is not None:
        ctx.host_stack.callback(handle.disable)
    return model


def build_megatron(spec: StepRowSpec, ctx: StepContext) -> StepRow:
    """Stock: built now. Lina: built at its first step (the check round), after every stock Megatron row, since
    one Megatron plugin is enabled at a time and a Lina one must stay enabled."""
    ledger = CommLedger()
    built: Dict[str, Any] = {}
    if lina_section(spec) is None:
        built["model"] = _megatron_model(ctx, spec, ledger)
    x_S1M, g_S1M = ctx.x_SM.unsqueeze(1), ctx.g_SM.unsqueeze(1)

    def step() -> None:
        if "model" not in built:
            built["model"] = _megatron_model(ctx, spec, ledger)
        model = built["model"]
        model.zero_grad_buffer()
        model(x_S1M, g_S1M).backward()
        model.finish_grad_sync()

    bucket = bucket_bytes_of(spec)
    lina = lina_section(spec)
    notes = ("Megatron-core DistributedDataParallel(overlap_grad_reduce=True"
             + (f", bucket_size={bucket // 4} elements" if bucket else ", Megatron's default bucket size")
             + ") over the plugin's MoE layers (schedule baseline); timed: zero_grad_buffer, forward, backward, "
             "finish_grad_sync; no optimizer step",
             "Megatron's router and capacity rule (drops by probability; its switch aux loss): gradients compared "
             "with the megatron row's, not sync's" if lina else "Megatron's router and capacity rule (drops by "
             "probability; its switch aux loss): gradients not compared with sync's",
             f"Lina micro-ops of {int(lina['micro_op_mb'] * MB)} B" if lina else
             "stock reduction: Megatron DDP's own all-reduce, not in the ledger (model bytes and reduce ms leave it "
             "out)")

    def grads():
        net = built["model"].module
        params = list(net.dense.parameters()) + [layer.router.weight for layer in net.moe]
        return _flat(p.main_grad for p in params) * dist.get_world_size()
    return StepRow(spec.label, spec.name, step, notes, grads=grads, timeline=ledger.records,
                   compare_with="megatron" if lina else None)
