"""Rows of the benchmark matrix: what one implementation of an MoE case looks like to the runner.

Every schedule in the registry (``moe_plugins.plugins.default_registry()``) is a row of kind *plugin* (the project's
``MoELayer``), with option ``r`` (the pipeline degree). A later issue adds rows by registering a schedule
(``parm-s1``, ``parm-s2``, ...) or, for something that is not a schedule, one entry in :data:`ROW_KINDS`.
The stock layers are rows too: ``deepspeed`` (:mod:`.stock_deepspeed`) and ``megatron``
(:mod:`.stock_megatron`); ``deepspeed@plugin=<schedule>`` is DeepSpeed's layer swapped by the plugin's DeepSpeed
adapter, the user's path (:mod:`.deepspeed_adapter_row`). ``lancet`` (option ``r``) is Lancet's core layer
(``moe_plugins.lancet.layer.LancetMoELayer``, schedule baseline): the experts' weight gradients deferred and run
while the layer's backward exchanges fly on the case's engine (which then has a pipeline lane).

The project's layers time their experts (:class:`.lancet_exposure.TimedExperts`) so that the runner can tell
how much all-to-all time no compute hid (the exposed all-to-all time).

Every row of a case starts from the same weights and the same tokens (:class:`CaseData`), so their outputs
are comparable; the runner reports how far each row's output is from the first row's.

Shapes: S tokens per rank, M model dim, E experts, H FFN hidden.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from moe_plugins.core.executor import Executor
from moe_plugins.core.experts import ExpertWeights
from moe_plugins.core.layer import MoELayer, ScheduleLike
from moe_plugins.core.ledger import CommLedger
from moe_plugins.hecate.config import HecateConfig
from moe_plugins.lancet.layer import LancetMoELayer
from moe_plugins.lancet.wgrad_queue import WgradQueue
from moe_plugins.core.plugin_config import degree_needs_profile
from moe_plugins.core.schedule import exchange_problems, with_exchange
from moe_plugins.pipemoe.degree import AutoDegree
from moe_plugins.pipemoe.tune import TunedDegree
from moe_plugins.plugins import default_registry
from moe_plugins.tools.bench.case import CaseData, Row
from moe_plugins.tools.bench.deepspeed_adapter_row import (OPTIONS as ADAPTER_OPTIONS, PLUGIN as ADAPTER_PLUGIN,
                                                          adapter_row_problems, adapter_rows_problems,
                                                          build_adapter_row)
from moe_plugins.tools.bench.lancet_exposure import SPANS, SpanLog, TimedExperts, queue_spans
from moe_plugins.tools.bench.matrix import RowSpec, moe_config, row_schedule
from moe_plugins.tools.bench.traffic import LedgerMeter

logger = logging.getLogger("moe_plugins.tools.bench")
# ---- plugin rows: the project's MoELayer with a registered schedule -------------------------------------

PLUGIN_OPTIONS = {"r": "pipeline degree: capacity chunks per layer (an int; 'auto': PipeMoE's choice from the "
                      "cost profile measured at this rate; 'tune': that choice checked by timing the layer)",
                  "exchange": "padded (default: the whole capacity buffer travels) or ragged (only occupied slots, "
                              "one uneven all-to-all each way per chunk; any r for baseline, baseline-tp and "
                              "parm-s1, r=1 for Parm's others)"}
PROFILE = "profile"          # CaseData.extras key: the CostProfile measured on this case's layout at this rate
LANE = "engine"              # CaseData.extras key: the layout's one CommEngine (pipeline lane), shared by every row


HECATE = "hecate"            # Hecate's schedule, with its row options remat and prefetch
HECATE_OPTIONS = {**PLUGIN_OPTIONS, "remat": "1: rematerialize (the copies freed after forward and gathered again "
                                             "in backward); 0 (default): kept",
                  "regather": "with remat=1: early (default; on the case engine's pipeline lane, started when the "
                              "backward reaches the layer) or at_need (inline, when the backward needs the copies)",
                  "prefetch": "1: the early gather (copies planned from earlier calls' load, issued before the gate; "
                              "t the larger of the measured hiding degree and the experts whose copies pay); 0 "
                              "(default): planned after the gate with t = E"}

LANCET = "lancet"            # the row of Lancet's core layer
LANCET_OPTIONS = {"r": "pipeline degree (an int; 'auto' or 'tune' as for the schedules' rows): Lancet with "
                       "PipeMoE's chunks; schedule baseline, padded exchange"}


def needs_profile(spec: RowSpec) -> bool:
    """Rows whose choices come from measured costs: ``parm-auto`` (Algorithm 1) and ``@r=auto`` / ``@r=tune``
    (PipeMoE), as plugin rows, Lancet rows or swapped into DeepSpeed's layer (``deepspeed@plugin=parm-auto``).
    The runner profiles the link before building them, at every rate, and rebuilds them per rate."""
    registry, schedule = default_registry(), row_schedule(spec)
    if spec.name == LANCET:
        return degree_needs_profile(spec.option("r", "1"))
    return schedule in registry.schedule_names() and (registry.is_profiled(schedule)
                                                      or degree_needs_profile(spec.option("r", "1")))


def _profile(spec: RowSpec, data: CaseData):
    profile = data.extras.get(PROFILE)
    if profile is None:
        raise ValueError(f"row ({spec.label!r}) needs a cost profile measured at this rate; the runner makes one "
                         "(CaseData.extras['profile'])")
    return profile


def _executor(spec: RowSpec, data: CaseData) -> Executor:
    r = spec.option("r", "1")
    return default_registry().build_executor(int(r) if r.isdigit() else r,
                                             _profile(spec, data) if degree_needs_profile(r) else None,
                                             data.extras.get(LANE))


def _schedule(spec: RowSpec, data: CaseData) -> ScheduleLike:
    registry = default_registry()
    profile = _profile(spec, data) if registry.is_profiled(spec.name) else None
    cls = registry.host_schedule_class(spec.name, profile, torch.empty((), dtype=data.dtype).element_size(),
                                       data.groups.layout.mp, logger)
    return with_exchange(cls, spec.option("exchange", "padded"), spec.option("r", "1"))


def build_plugin_row(spec: RowSpec, data: CaseData, *, layer_cls: Callable[..., MoELayer] = MoELayer,
                     schedule: Optional[ScheduleLike] = None,
                     more_spans: Callable[[], List[Tuple[int, int, str]]] = list, notes: Tuple[str, ...] = ()) -> Row:
    """The project's layer (``layer_cls``, with the row's schedule unless ``schedule`` is given) on the case's
    weights, its experts timed; ``more_spans``: other compute spans the row records (Lancet's dW)."""
    ledger, log = CommLedger(), SpanLog()
    layer = layer_cls(moe_config(data.case), data.groups, schedule=schedule or _schedule(spec, data),
                      executor=TimedExperts(_executor(spec, data), log, data.groups.esp), ledger=ledger, name=spec.label,
                      dtype=data.dtype, engine=data.extras.get(LANE))
    layer.load_full(data.wg_EM.to(data.dtype), ExpertWeights(*(t.to(data.dtype) for t in (
        data.full.w1_EMH, data.full.b1_EH, data.full.w2_EHM, data.full.b2_EM))))

    def forward(x_SM: torch.Tensor):
        out = layer(x_SM)
        return out.y, out.aux_loss
    return Row(label=spec.label, kind="plugin", module=layer, forward=forward, meter=LedgerMeter(ledger),
               describe=partial(choice_notes, layer), ran_as=partial(_ran_as, spec, layer), notes=notes,
               exposure=SPANS, compute_spans=lambda: log.take() + more_spans())


def build_hecate_row(spec: RowSpec, data: CaseData) -> Row:
    """``hecate[@remat=1][@prefetch=1]``: the hecate schedule configured with ``rematerialize`` / ``prefetch`` (no
    block before the layer here: the gather is issued when the call starts); its notes give the copies' peak bytes
    on this rank (the schedule's memory ledger)."""
    row = build_plugin_row(spec, data, schedule=_schedule(spec, data).configured(
        HecateConfig(rematerialize=spec.option("remat", "0") == "1", prefetch=spec.option("prefetch", "0") == "1",
                     regather=spec.option("regather", "early"))))
    layer, describe = row.module, row.describe
    return replace(row, describe=lambda: tuple(describe()) + (
        f"copies' peak {layer.schedule.memory.peak_bytes / 2 ** 20:.2f} MiB on this rank",))


def build_lancet_row(spec: RowSpec, data: CaseData) -> Row:
    """``lancet[@r=N]``: Lancet's core layer, schedule baseline, its dW queued per row and run behind the
    layer's backward exchanges on the case's engine (which must have a pipeline lane: the runner builds one when
    the plan has a lancet row)."""
    engine = data.extras.get(LANE)
    if engine is None or not engine.has_lane("pipeline"):
        raise ValueError(f"row ({spec.label!r}) needs the case's engine with a pipeline lane "
                         "(CaseData.extras['engine'] = build_engine(groups, pipeline=True))")
    queue = WgradQueue(record_timeline=True)
    return build_plugin_row(spec, data, layer_cls=partial(LancetMoELayer, queue=queue),
                            schedule=default_registry().schedule_class("baseline"),
                            more_spans=partial(queue_spans, queue),
                            notes=("Lancet: expert dW deferred, run behind the dispatch-gradient all-to-all",))


def choice_notes(layer: MoELayer) -> Tuple[str, ...]:
    """What an auto row decided in its steps: the schedule's decisions (parm-auto, parm-tune), PipeMoE's
    training degree."""
    notes = list(layer.schedule.notes())
    degree = layer.pipeline_degree
    if isinstance(degree, AutoDegree):
        chosen = sorted({r for (_, _, _, training), r in degree.decisions.items() if training})
        notes.append(f"auto degree: r={'/'.join(map(str, chosen)) or '?'} ({degree.source})")
    if isinstance(degree, TunedDegree):
        notes += degree.notes()
    return tuple(notes)


def _ran_as(spec: RowSpec, layer: MoELayer) -> Optional[str]:
    degree = layer.pipeline_degree
    degrees = ({r for (_, _, _, training), r in degree.decisions.items() if training}
               if isinstance(degree, AutoDegree) else set())
    return fixed_twin(spec, layer.schedule.ran(), degrees)


def fixed_twin(spec: RowSpec, schedules: Set[str], degrees: Set[int]) -> Optional[str]:
    """Pure: the label of the fixed row that runs what auto row ``spec`` ran, given the schedules it ran as
    (``Schedule.ran``: S2's form included) and the training degrees PipeMoE's auto or tune chose; None when
    ``spec`` is not an auto row or it ran more than one configuration."""
    name, options = spec.name, dict(spec.options)
    auto_schedule, auto_degree = default_registry().is_profiled(name), degree_needs_profile(options.get("r"))
    if not (auto_schedule or auto_degree):
        return None
    if auto_schedule:
        if len(schedules) != 1:
            return None
        (name,) = schedules
    if auto_degree:
        if len(degrees) != 1:
            return None
        (r,) = degrees
        options["r"] = str(r)
        if r == 1:
            del options["r"]
    return RowSpec(name=name, options=tuple(options.items())).label


# ---- the registry ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowKind:
    build: Callable[[RowSpec, CaseData], Row]
    options: Dict[str, str]       # allowed option -> what it means
    kind: str = "stock"


def _build_deepspeed(spec: RowSpec, data: CaseData) -> Row:
    if spec.option(ADAPTER_PLUGIN) is not None:
        return build_adapter_row(spec, data, _profile(spec, data) if needs_profile(spec) else None)
    from moe_plugins.tools.bench.stock_deepspeed import build_deepspeed_row
    return build_deepspeed_row(spec, data)


def _build_megatron(spec: RowSpec, data: CaseData) -> Row:
    from moe_plugins.tools.bench.stock_megatron import build_megatron_row
    return build_megatron_row(spec, data)


ROW_KINDS: Dict[str, RowKind] = {
    LANCET: RowKind(build_lancet_row, LANCET_OPTIONS, kind="plugin"),
    HECATE: RowKind(build_hecate_row, HECATE_OPTIONS, kind="plugin"),
    "deepspeed": RowKind(_build_deepspeed, ADAPTER_OPTIONS),
    "megatron": RowKind(_build_megatron, {"dispatcher": "Megatron's moe_token_dispatcher_type: alltoall "
                                                        "(default) or allgather"}),
}
STOCK_ROWS = tuple(name for name, kind in ROW_KINDS.items() if kind.kind == "stock")


def row_kind(name: str) -> Optional[RowKind]:
    if name in ROW_KINDS:
        return ROW_KINDS[name]
    if name in default_registry().schedule_names():
        return RowKind(build_plugin_row, PLUGIN_OPTIONS, kind="plugin")
    return None


def row_problems(spec: RowSpec) -> List[str]:
    kind = row_kind(spec.name)
    if kind is None:
        known = sorted(ROW_KINDS) + default_registry().schedule_names()
        return [f"row ({spec.name!r}) is unknown; allowed: {', '.join(known)} (schedules from "
                f"the registry, plus the stock layers and {LANCET})"]
    problems = []
    for key, value in spec.options:
        if key not in kind.options:
            allowed = ", ".join(kind.options) or "none"
            problems.append(f"row ({spec.label!r}): option {key!r} is unknown; allowed: {allowed}")
    if kind.kind == "plugin" and spec.name != LANCET and spec.option("exchange") is not None:
        problems += [f"row ({spec.label!r}): {p}" for p in exchange_problems(
            default_registry().schedule_class(spec.name), spec.option("exchange"), spec.option("r", "1"))]
    for key in ("remat", "prefetch") if spec.name == HECATE else ():
        if spec.option(key, "0") not in ("0", "1"):
            problems.append(f"row ({spec.label!r}): {key} ({spec.option(key)!r}) must be 0 or 1")
    if spec.name == HECATE and spec.option("regather", "early") not in ("early", "at_need"):
        problems.append(f"row ({spec.label!r}): regather ({spec.option('regather')!r}) must be early or at_need")
    if spec.name == "deepspeed":
        problems += adapter_row_problems(spec)
    if spec.name == "megatron" and spec.option("dispatcher", "alltoall") not in ("alltoall", "allgather"):
        problems.append(f"row ({spec.label!r}): dispatcher ({spec.option('dispatcher')!r}) must be alltoall or allgather")
    return problems


def rows_problems(specs: Sequence[RowSpec]) -> List[str]:
    """Problems between the rows of one plan (each row's own: :func:`row_problems`)."""
    return adapter_rows_problems(specs)


def build_row(spec: RowSpec, data: CaseData) -> Row:
    problems = row_problems(spec)
    if problems:
        raise ValueError("; ".join(problems))
    return row_kind(spec.name).build(spec, data)
