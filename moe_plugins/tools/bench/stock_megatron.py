"""The stock Megatron-core layer as a benchmark row: ``megatron.core.transformer.moe.moe_layer.MoELayer``
(SequentialMLP experts, local spec, alltoall dispatcher by default), run as is on CPU under the test-only
shims of :mod:`.megatron_cpu_shims`, entered around construction and around every step.

Made comparable with the project's layer and DeepSpeed's: the same E, k, f, M, H, tokens and EP; the same
weights; ``moe_token_drop_policy="position"`` with ``moe_pad_expert_input_to_capacity=True`` (capacity-sized
buffers, as in DeepSpeed); the gate's bias (Megatron adds one with ``add_bias_linear``) set to zero, as
the other gates have none; the GShard aux loss with coefficient 0.01 (Megatron adds it through its own
autograd hook, so the row returns a zero aux loss to the runner). Known differences that remain: Megatron
has no ``min_capacity``; it orders capacity positions by token only (DeepSpeed and the core place all first
choices before second choices), and does not renormalise the gates of a token that lost a route, so
with drops the outputs differ on the dropped tokens; the runner reports the difference.

With MP > 1 Megatron requires sequence parallelism to train an MoE layer, so each MP rank feeds its own
1/MP of the block's tokens (the other rows see the whole block on every MP rank); the output is compared
on that slice.

Process groups travel explicitly in a ``ProcessGroupCollection`` built from the case's groups (no
``parallel_state`` globals): tp = MP, ep = EP, expt_tp = ESP, tp_ep = fused EP&ESP, expt_dp = expert-DP.
Megatron calls ``.size()`` on every group, so size-1 groups are this rank's singleton group.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_plugins.core.experts import ffn_shard, local_experts
from moe_plugins.core.groups import Group, MoEProcessGroups
from moe_plugins.tools.bench.matrix import RowSpec
from moe_plugins.patches.megatron_cpu import megatron_on_cpu
from moe_plugins.tools.bench.case import AUX_COEF, CaseData, Row
from moe_plugins.tools.bench.traffic import CollectiveCounter


def singleton_groups(world: int, rank: int) -> dist.ProcessGroup:
    """Collective over the default group: one group per rank; returns this rank's."""
    mine: Optional[dist.ProcessGroup] = None
    for r in range(world):
        pg = dist.new_group([r])
        if r == rank:
            mine = pg
    return mine


def pg_collection(groups: MoEProcessGroups, singleton: dist.ProcessGroup):
    from megatron.core.process_groups_config import ProcessGroupCollection

    def pg(group: Group):
        return group.pg if group.pg is not None else singleton
    pgc = ProcessGroupCollection()
    pgc.tp, pgc.cp, pgc.tp_cp = pg(groups.mp), singleton, pg(groups.mp)
    pgc.ep, pgc.expt_tp, pgc.tp_ep, pgc.expt_dp = pg(groups.ep), pg(groups.esp), pg(groups.ep_esp), pg(groups.expert_dp)
    pgc.dp, pgc.dp_cp = pg(groups.dp), pg(groups.dp)
    pgc.tp_dp_cp = dist.group.WORLD
    return pgc


def transformer_config(data: CaseData, dispatcher: str):
    from megatron.core.transformer.transformer_config import TransformerConfig
    case, g = data.case, data.groups
    return TransformerConfig(
        num_layers=1, hidden_size=case.hidden, num_attention_heads=g.mp.size, ffn_hidden_size=case.ffn,
        moe_ffn_hidden_size=case.ffn, num_moe_experts=case.experts, moe_router_topk=case.k,
        moe_router_pre_softmax=case.k == 1,          # Megatron's rule for top-1
        moe_token_dispatcher_type=dispatcher,
        moe_expert_capacity_factor=case.capacity_factor if case.drop_tokens else None,
        moe_pad_expert_input_to_capacity=case.drop_tokens, moe_token_drop_policy="position",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=AUX_COEF,
        moe_grouped_gemm=False, add_bias_linear=True, gated_linear_unit=False, activation_func=F.gelu,
        tensor_model_parallel_size=g.mp.size, expert_model_parallel_size=g.ep.size,
        expert_tensor_parallel_size=g.esp.size, sequence_parallel=g.mp.size > 1,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=data.dtype,
        bf16=data.dtype == torch.bfloat16)


@torch.no_grad()
def _load(layer, data: CaseData) -> None:
    g, case = data.groups, data.case
    coords = g.layout.coords(g.global_rank)
    layer.router.weight.copy_(data.wg_EM)
    if layer.router.bias is not None:      # add_bias_linear also gives Megatron's gate a bias; the others have none
        layer.router.bias.zero_()
    experts = range(case.experts)[local_experts(coords["ep"], case.experts, g.ep.size)]
    h = ffn_shard(coords["esp"], case.ffn, g.esp.size)
    for mlp, e in zip(layer.experts.local_experts, experts):
        mlp.linear_fc1.weight.copy_(data.full.w1_EMH[e][:, h].t())
        mlp.linear_fc1.bias.copy_(data.full.b1_EH[e][h])
        mlp.linear_fc2.weight.copy_(data.full.w2_EHM[e][h, :].t())
        mlp.linear_fc2.bias.copy_(data.full.b2_EM[e])


def build_megatron_row(spec: RowSpec, data: CaseData) -> Row:
    singleton = data.extras.get("singleton")
    if singleton is None:
        raise ValueError("megatron row: the case has no singleton group (the runner makes one per run)")
    with megatron_on_cpu():
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from moe_plugins.patches.megatron_specs import spec_submodules
        config = transformer_config(data, spec.option("dispatcher", "alltoall"))
        module_spec = get_moe_module_spec(use_te=False, num_experts=data.case.experts, moe_grouped_gemm=False)
        layer = MoELayer(config, submodules=spec_submodules(module_spec),
                         pg_collection=pg_collection(data.groups, singleton))
        _load(layer, data)
    zero = torch.zeros(())

    def forward(x_SM: torch.Tensor):
        y_S1M, _ = layer(x_SM.unsqueeze(1))          # Megatron's layout: [sequence, batch, hidden]
        return y_S1M.squeeze(1), zero

    mp = data.groups.mp
    tokens = None
    if mp.size > 1:           # sequence parallel: this MP rank feeds its 1/MP of the block's tokens
        if data.case.tokens % mp.size:
            raise ValueError(f"megatron row: S ({data.case.tokens}) must be divisible by mp ({mp.size}) "
                             f"(Megatron trains MoE with TP only under sequence parallelism)")
        n = data.case.tokens // mp.size
        tokens = slice(mp.rank * n, (mp.rank + 1) * n)
    return Row(label=spec.label, kind="stock", module=layer, forward=forward,
               meter=CollectiveCounter(layout=data.groups.layout, rank=data.groups.global_rank),
               scope=megatron_on_cpu, tokens=tokens)
