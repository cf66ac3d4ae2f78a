"""Hecate (FSSDP, schedule ``hecate``) on Megatron-core: what the plugin's Megatron MoE layer (patches/megatron_layer.py)
needs to run it. Pure helpers; nothing here patches anything.

- :func:`hecate_plugin`: with an enabled ``hecate`` section (or ``"schedule": "hecate"``), the section as the layer
  runs it: schedule ``hecate``, the ragged exchange.
- :func:`expert_problems`: Hecate copies experts from their two GEMMs' weights, so the layer's experts must be
  Megatron's ``SequentialMLP`` of plain MLPs: ``linear_fc1`` -> ``activation_func`` (GELU exact or tanh, ReLU or
  SiLU, not gated, unfused: ``bias_activation_fusion`` computes GELU's tanh form) -> ``linear_fc2``, with or without biases
  (``add_bias_linear``; fc2's bias added before the routing weight, as Megatron's SequentialMLP adds it). A refusal
  names the setting.
- :func:`hecate_class`: the schedule configured with the section's options and the experts' activation.
- :func:`stacked_weights`: ``LayerParams.expert_weights`` per call, the local experts' weights transposed and
  stacked with their biases (zeros where there are none), built from the parameters themselves so that each gets its gradient once per backward
  (Megatron DDP's hooks, ``main_grad``, as in stock), and stacked again without autograd for re-materialisation.

Owners are Megatron's own expert parameters (expert e on EP rank e // E_l, as Megatron places them), so
``state_dict`` keys and ``dist_checkpointing`` stay stock. Re-sharding (``reshard_every``):
:mod:`~moe_plugins.patches.megatron_hecate_reshard`.

Shapes: E_l local experts, M model dim, H FFN hidden.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Type

import torch
import torch.nn.functional as F

from moe_plugins.core.experts import ACTIVATIONS as CORE_ACTIVATIONS
from moe_plugins.core.plugin_config import SECTION, PluginConfig
from moe_plugins.core.schedule import Schedule
from moe_plugins.hecate.config import NAME, hecate_on
from moe_plugins.hecate.remat import RereadableWeights, stacked_ffn
from moe_plugins.plugins import default_registry

ACTIVATIONS = {F.gelu: "gelu", F.relu: "relu", F.silu: "silu"}     # Megatron's activation_func -> the copies'
_PROBE = torch.linspace(-6.0, 6.0, 121, dtype=torch.float64)


def hecate_plugin(plugin: PluginConfig) -> PluginConfig:
    """``plugin`` as the Megatron layer runs it: with Hecate on, schedule ``hecate`` and the ragged exchange."""
    return replace(plugin, schedule=NAME, exchange="ragged") if hecate_on(plugin) else plugin


def activation_name(config: Any) -> Optional[str]:
    """The copies' activation for Megatron's ``activation_func`` (None: one Hecate's copies do not compute):
    ``F.gelu``, ``F.relu``, ``F.silu``, or a function named after one of the copies' activations (``gelu_tanh``,
    as the recipes' GPT-2 passes) that computes it, checked on a probe."""
    fn = getattr(config, "activation_func", None)
    if fn in ACTIVATIONS:
        return ACTIVATIONS[fn]
    name = getattr(fn, "__name__", None)
    if name in CORE_ACTIVATIONS and torch.equal(fn(_PROBE), CORE_ACTIVATIONS[name](_PROBE)):
        return name
    return None


def expert_problems(config: Any, experts: torch.nn.Module, name: str) -> List[str]:
    """Why Hecate cannot copy this Megatron layer's experts (empty when it can)."""
    where = f"{SECTION}.{NAME} on Megatron MoE layer {name}"
    problems = []
    if type(experts).__name__ != "SequentialMLP" or not hasattr(experts, "local_experts"):
        problems.append(f"{where}: its experts are a {type(experts).__name__}; Hecate copies SequentialMLP experts "
                        "only (moe_grouped_gemm off)")
    if activation_name(config) is None:
        fn = getattr(config, "activation_func", None)
        problems.append(f"{where}: activation_func ({getattr(fn, '__name__', fn)!r}) must be F.gelu, F.relu, F.silu "
                        "or a function named gelu_tanh that computes GELU's tanh form (the copies' activations)")
    for flag in ("gated_linear_unit", "bias_activation_fusion", "use_te_activation_func"):
        if getattr(config, flag, False):
            problems.append(f"{where}: {flag} ({getattr(config, flag)!r}) must be False: Hecate's copies compute "
                            "Linear -> activation -> Linear, unfused and not gated")
    return problems


def hecate_class(plugin: PluginConfig, cls: Type[Schedule], config: Any) -> Type[Schedule]:
    """``cls`` configured with the ``hecate`` section's options and Megatron's activation when it is Hecate's
    schedule (after :func:`expert_problems`), else ``cls``."""
    if cls.name != NAME:
        return cls
    hecate = default_registry().schedule_class(NAME)
    return hecate.configured(hecate.from_section(plugin.hecate).options, activation=activation_name(config))


def stacked_weights(mlps: Sequence[torch.nn.Module], like: Optional[torch.nn.Module] = None) -> RereadableWeights:
    """Local experts (a ``SequentialMLP``'s ``local_experts``, or the pooled slots holding a layer's experts) as
    ExpertWeights (module docstring): ``linear_fc1`` and ``linear_fc2``'s weights (H, M) and (M, H) and their
    biases. No experts (pooled slots): empty stacks shaped as the MLP ``like``."""
    return stacked_ffn([mlp.linear_fc1 for mlp in mlps], [mlp.linear_fc2 for mlp in mlps],
                       None if like is None else (like.linear_fc1, like.linear_fc2))


def layer_weights(experts: torch.nn.Module,
                  pooled: Optional[Callable[[], Optional[Sequence[torch.nn.Module]]]] = None) -> RereadableWeights:
    """A layer's local experts as ExpertWeights: its ``SequentialMLP``'s, or with Hecate's pooled slots the
    modules holding its experts on this rank (``pooled()``; None until the pool exists)."""
    own = list(experts.local_experts)
    mlps = pooled() if pooled is not None else None
    return stacked_weights(own) if mlps is None else stacked_weights(mlps, like=own[0])


def sections() -> Dict[str, Any]:
    """The ``hecate`` section's rules as the Megatron adapter reads them (for its ``config_choices``)."""
    from moe_plugins.hecate.config import host_rules
    return {NAME: host_rules("megatron")}
