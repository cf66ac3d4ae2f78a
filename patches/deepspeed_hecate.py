"""Hecate (FSSDP) on DeepSpeed: what the DeepSpeed adapter (patches/deepspeed.py) needs to run schedule ``hecate``
on a ``deepspeed.moe`` layer. Pure helpers; nothing here patches anything.

- :func:`config_choices`: the registry's config choices with the sections this adapter runs (Hecate's, and
  Lancet's, patches/deepspeed_lancet.py) checked for this host (the registry's own rules refuse an enabled
  section, for the hosts that do not run them).
- :func:`hecate_config`: the section as the adapter runs it: with Hecate on, schedule ``hecate`` and the ragged
  exchange (implied: Hecate sends only the kept rows), after checking that every local expert is
  ``nn.Sequential(nn.Linear(M, H), GELU|ReLU|SiLU, nn.Linear(H, M))``: a refusal names any other expert module and
  its type, before the layer is swapped or any group built.
- :func:`hecate_class`: the schedule class configured with the section's options and the experts' activation
  (GELU, exact or tanh as GPT-2's ``gelu_new``; ReLU; SiLU).
- :class:`HecateBlockHooks`: with ``prefetch``, a forward pre-hook on the block holding each Hecate layer issues
  the layer's early gather (moe_plugins/hecate/early.py) when the block starts; with ``rematerialize``, the
  model's layers share one re-gather chain (moe_plugins/hecate/regather.py).
- :func:`stacked_weights`: ``LayerParams.expert_weights`` per call: the local experts' Linear weights (transposed)
  and biases stacked. ``torch.stack`` of views copies in forward, and its backward hands each parameter its slice,
  so each ``nn.Linear`` parameter gets its gradient once per backward (DeepSpeed ZeRO's hooks fire once). They
  can be stacked again from the parameters (``RereadableWeights.reread``): with ``rematerialize`` the backward's
  re-gather reads them so, and holds no stacked copy of the owned experts from forward to backward.

Shapes: E_l local experts, M model dim, H FFN hidden.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Type

import torch

from moe_plugins.core.experts import GELU_TANH, ExpertWeights
from moe_plugins.core.plugin_config import SECTION, PluginConfig
from moe_plugins.core.schedule import Schedule
from moe_plugins.hecate.config import NAME, hecate_across, hecate_on, host_rules
from moe_plugins.hecate.early import enclosing_blocks
from moe_plugins.hecate.regather import link as link_chain
from moe_plugins.hecate.remat import RereadableWeights, stacked_ffn
from moe_plugins.lancet.config import NAME as LANCET
from moe_plugins.lancet.config import host_rules as lancet_host_rules
from moe_plugins.patches.deepspeed_hecate_reshard import EngineResharder, check
from moe_plugins.patches.deepspeed_layer import ffn_activation
from moe_plugins.plugins import default_registry

logger = logging.getLogger(__name__)
HOST = "deepspeed"
_FFN_FORM = ("nn.Sequential(nn.Linear(M, H), nn.GELU()|nn.GELU(approximate='tanh')|nn.ReLU()|nn.SiLU(), "
             "nn.Linear(H, M))")


def config_choices() -> Dict[str, Any]:
    """``default_registry().config_choices()`` with the ``hecate`` section checked as the DeepSpeed adapter runs
    it: ``PluginConfig.from_dict(section, **config_choices())``."""
    choices = default_registry().config_choices()
    return {**choices, "sections": {**choices["sections"], NAME: host_rules(HOST),
                                    LANCET: lancet_host_rules(HOST)}}


def expert_problems(experts: torch.nn.ModuleList, hidden: int, prefix: str) -> List[str]:
    """Every local expert Hecate cannot copy (not Linear -> activation -> Linear on M), naming its module path
    (``prefix``.i) and type (empty when all can be served)."""
    return [f"expert {prefix}.{i} ({type(e).__module__}.{type(e).__qualname__}) is not {_FFN_FORM} on M={hidden}: "
            "Hecate builds its copies from those two Linear layers' weights and biases, and cannot copy another "
            "module" for i, e in enumerate(experts) if expert_activation(e, hidden) is None]


def expert_activation(expert: torch.nn.Module, hidden: int) -> Optional[str]:
    """The activation's name when ``expert`` is a Linear -> activation -> Linear FFN on M = ``hidden`` that
    Hecate's copies compute (the adapter's plain FFN form, or GELU's tanh form: ``"gelu_tanh"``), else None."""
    name = ffn_activation(expert, hidden)
    if name is not None or not isinstance(expert, torch.nn.Sequential) or len(expert) != 3:
        return name
    act = expert[1]
    if type(act) is torch.nn.GELU and act.approximate == "tanh":
        return GELU_TANH if ffn_activation(torch.nn.Sequential(expert[0], torch.nn.GELU(), expert[2]), hidden) else None
    return None


def hecate_config(cfg: Optional[PluginConfig], moe: torch.nn.Module, name: str) -> Optional[PluginConfig]:
    """``cfg`` as the adapter runs DeepSpeed MoE layer ``moe`` (named ``name``): unchanged without Hecate; with
    it, schedule ``hecate`` and the ragged exchange. One ValueError lists every problem: the section's (a
    PluginConfig given to enable() directly is checked here; its ``exchange`` is taken as implied) and every
    expert module Hecate cannot copy."""
    if not hecate_on(cfg):
        return cfg
    section = {**cfg.to_dict(), "exchange": "ragged"}
    problems = host_rules(HOST)(cfg.hecate, f"{SECTION}.{NAME}") if cfg.hecate is not None else []
    problems += hecate_across(section, SECTION, host=HOST)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    hidden = int(moe.deepspeed_moe.gate.wg.in_features)
    problems += expert_problems(experts, hidden, f"{name}.deepspeed_moe.experts.deepspeed_experts")
    names = sorted({str(expert_activation(e, hidden)) for e in experts})
    if not problems and len(names) > 1:
        problems.append(f"the local experts use several activations ({', '.join(names)}); Hecate's copies run one")
    if isinstance(cfg.lina, dict) and cfg.lina.get("inference") is not None:
        problems.append(f"{SECTION}.lina.inference cannot be used with Hecate: Lina's inference schedule runs the "
                        "layer's eval-mode forwards without Hecate's expert weights")
    if problems:
        raise ValueError(f"moe_plugins cannot run DeepSpeed MoE layer {name} with Hecate: " + "; ".join(problems))
    return replace(cfg, schedule=NAME, exchange="ragged")


def hecate_class(cfg: PluginConfig, cls: Type[Schedule], moe: torch.nn.Module) -> Type[Schedule]:
    """``cls`` configured with the ``hecate`` section's options and the activation of ``moe``'s experts (checked
    by :func:`hecate_config`) when it is Hecate's schedule, else ``cls``."""
    if cls.name != NAME:
        return cls
    hidden = int(moe.deepspeed_moe.gate.wg.in_features)
    names = {expert_activation(e, hidden) for e in moe.deepspeed_moe.experts.deepspeed_experts}
    if len(names) != 1 or None in names:
        raise ValueError(f"Hecate needs every local expert of one FFN form with one activation; found {names}")
    hecate = default_registry().schedule_class(NAME)
    return hecate.configured(hecate.from_section(cfg.hecate).options, activation=names.pop())


def stacked_weights(experts: Sequence[torch.nn.Module], like: Optional[torch.nn.Module] = None) -> RereadableWeights:
    """The local FFN experts (each ``nn.Sequential(Linear(M, H), act, Linear(H, M))``) as ExpertWeights, built
    from the parameters themselves (gradients flow back to each once), and stacked again without autograd by
    ``reread()`` (Hecate's re-materialisation). A missing bias is a zero tensor. ZeRO stage 3 partitions the
    parameters outside the experts' forward: refused, naming the parameter. No experts (pooled slots): empty
    stacks shaped as the expert ``like``."""
    fc1s, fc2s = [e[0] for e in experts], [e[2] for e in experts]
    for i, fc in enumerate(fc1s + fc2s):
        if hasattr(fc.weight, "ds_id"):
            raise ValueError(f"Hecate cannot read expert {i % len(fc1s)}'s Linear weight: ZeRO stage 3 partitions it "
                             "(ds_id set) and Hecate copies the experts outside their forward; use ZeRO stage 0, 1 "
                             "or 2")
    return stacked_ffn(fc1s, fc2s, None if like is None else (like[0], like[2]))


def weights_source(cls: Type[Schedule], pools: Mapping[torch.nn.Module, Any]) -> Optional[Callable[
        [torch.nn.Module], ExpertWeights]]:
    """What a swapped layer calls per forward for ``LayerParams.expert_weights`` (its ``MOELayer``): the stacked
    local experts where the schedule computes with them, else None (nothing built). ``pools``: MOELayer -> its
    engine's pooled slots (``hecate.pool_slots``: the layer's experts may sit in other layers' modules)."""
    return partial(_layer_weights, pools) if cls.needs_expert_weights else None


def _layer_weights(pools: Mapping[torch.nn.Module, Any], layer: torch.nn.Module) -> ExpertWeights:
    pool = pools.get(layer)
    own = layer.experts.deepspeed_experts
    return stacked_weights(own, None) if pool is None else stacked_weights(pool.experts_of(layer), own[0])


class HecateBlockHooks:
    """Hecate's early gather in the model: for each swapped layer whose schedule prefetches, a forward pre-hook
    on the block that holds it (its nearest ancestor held in a ``torch.nn.ModuleList``: the model's list of
    transformer blocks) issues the layer's spAG when the block starts, so that the work before the layer (the
    attention) hides it. A layer outside such a list issues it at its own call. And with ``reshard_every``, the
    engine's re-sharding (patches/deepspeed_hecate_reshard.py). :meth:`remove` takes them off."""

    def __init__(self) -> None:
        self.handles: List[Any] = []
        self.resharders: List[EngineResharder] = []
        self.pools: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()   # pool_slots

    def weights(self, cls: Type[Schedule]) -> Optional[Callable[[torch.nn.Module], ExpertWeights]]:
        """A swapped layer's ``expert_weights`` (:func:`weights_source`), reading this plugin's pooled slots."""
        return weights_source(cls, self.pools)

    def begin(self, engine: Any, cfg: Optional[PluginConfig]) -> None:
        """Before the engine sets anything up: refuse re-sharding where it cannot run (one ValueError)."""
        check(engine, cfg)

    def install(self, model: torch.nn.Module, swapped: Mapping[torch.nn.Module, Any], engine: Any = None) -> None:
        """After DeepSpeed configured ``model`` (``swapped``: DeepSpeed MOELayer -> the adapter's SwappedLayer)."""
        if engine is not None:
            self.resharders.append(EngineResharder(self.pools))
            self.resharders[-1].install(engine, swapped)
        names = {m: n for n, m in model.named_modules()}
        link_chain([layer.schedule for moe, layer in swapped.items() if moe in names])   # rematerialising ones
        early = [(moe, layer) for moe, layer in swapped.items()
                 if moe in names and getattr(getattr(layer.schedule, "options", None), "prefetch", False)]
        for (moe, layer), block in zip(early, enclosing_blocks(model, [moe for moe, _ in early])):
            if block is None:
                logger.info("moe_plugins: Hecate layer %s is in no ModuleList of blocks: its early gather is issued "
                            "at the layer's own call", names[moe])
                continue
            self.handles.append(block.register_forward_pre_hook(partial(_prefetch, layer, moe)))
            logger.info("moe_plugins: Hecate layer %s gathers its copies early, when block %s starts", names[moe],
                        names[block])

    def remove(self) -> None:
        handles, self.handles = self.handles, []
        resharders, self.resharders = self.resharders, []
        for handle in handles:
            handle.remove()
        for resharder in resharders:
            resharder.remove()


def _prefetch(layer: Any, moe: torch.nn.Module, block: torch.nn.Module, args: Any) -> None:
    layer.prefetch(moe)
