"""Lina's inference scheduling on DeepSpeed's MoE layers: the ``"lina": {"inference": {...}}`` section, its
popularity table checked against the model, and the per-layer schedulers (``moe_plugins/lina/infer.py``).

When the table is read and checked (each failure a ValueError naming the path, the version or every differing
fact, raised before the layer is swapped):

- ``enable(config)`` with the section: the table is read (missing file, another schema version, a malformed
  table) before DeepSpeed is patched;
- a DeepSpeed engine whose config has the section (``deepspeed.initialize``): before its MoE layers are set up,
  the table is checked against the model's facts (its ``deepspeed.moe.layer.MoE`` modules: how many, their
  experts, their gate's k) and ``start_layer`` against its MoE layers;
- layers set up outside an engine (``MoE.set_deepspeed_parallelism()``): each layer's experts and k when it is
  swapped; the number of MoE layers (the layers swapped so far, in order) at the first eval-mode forward.

A swapped layer with the section keeps its training forward; in eval mode (``module.training`` False) it runs
:class:`~moe_plugins.lina.infer.LayerScheduler`, kept on DeepSpeed's ``MOELayer`` as the attribute
``moe_plugins_lina_inference`` (read by ``moe_plugins.lina.inference_stats(model)``), removed by ``disable()``.
"""

from __future__ import annotations

import importlib
import weakref
from typing import Any, List, Optional

import torch

from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.plugin_config import SECTION, PluginConfig
from moe_plugins.lina.config import InferenceConfig, LinaConfig
from moe_plugins.lina.infer import STATE_ATTR, LayerScheduler, ModelSchedule
from moe_plugins.lina.popularity import ModelFacts, PopularityTable, load_table
from moe_plugins.lina.replicas import ExpertStore, store_problems

PATH = f"{SECTION}.lina.inference"


def inference_config(cfg: Optional[PluginConfig]) -> Optional[InferenceConfig]:
    """The section's ``lina.inference``, validated (None when absent or the plugin is off)."""
    if cfg is None or not cfg.enabled or cfg.lina is None:
        return None
    return LinaConfig.from_dict(cfg.lina, f"{SECTION}.lina").inference


def model_facts(model: torch.nn.Module) -> ModelFacts:
    """The facts a popularity table must share with ``model``: its DeepSpeed MoE layers, experts and k."""
    moe_cls = importlib.import_module("deepspeed.moe.layer").MoE
    layers = [m for m in model.modules() if isinstance(m, moe_cls)]
    if not layers:
        raise ValueError(f"{PATH}: the model has no deepspeed.moe.layer.MoE layer to schedule")
    experts = {int(m.num_experts) for m in layers}
    ks = {int(m.deepspeed_moe.gate.k) for m in layers}
    if len(experts) > 1 or len(ks) > 1:
        raise ValueError(f"{PATH} needs every MoE layer of the model to have the same experts and k (found experts "
                         f"{sorted(experts)}, k {sorted(ks)})")
    return ModelFacts(num_layers=len(layers), num_experts=experts.pop(), top_k=ks.pop())


def read_table(inference: InferenceConfig, facts: Optional[ModelFacts]) -> Optional[PopularityTable]:
    """The section's table (None without one), checked against ``facts`` when given; ValueErrors name the path."""
    if inference.table is None:
        return None
    return load_table(inference.table, expect=facts)


def start_layer(inference: InferenceConfig, table: Optional[PopularityTable]) -> int:
    """The first scheduled MoE layer: the section's, else the table's (0 without estimation or table)."""
    if inference.start_layer is not None:
        start = inference.start_layer
    else:
        start = table.start_layer if table is not None else 0
    if inference.estimation and table is not None and start < table.start_layer:
        raise ValueError(f"{PATH}.start_layer ({start}) is below the table's start_layer ({table.start_layer}): "
                         f"{inference.table!r} has no estimate for MoE layers before it")
    return start


def new_model(inference: InferenceConfig, facts: Optional[ModelFacts]) -> ModelSchedule:
    table = read_table(inference, facts)
    model = ModelSchedule(config=inference, table=table, start_layer=start_layer(inference, table),
                          source=repr(inference.table))
    if facts is not None:
        model.layers, model.known = facts.num_layers, True
        model.seal()                      # checked now: the model's layers are known before any batch
    return model


class LinaInferenceHooks:
    """The inference part of one ``enable()``: the model being set up by a DeepSpeed engine (:attr:`current`),
    the layers swapped outside an engine (:attr:`loose`), and every scheduler attached."""

    def __init__(self, config: Optional[PluginConfig]):
        inference = inference_config(config)
        if inference is not None:
            read_table(inference, None)   # a missing or unreadable table is refused before anything is patched
        self.current: Optional[tuple] = None          # (ModelSchedule, ids of the model's MoE modules in order)
        self.loose: Optional[ModelSchedule] = None
        self._layers: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

    def begin(self, model: torch.nn.Module, cfg: Optional[PluginConfig]) -> Optional[tuple]:
        """A DeepSpeed engine sets ``model`` up under ``cfg``: check its table against the model now."""
        inference = inference_config(cfg)
        if inference is None:
            return None
        moe_cls = importlib.import_module("deepspeed.moe.layer").MoE
        ids = [id(m) for m in model.modules() if isinstance(m, moe_cls)]
        return new_model(inference, model_facts(model)), ids

    def layer_problems(self, cfg: PluginConfig, facts: Any, layout: ParallelLayout, moe: torch.nn.Module) -> List[str]:
        """Why this layer cannot run the inference exchange (``facts``: the adapter's HostLayerFacts); checked
        with the layer's other problems, before its groups are built."""
        inference = inference_config(cfg)
        if inference is None:
            return []
        problems = store_problems(list(moe.deepspeed_moe.experts.deepspeed_experts))
        if layout.mp != 1 or layout.esp != 1:
            problems.append(f"{PATH} needs mp 1 and esp 1 (each EP rank holds whole experts and its own tokens); "
                            f"this layer runs on mp {layout.mp}, esp {layout.esp}")
        if facts.num_experts > layout.ep * inference.max_experts_per_device:
            problems.append(f"{PATH}.max_experts_per_device ({inference.max_experts_per_device}) x ep "
                            f"({layout.ep}) must hold the layer's {facts.num_experts} experts")
        if self.current is not None:
            if id(moe) not in self.current[1]:
                problems.append(f"{PATH}: the layer is not a MoE module of the model the engine sets up")
        else:
            problems += self._facts_problems(self._loose(inference), facts.num_experts, facts.k)
        return problems

    def attach(self, moe: torch.nn.Module, name: str, cfg: PluginConfig, groups: MoEProcessGroups,
               rec: Recorder) -> Optional[LayerScheduler]:
        """The scheduler of a layer being swapped (None without the section; ``layer_problems`` passed), kept on
        DeepSpeed's MOELayer."""
        inference = inference_config(cfg)
        if inference is None:
            return None
        if self.current is not None:
            model, ids = self.current
            index = ids.index(id(moe))
        else:
            model = self._loose(inference)
            index = model.join()
        experts = list(moe.deepspeed_moe.experts.deepspeed_experts)
        scheduler = LayerScheduler(name=name, index=index, model=model, group=groups.ep, rec=rec,
                                   store=ExpertStore(experts, groups.ep, rec, int(moe.num_experts),
                                                     keep_all=inference.expert_weights == "all"),
                                   num_experts=int(moe.num_experts))
        setattr(moe.deepspeed_moe, STATE_ATTR, scheduler)
        self._layers.add(moe.deepspeed_moe)
        return scheduler

    def _loose(self, inference: InferenceConfig) -> ModelSchedule:
        """The model of the layers swapped outside an engine's setup: a new one once the last has run."""
        if self.loose is None or self.loose.sealed:
            self.loose = new_model(inference, None)
        return self.loose

    @staticmethod
    def _facts_problems(model: ModelSchedule, num_experts: int, k: int) -> List[str]:
        table = model.table
        if table is None:
            return []
        pairs = (("num_experts", table.model.num_experts, num_experts), ("top_k", table.model.top_k, k))
        diff = [f"{what}: table {a}, model {b}" for what, a, b in pairs if a != b]
        if not diff:
            return []
        return [f"the popularity table {model.source} was profiled on another model: " + "; ".join(diff)]

    def remove(self) -> None:
        """Take the schedulers off DeepSpeed's layers (``disable()``)."""
        for layer in list(self._layers):
            if hasattr(layer, STATE_ATTR):
                delattr(layer, STATE_ATTR)
        self._layers = weakref.WeakSet()
        self.current = self.loose = None
