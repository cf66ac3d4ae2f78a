"""Megatron-core's MoE layer as the recipes' MoE factory: HF GPT-2/BERT blocks whose MoE FFNs are Megatron-core
``MoELayer`` s (stock spec) or the plugin's ``PluginMoELayer`` (``moe_plugins.patches.megatron.get_moe_module_spec``),
built on the process groups of Megatron's ``parallel_state``, passed explicitly as a ``ProcessGroupCollection``.

Shapes: B batch, L sequence, M model dim, S = L / TP sequence positions of this TP rank.

Dense (non-MoE) layers stay plain HF modules, replicated on the ranks of a TP group: every TP rank computes them
on the whole sequence, so their gradients are equal there and Megatron's DDP reduces them over DP only. The MoE
layer runs Megatron's way: sequence parallel with TP > 1, each TP rank routing its slice of the sequence
(``scatter_to_sequence_parallel_region`` in, ``gather_from_sequence_parallel_region`` out, over the TP group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_plugins.core.plugin_config import PluginConfig

from moe_plugins.recipes.models import ModelSize, MoEFactory, moe_layer_indices

AUX_COEF = 0.01       # Megatron's load-balancing loss coefficient (the DeepSpeed recipes use the same)


@dataclass(frozen=True, kw_only=True)
class MegatronMoESettings:
    """What the factory needs besides the model size: the parallel degrees, the plugin (None: stock layers) and
    the ranks per node of the plugin's node-aware layout."""

    tp: int = 1
    ep: int = 1
    etp: int = 1
    plugin: Optional[PluginConfig] = None
    ranks_per_node: Optional[int] = None
    seed: int = 1234
    engines: Any = None          # the plugin's LayoutEngines (patches.megatron_engines), for pipelined layers


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's gelu_new."""
    return F.gelu(x, approximate="tanh")


def activation_of(expert: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation of the recipes' expert MLP (Linear, GELU, Linear) as a function for TransformerConfig."""
    act = expert[1] if isinstance(expert, nn.Sequential) and len(expert) == 3 else None
    if not isinstance(act, nn.GELU):
        raise ValueError(f"expert ({type(expert).__name__}) must be the recipes' Sequential(Linear, GELU, Linear)")
    return F.gelu if act.approximate == "none" else gelu_tanh


def transformer_config(size: ModelSize, settings: MegatronMoESettings, activation: Callable, *,
                       params_dtype: torch.dtype = torch.float32):
    """Megatron's TransformerConfig of one MoE layer of this model size (SequentialMLP experts, no biases,
    the alltoall dispatcher, capacity dropping at the size's capacity factor, aux loss on)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(
        num_layers=size.layers, hidden_size=size.hidden, num_attention_heads=size.heads, ffn_hidden_size=size.ffn,
        moe_ffn_hidden_size=size.ffn, num_moe_experts=size.experts, moe_router_topk=size.k,
        moe_router_pre_softmax=size.k == 1,                  # Megatron's rule for top-1
        moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=size.capacity_factor,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=AUX_COEF,
        moe_grouped_gemm=False, add_bias_linear=False, gated_linear_unit=False, activation_func=activation,
        tensor_model_parallel_size=settings.tp, expert_model_parallel_size=settings.ep,
        expert_tensor_parallel_size=settings.etp, sequence_parallel=settings.tp > 1,
        use_cpu_initialization=True, perform_initialization=True, params_dtype=params_dtype)


def moe_spec(size: ModelSize, settings: MegatronMoESettings) -> Any:
    """Megatron's own MoE spec, or the plugin's (same submodules, PluginMoELayer) when the plugin is on."""
    if settings.plugin is not None and settings.plugin.enabled:
        from moe_plugins.patches.megatron import get_moe_module_spec
        return get_moe_module_spec(use_te=False, num_experts=size.experts, plugin=settings.plugin,
                                   ranks_per_node=settings.ranks_per_node, engines=settings.engines)
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as stock
    return stock(use_te=False, num_experts=size.experts)


def init_experts(experts: nn.Module, config: Any, seed: int, layer_number: int, ep_rank: int, etp_rank: int) -> None:
    """Give every global expert its own initial weights. Megatron's CPU initialisation draws local experts from
    the global RNG, so expert i of every EP rank would start equal; here global expert g draws its full
    (unsharded) weights from a seed of (seed, layer, g) and keeps its expert-TP shard, as Megatron slices them."""
    local = experts.local_experts
    etp = config.expert_tensor_parallel_size
    for i, mlp in enumerate(local):
        g = ep_rank * len(local) + i
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed * 100_003 + layer_number * 1_009 + g)
            for linear, init, dim in ((mlp.linear_fc1, config.init_method, 0),
                                      (mlp.linear_fc2, config.output_layer_init_method, 1)):
                shape = list(linear.weight.shape)
                shape[dim] *= etp
                full = torch.empty(shape, dtype=linear.weight.dtype)
                init(full)
                linear.weight.copy_(full.chunk(etp, dim)[etp_rank])


class MegatronMoE(nn.Module):
    """A Megatron MoE layer behind the recipes' factory contract: ``forward(x_BLM) -> (y_BLM, aux, counts)``.

    Megatron's load-balancing loss reaches the gradients through its own ``MoEAuxLossAutoScaler`` (attached to
    the router's probabilities), so ``aux`` is zero here and ``counts`` None."""

    def __init__(self, layer: nn.Module, tp_group: Any, tp: int):
        from megatron.core.tensor_parallel import mappings
        super().__init__()
        self.layer, self.tp_group, self.tp = layer, tp_group, tp
        self._scatter = mappings.scatter_to_sequence_parallel_region
        self._gather = mappings.gather_from_sequence_parallel_region

    def forward(self, x_BLM: torch.Tensor):
        x_LBM = x_BLM.transpose(0, 1).contiguous()                 # Megatron is sequence-first
        x_SBM = self._scatter(x_LBM, group=self.tp_group) if self.tp > 1 else x_LBM
        y_SBM, bias = self.layer(x_SBM)
        if bias is not None:
            raise ValueError("Megatron's MoE layer returned a separate bias; the recipe builds it without biases")
        # the dense layers are replicated over TP, so the output's gradient is too: backward splits, not sums
        y_LBM = (self._gather(y_SBM, tensor_parallel_output_grad=False, group=self.tp_group) if self.tp > 1
                 else y_SBM)
        return y_LBM.transpose(0, 1), x_BLM.new_zeros(()), None


def megatron_moe_factory(size: ModelSize, settings: MegatronMoESettings, pg_collection: Any,
                         moe_layers: List[nn.Module]) -> MoEFactory:
    """The recipes' MoEFactory: each call builds the next MoE layer (numbered by its HF block, 1-based) from
    ``moe_spec`` on ``pg_collection``, and appends it to ``moe_layers``. The HF expert module handed in only
    tells the activation; Megatron builds its own experts."""
    from moe_plugins.patches.megatron_specs import build_layer
    numbers = [i + 1 for i in moe_layer_indices(size)]
    spec = moe_spec(size, settings)
    ep_rank, etp_rank = pg_collection.ep.rank(), pg_collection.expt_tp.rank()

    def factory(hidden: int, expert: nn.Module) -> nn.Module:
        if len(moe_layers) >= len(numbers):
            raise ValueError(f"the factory was called more often than the size has MoE layers ({len(numbers)})")
        number = numbers[len(moe_layers)]
        config = transformer_config(size, settings, activation_of(expert))
        layer = build_layer(spec, config, layer_number=number, pg_collection=pg_collection)
        layer.set_layer_number(number)         # the router tracks aux losses of numbered layers only
        init_experts(layer.experts, config, settings.seed, number, ep_rank, etp_rank)
        moe_layers.append(layer)
        return MegatronMoE(layer, pg_collection.tp, settings.tp)
    return factory


def plugin_summary(moe_layers: List[nn.Module]) -> Optional[List[dict]]:
    """One record per plugin MoE layer (schedule, exchange, pipeline degree, layout), as the DeepSpeed recipe reports;
    None when the layers are stock."""
    from moe_plugins.patches.megatron_layer import PluginMoELayer
    records = []
    for layer in moe_layers:
        if not isinstance(layer, PluginMoELayer):
            return None
        c, g = layer.config, layer.moe_groups.layout
        lancet = layer.token_dispatcher.lancet                  # Lancet's state: how many dense layers defer dW
        records.append({"layer": f"megatron.moe.{layer.layer_number}", "schedule": layer.plugin.schedule,
                        "exchange": type(layer.token_dispatcher.schedule).exchange_mode,
                        "dense_wgrad_layers": lancet.dense.deferred if lancet is not None and lancet.dense else 0,
                        "pipeline_degree": layer.plugin.pipeline_degree, "mp": c.tensor_model_parallel_size,
                        "ep": g.ep, "esp": g.esp, "num_experts": c.num_moe_experts, "k": c.moe_router_topk})
    return records or None
