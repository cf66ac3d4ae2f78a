"""The schedule interface: how one MoE layer moves tokens to experts and back.

A schedule is five steps. Steps 2-4 act on one chunk of the capacity axis, so other techniques compose
with any schedule without knowing it:

1. ``prepare(x_SM)``: gate and lay tokens out for exchange; returns :class:`Dispatched`
   (the tensor ``d`` with its capacity axis ``cap_dim``, plus private state for step 5);
2. ``exchange_in(chunk)``: collectives that bring a capacity chunk to the expert shards;
3. ``expert(chunk)``: expert compute (with the ESP reduction);
4. ``exchange_out(chunk)``: collectives that bring expert outputs back;
5. ``finish(r, dispatched)``: reassemble and combine into y_SM.

:func:`run_schedule` runs steps 2-4 over ``degree`` chunks in order. Pipelining (PipeMoE), priority of
all-to-all over gradient all-reduce (Lina) and overlap with other computation (Lancet) replace that loop
(executors, :mod:`moe_plugins.core.executor`, and the communication engine, :mod:`moe_plugins.core.engine`);
sparse materialisation (Hecate) replaces where the expert weights come from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, List, Optional, Set, Tuple, Type

import torch

from moe_plugins.core import comm
from moe_plugins.core.comm import Recorder
from moe_plugins.core.config import MoEConfig
from moe_plugins.core.experts import ExpertWeights
from moe_plugins.core.gating import BlockRouting, Routing
from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.layout import exchange_free
from moe_plugins.core.plugin_config import EXCHANGES


@dataclass(frozen=True)
class Dispatched:
    d: torch.Tensor
    cap_dim: int
    state: Any
    aux_loss: torch.Tensor
    exp_counts_E: torch.Tensor
    dropped: torch.Tensor        # 0-dim: routes dropped by capacity


@dataclass(frozen=True)
class Exchange:
    """How a schedule's exchange relates to its dispatched tensor d (not visible from d alone); cost models
    (PipeMoE's auto degree) price the exchange from it."""

    group: str       # the group kind whose all-to-all carries it: its alpha_a/beta_a are used
    sent: float      # bytes the all-to-all moves per byte of d
    rows: float      # expert rows per row of d


@dataclass(frozen=True)
class RowLoad:
    """A ragged call's load as a degree word prices it (pipemoe/degree.py): the most rows any rank of the layer's
    EP&ESP and MP groups sends and receives in the call's exchange, and the capacity slots its chunks cut. The
    same on each of those ranks (a max over them), so each picks the same degree."""

    sent: int
    received: int
    slots: int


@dataclass(frozen=True)
class LayerParams:
    """What a schedule computes with, supplied by the layer (the core's or a host's):

    - ``router(x_SM) -> Routing``: gate plus capacity; in dropless mode the capacity it returns is
      uniform over every rank the layer exchanges with (a host's gate does this its own way);
    - ``experts(x_ElNM) -> y_ElNM``: the local experts on their rows, ESP reduction included;
    - ``block_router(x_sM, num_tokens) -> BlockRouting`` (optional): the same gate run on this MP rank's
      block of the MP group's ``num_tokens`` tokens only (rows [p s, (p+1) s), padded), giving exactly the
      routing ``router`` gives on all of them (Parm's S1 uses it). None where the host's gate cannot be
      split that way (a random or opaque gate); S1 then gates the whole block with ``router``;
    - ``partial_experts(x_ElNM) -> y_ElNM`` (optional): ``experts`` without the ESP reduction, for schedules
      that sum the ESP partials themselves (Parm); a host supplies it where its experts reduce inside;
    - ``expert_weights`` (optional): this rank's local experts' parameters as :class:`ExpertWeights` (E_l
      experts, this rank's H shard; the tensors themselves, so gradients reach them), for schedules that
      compute with other experts' weights too (Hecate's copies, run by the core's functional FFN
      ``experts.partial_ffn`` with ``MoEConfig.activation``). The core layer supplies it, and the DeepSpeed host
      for a schedule with ``needs_expert_weights`` (patches/deepspeed_hecate.py); Megatron's does not;
    - ``row_experts(x_RM, counts_El) -> y_RM`` (optional): the local experts on R rows grouped per local
      expert, ``counts_El`` (host ints) each, with no padding; where given (Megatron's experts take
      ``tokens_per_expert``), the ragged exchange runs the experts on the kept rows only, as stock Megatron does.
    """

    router: Callable[[torch.Tensor], Routing]
    experts: Callable[[torch.Tensor], torch.Tensor]
    block_router: Optional[Callable[[torch.Tensor, int], BlockRouting]] = None
    partial_experts: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    expert_weights: Optional[ExpertWeights] = None
    row_experts: Optional[Callable[[torch.Tensor, List[int]], torch.Tensor]] = None


class Schedule(ABC):
    name: ClassVar[str]
    # the expert step needs the experts' partial (un-reduced) ESP sums, so a host's expert modules that
    # all-reduce inside themselves cannot serve it (Parm's local combine)
    needs_expert_partials: ClassVar[bool] = False
    # the schedule computes with LayerParams.expert_weights (Hecate's copies): a host builds them for it only
    needs_expert_weights: ClassVar[bool] = False
    # how the exchange moves the dispatched slots: "padded" (the whole (E, C, M) buffer) or "ragged" (occupied
    # slots only, core/ragged.py); a schedule offers the other through exchange_variant
    exchange_mode: ClassVar[str] = "padded"

    @classmethod
    def exchange_variant(cls, exchange: str) -> Optional[Type["Schedule"]]:
        """This schedule with ``exchange`` ("padded" or "ragged"); None when it cannot run that exchange."""
        return cls if exchange == cls.exchange_mode else None

    def __init__(self, config: MoEConfig, groups: MoEProcessGroups, rec: Recorder):
        self.config, self.groups, self.rec = config, groups, rec

    def twin(self, groups: MoEProcessGroups) -> "Schedule":
        """This schedule on other process groups (PipeMoE's lane runs the exchanges on a twin). A schedule
        with per-call state that its exchanges read shares that state with the twin."""
        return type(self)(self.config, groups, self.rec)

    def prefetch(self, weights: Optional[ExpertWeights]) -> None:
        """Work to start before the layer's gate, while the work before the layer runs (Hecate's early gather
        of expert copies); called from a block's forward pre-hook or ``MoELayer.prefetch``. Default: nothing."""
        return None

    def exchange(self, d: torch.Tensor) -> Optional[Exchange]:
        """What one exchange of the dispatched tensor ``d`` moves; None when the schedule does not say (a
        cost model then refuses it)."""
        return None

    def row_load(self, dispatched: Dispatched) -> Optional[RowLoad]:
        """A ragged call's load, agreed over the ranks that run its pieces (a collective: call it once per call,
        on every rank of the layer); None where the dispatched tensor's shape prices the call (padded). A ragged
        schedule that answers it runs PipeMoE's degree words (:func:`exchange_problems`)."""
        return None

    def notes(self) -> List[str]:
        """What this schedule decided so far, in words (for logs and bench reports); [] when it decides
        nothing."""
        return []

    def ran(self) -> Set[str]:
        """The registered schedule names its training calls ran as (several when a deciding schedule chose
        differently per token count)."""
        return {type(self).name}

    @classmethod
    def layout_problems(cls, groups_layout) -> List[str]:
        """Reasons this schedule cannot run on a layout (empty when it can)."""
        return []

    @classmethod
    def degree_problems(cls, pipeline_degree: Any) -> List[str]:
        """Reasons this schedule cannot run at ``pipeline_degree`` (empty when it can; checked by
        :func:`exchange_problems` before its exchange rules)."""
        return []

    @abstractmethod
    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched: ...

    @abstractmethod
    def exchange_in(self, d: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def expert(self, e: torch.Tensor, params: LayerParams) -> torch.Tensor: ...

    @abstractmethod
    def exchange_out(self, o: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def finish(self, r: torch.Tensor, dispatched: Dispatched) -> torch.Tensor: ...

    def chunks(self, dispatched: Dispatched, degree: int) -> List[torch.Tensor]:
        """The pieces steps 2-4 run on at pipeline degree ``degree``, in order: ``d`` cut along its capacity axis
        (:func:`chunk_bounds`). A schedule whose ``d`` has no capacity axis (the ragged exchange) cuts its own."""
        d, dim = dispatched.d, dispatched.cap_dim
        return [d.narrow(dim, a, b - a) for a, b in chunk_bounds(d.shape[dim], degree)]

    def join(self, outs: List[torch.Tensor], dispatched: Dispatched) -> torch.Tensor:
        """The pieces' results (in :meth:`chunks`' order) as one tensor for ``finish``."""
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=dispatched.cap_dim)

    # -- helpers shared by schedules -------------------------------------------------------------------

    def mark_combine(self, y_SM: torch.Tensor) -> torch.Tensor:
        """The layer's output: when backward reaches it, this layer's backward exchanges come next, so the
        engine holds background work (Lina's gradient micro-ops) back from then on; not where the layout
        exchanges nothing (no urgent op would end the hold). Returns ``y_SM``."""
        if not exchange_free(self.groups.layout):
            self.rec.engine.mark_backward_exchange(y_SM)
        return y_SM

    def run_experts(self, e_XM: torch.Tensor, params: LayerParams, replicas: int = 1) -> torch.Tensor:
        """Local experts on a received chunk laid out (EP sources, E_l, ..., M): regroup rows per local
        expert, compute, and restore the layout. ``replicas`` > 1 means every row arrives that many times
        (MP replicas); the weight gradients are then divided by it while the input gradients stay exact."""
        ep, shape = self.groups.ep.size, e_XM.shape
        e_l = self.config.num_experts // ep
        x_ElRM = e_XM.reshape(ep, e_l, -1, shape[-1]).transpose(0, 1).reshape(e_l, -1, shape[-1])
        if replicas > 1:
            x_ElRM = comm.grad_scale(x_ElRM, float(replicas))
        y_ElRM = params.experts(x_ElRM)
        if replicas > 1:
            y_ElRM = comm.grad_scale(y_ElRM, 1.0 / replicas)
        return y_ElRM.reshape(e_l, ep, -1, shape[-1]).transpose(0, 1).reshape(shape)


def chunk_bounds(length: int, degree: int) -> List[Tuple[int, int]]:
    """Split [0, length) into ``degree`` contiguous chunks, sizes differing by at most one; empty chunks
    are kept (a rank with fewer slots than chunks still takes part in every collective)."""
    if degree < 1:
        raise ValueError(f"pipeline degree ({degree}) must be >= 1")
    base, extra = divmod(length, degree)
    bounds, start = [], 0
    for i in range(degree):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def run_schedule(schedule: Schedule, x_SM: torch.Tensor, params: LayerParams, degree: int = 1):
    """Run a schedule with its capacity axis cut into ``degree`` chunks, one after another."""
    dispatched = schedule.prepare(x_SM, params)
    outs = [schedule.exchange_out(schedule.expert(schedule.exchange_in(c), params))
            for c in schedule.chunks(dispatched, degree)]
    return schedule.mark_combine(schedule.finish(schedule.join(outs, dispatched), dispatched)), dispatched


def exchange_problems(cls: Type[Schedule], exchange: Any, pipeline_degree: Any = 1) -> List[str]:
    """Why ``cls`` cannot run ``exchange`` at ``pipeline_degree`` (empty when it can), each naming the schedule."""
    if exchange not in EXCHANGES:
        return [f"exchange ({exchange!r}) must be one of {', '.join(map(repr, EXCHANGES))}"]
    variant = cls.exchange_variant(exchange)
    if variant is None:
        return [f"exchange ({exchange!r}) is not supported by schedule {cls.name!r}, which runs the "
                f"{cls.exchange_mode} exchange only"]
    problems = variant.degree_problems(pipeline_degree)
    if problems:
        return problems
    fixed = isinstance(pipeline_degree, int) or (isinstance(pipeline_degree, str) and pipeline_degree.isdigit())
    if exchange == "ragged" and not fixed and variant.row_load is Schedule.row_load:
        return [f"exchange ('ragged') with schedule {cls.name!r} and pipeline_degree ({pipeline_degree!r}) is not "
                "supported: its ragged form does not agree a call's rows over the ranks that run it (row_load), "
                "and ranks' rows differ; give an integer"]
    return []


def with_exchange(cls: Type[Schedule], exchange: str, pipeline_degree: Any = 1) -> Type[Schedule]:
    """``cls`` running ``exchange`` (a ValueError naming the schedule when it cannot)."""
    problems = exchange_problems(cls, exchange, pipeline_degree)
    if problems:
        raise ValueError("; ".join(problems))
    return cls.exchange_variant(exchange)


def routing_stats(routings: List[Routing]) -> Tuple[torch.Tensor, int]:
    counts = torch.stack([r.exp_counts_E for r in routings]).sum(0)
    return counts, sum(r.dropped for r in routings)
