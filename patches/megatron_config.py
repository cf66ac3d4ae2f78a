"""What the Megatron adapter reads from Megatron's settings, and every reason it cannot run them: pure functions,
no Megatron import, no process group.

Megatron's settings come in two spellings that share field names: a ``TransformerConfig`` (the layer sees it)
and a Megatron-LM ``argparse.Namespace`` (training scripts). Each is translated once, at the boundary, into
:class:`MegatronFacts`; :func:`plugin_problems` checks the facts against a :class:`PluginConfig` and a world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from moe_plugins.core.config import MoEConfig, moe_config_problems
from moe_plugins.core.experts import ACTIVATIONS
from moe_plugins.core.layout import ParallelLayout, layout_problems
from moe_plugins.core.plugin_config import SECTION, PluginConfig, profile_problems
from moe_plugins.core.schedule import exchange_problems
from moe_plugins.hecate.config import NAME as HECATE, reshard_interval
from moe_plugins.plugins import default_registry

DISPATCHERS = ("alltoall", "allgather")

# Megatron features the adapter refuses, as (field, value that is fine, why). The field names are those of
# TransformerConfig, which Megatron-LM's arguments share.
UNSUPPORTED: Tuple[Tuple[str, Any, str], ...] = (
    ("pipeline_model_parallel_size", 1, "the plugin's layout has no PP axis"),
    ("context_parallel_size", 1, "the plugin's layout has no CP axis"),
    ("moe_shared_expert_overlap", False, "the shared experts' overlap lives inside Megatron's alltoall dispatcher, "
                                         "which the plugin replaces"),
    ("overlap_moe_expert_parallel_comm", False, "Megatron's EP-overlap schedule cuts the graph between the stage "
                                                "methods, while a schedule keeps its routing from dispatch to combine"),
    ("moe_apply_probs_on_input", False, "the schedules apply the routing weights at the combine, after the expert"),
    ("moe_router_padding_for_quantization", False, "padded routing maps are an FP8/FP4 kernel detail"),
    ("cuda_graph_impl", "none", "a schedule reads its capacities on the host, which CUDA graphs cannot capture"),
    # megatron-core 0.19.2 (absent in 0.16.1, read as off there): its events span MoELayer.dispatch and the
    # expert stage of Megatron's own dispatcher, which the plugin replaces
    ("overlap_dispatch_backward_with_experts_wgrad", False, "Megatron's delayed expert wgrad is keyed to its own "
                                                            "dispatch and expert stages, which the plugin replaces"),
)

# Router options that draw random numbers: the baseline schedule re-gates its ESP group's token blocks, which
# must give the routing their owners drew.
RANDOM_ROUTING = ("moe_input_jitter_eps", "moe_router_force_load_balancing", "moe_enable_routing_replay")


@dataclass(frozen=True, kw_only=True)
class MegatronFacts:
    """The settings of one Megatron MoE layer that the adapter depends on."""

    tp: int
    ep: int
    etp: int
    num_experts: Optional[int]
    hidden: int
    ffn: int
    topk: int
    capacity_factor: Optional[float]
    dispatcher: str
    activation: str
    unsupported: Tuple[Tuple[str, Any], ...]   # (field, value) of every UNSUPPORTED field, in that order
    random_routing: Tuple[str, ...]            # RANDOM_ROUTING options that are on
    bias_sp: bool = False                      # add_bias_linear and sequence_parallel both on


def _unsupported(source: Any) -> Tuple[Tuple[str, Any], ...]:
    return tuple((name, getattr(source, name, fine)) for name, fine, _ in UNSUPPORTED)


def _random_routing(source: Any) -> Tuple[str, ...]:
    return tuple(name for name in RANDOM_ROUTING if getattr(source, name, None) not in (None, False))


def _bias_sp(source: Any) -> bool:
    return getattr(source, "add_bias_linear", True) is True and getattr(source, "sequence_parallel", False) is True


def _activation_name(fn: Any) -> str:
    name = getattr(fn, "__name__", "")
    return name if name in ACTIVATIONS else "gelu"     # informational: Megatron's own experts compute


def config_choices() -> Dict[str, Any]:
    """``default_registry().config_choices()`` with the ``lancet`` section and the
    ``hecate`` section checked as the Megatron adapter runs them: ``PluginConfig.from_dict(section,
    **config_choices())``."""
    from moe_plugins.lancet.config import NAME, host_rules
    from moe_plugins.patches.megatron_hecate import sections
    choices = default_registry().config_choices()
    return {**choices, "sections": {**choices["sections"], NAME: host_rules("megatron"), **sections()}}


def section_config(section: Mapping[str, Any], path: str) -> PluginConfig:
    """The Megatron adapter's PluginConfig of a ``moe_plugins`` section. A section that names no ``exchange``
    gets Megatron's own flow, the ragged exchange, where its schedule and options allow it (docs/megatron.md,
    "Expert rows": stock Megatron's experts multiply the kept rows only), else the padded one; every problem of
    the section as written is reported against it."""
    written = PluginConfig.from_dict(section, path, **config_choices())
    if "exchange" in section or not written.enabled or written.schedule not in default_registry().schedule_names():
        return written
    if exchange_problems(default_registry().schedule_class(written.schedule), "ragged", written.pipeline_degree):
        return written
    try:
        return PluginConfig.from_dict({**section, "exchange": "ragged"}, path, **config_choices())
    except ValueError:          # a section refusing the ragged exchange (Lancet's defer_wgrad): the padded one
        return written


def facts_from_config(config: Any) -> MegatronFacts:
    """From a ``TransformerConfig`` (after its ``__post_init__``, which fills expert-TP and the MoE FFN size)."""
    return MegatronFacts(
        tp=int(config.tensor_model_parallel_size), ep=int(config.expert_model_parallel_size),
        etp=int(config.expert_tensor_parallel_size or config.tensor_model_parallel_size),
        num_experts=config.num_moe_experts, hidden=int(config.moe_latent_size or config.hidden_size),
        ffn=int(config.moe_ffn_hidden_size or config.ffn_hidden_size), topk=int(config.moe_router_topk),
        capacity_factor=config.moe_expert_capacity_factor, dispatcher=str(config.moe_token_dispatcher_type),
        activation=_activation_name(config.activation_func), unsupported=_unsupported(config),
        random_routing=_random_routing(config), bias_sp=_bias_sp(config))


def facts_from_args(args: Any) -> MegatronFacts:
    """From Megatron-LM's parsed arguments (``args.num_experts`` is the config's ``num_moe_experts``)."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    ffn = getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "ffn_hidden_size", None) or 0
    return MegatronFacts(
        tp=tp, ep=int(getattr(args, "expert_model_parallel_size", 1) or 1),
        etp=int(getattr(args, "expert_tensor_parallel_size", None) or tp),
        num_experts=getattr(args, "num_experts", None),
        hidden=int(getattr(args, "moe_latent_size", None) or getattr(args, "hidden_size", 0) or 0), ffn=int(ffn),
        topk=int(getattr(args, "moe_router_topk", 2)),
        capacity_factor=getattr(args, "moe_expert_capacity_factor", None),
        dispatcher=str(getattr(args, "moe_token_dispatcher_type", "allgather")), activation="gelu",
        unsupported=_unsupported(args), random_routing=_random_routing(args), bias_sp=_bias_sp(args))


def moe_config(facts: MegatronFacts) -> MoEConfig:
    """The core's view of the layer. Routing stays Megatron's: capacity and dropping are decided by its router."""
    return MoEConfig(hidden=facts.hidden, ffn=facts.ffn, num_experts=int(facts.num_experts), k=facts.topk,
                     capacity_factor=facts.capacity_factor or 1.0, min_capacity=0,
                     drop_tokens=facts.capacity_factor is not None, activation=facts.activation)


def token_layout(facts: MegatronFacts, world: int, ranks_per_node: int) -> ParallelLayout:
    """The layout a schedule runs on: MP = 1 (Megatron's MoE tokens are distinct per TP rank)."""
    return ParallelLayout(world=world, ranks_per_node=ranks_per_node, mp=1, ep=facts.ep, esp=facts.etp)


ProfileLookup = Callable[[ParallelLayout], Optional[Any]]   # layout -> its cached CostProfile, or None


def plugin_problems(facts: MegatronFacts, plugin: PluginConfig, *, world: Optional[int],
                    ranks_per_node: Optional[int], profile: Optional[ProfileLookup] = None) -> List[str]:
    """Every reason the plugin cannot run this Megatron MoE layer, each naming the setting and its value (empty
    when fine). ``world`` None skips the checks that need it (argument parsing before launch). ``profile``
    finds the cost profile cached for a layout (``pipeline_degree: "auto"`` needs one; a file there that cannot
    be used is a problem, named, for parm-auto too); None: not checked here (the Megatron-LM flag is parsed
    before the backend and device are known; the layer checks it with its lookup before building anything)."""
    problems = []
    if facts.num_experts is None:
        return [f"num_moe_experts (None): the {SECTION} flag is set but the model has no MoE layer"]
    if facts.dispatcher not in DISPATCHERS:
        problems.append(f"moe_token_dispatcher_type ({facts.dispatcher!r}) must be one of {', '.join(DISPATCHERS)}: "
                        "the plugin replaces the dispatcher, and Megatron builds it first")
    for (name, value), (_, fine, why) in zip(facts.unsupported, UNSUPPORTED):
        if value != fine:
            problems.append(f"{name} ({value!r}) must be {fine!r}: {why}")
    if plugin.esp is not None and plugin.esp != facts.etp:
        problems.append(f"{SECTION}.esp ({plugin.esp}) must equal expert_tensor_parallel_size ({facts.etp}): "
                        "Megatron's expert weights are sharded over its expert-TP group")
    if facts.etp > 1 and facts.random_routing:
        problems.append(f"{', '.join(facts.random_routing)} must be off with expert_tensor_parallel_size "
                        f"({facts.etp}) > 1: a schedule may re-gate its ESP group's token blocks, which needs "
                        "the deterministic routing their owners made")
    every = reshard_interval(plugin)
    if every and facts.bias_sp and facts.tp > 1:
        problems.append(f"{SECTION}.{HECATE}.reshard_every ({every}) cannot run with add_bias_linear and "
                        f"sequence_parallel at tensor_model_parallel_size {facts.tp}: Megatron all-reduces each "
                        "expert's linear_fc2 bias gradient over the tensor-parallel group, which adds together the "
                        "experts that share a local slot on the TP peers; moving experts would change which are added")
    if world is None:
        return problems
    rpn = ranks_per_node or world
    bad_layout = layout_problems(world, rpn, facts.tp, facts.ep, facts.etp)
    if bad_layout:
        return problems + [f"layout of tensor_model_parallel_size {facts.tp}, expert_model_parallel_size "
                           f"{facts.ep}, expert_tensor_parallel_size {facts.etp}: {p}" for p in bad_layout]
    layout = token_layout(facts, world, rpn)
    problems += [f"{SECTION}.schedule on Megatron's token layout (mp 1: sequence-parallel tokens are distinct "
                 f"per TP rank): {p}" for p in default_registry().schedule_problems(plugin.schedule, layout)]
    problems += moe_config_problems(moe_config(facts), layout)
    if plugin.schedule in default_registry().schedule_names():
        problems += [f"{SECTION}.{p}" for p in exchange_problems(default_registry().schedule_class(plugin.schedule),
                                                                  plugin.exchange, plugin.pipeline_degree)]
    if profile is not None:        # None (the flag, parsed before any group): the layer checks when it is built
        problems += profile_problems(plugin, layout, profile, profiled=default_registry().is_profiled(plugin.schedule))
    return problems
