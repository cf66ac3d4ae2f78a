"""Lina's two-phase expert scheduling of one MoE layer in inference (§5.2 "Two-phase scheduling", §6.2).

Per eval-mode forward of a scheduled layer (MoE layer index ``l >= start_layer``), on every EP rank:

1. **Phase one** (``estimation`` on), before the gate: the expected tokens per expert of this rank's tokens
   from the popularity table, each token's path being its top-1 experts at the MoE layers before ``l`` in this
   same forward (the :class:`PathRecorder`); the E estimates are all-gathered over the EP group and summed in
   rank order, so every rank plans the same placement (``plan_placement``); replicas move to it.
2. The gate runs as in the stock layer (same experts, slots, drops, weights).
3. **Phase two**: the kept routes per expert of every rank are all-gathered (the uneven split needs them
   anyway, with each rank's weight fingerprint); ``phase_two`` re-plans from the summed counts only when their
   top-2 set differs from the estimate's; replicas move if the placement changed. Without estimation the
   placement is planned from the counts on every batch (phase two only).
4. The exchange (:mod:`.exchange`): tokens split over the replicas by ``split_tokens``, computed, sent back,
   combined with the gate's weights.

Layers below ``start_layer`` run the layer's own schedule, unchanged, and record the path. Everything here is
without autograd (an eval-mode forward that needs gradients is refused). Host reads, each a synchronisation on
a GPU: this rank's kept counts, the all-gathered counts and estimates, and the recorded paths.

Shapes: S tokens, M model dim, E experts, N EP ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from moe_plugins.core.comm import Recorder
from moe_plugins.core.gating import Routing
from moe_plugins.core.groups import Group
from moe_plugins.core.schedule import LayerParams, Schedule
from moe_plugins.lina.config import InferenceConfig
from moe_plugins.lina.exchange import kept_routes, replica_exchange
from moe_plugins.lina.placement import Placement, phase_two, plan_placement, split_tokens
from moe_plugins.lina.popularity import PopularityTable, path_loads, path_span
from moe_plugins.lina.replicas import ExpertStore

STATE_ATTR = "moe_plugins_lina_inference"      # the attribute of a host MoE module holding its LayerScheduler


class PathRecorder:
    """The top-1 expert of each of this rank's tokens at every MoE layer run so far in the current forward of
    one model; MoE layer 0 starts a new forward. One per model, passed to each of its scheduled layers."""

    def __init__(self) -> None:
        self._top1: Dict[int, torch.Tensor] = {}

    def record(self, layer: int, top1_S: torch.Tensor) -> None:
        if layer == 0:
            self._top1.clear()
        self._top1[layer] = top1_S.detach().reshape(-1)

    def _span(self, layer: int, path_length: int, num_tokens: int) -> Dict[int, torch.Tensor]:
        span = path_span(layer, path_length)
        missing = [j for j in span if j not in self._top1]
        if missing:
            raise RuntimeError(f"lina inference: MoE layer {layer} needs the experts its tokens took at layers "
                               f"{list(span)}, and layers {missing} did not run in this forward (are the MoE layers "
                               "called in model order, every one of them, each forward?)")
        for j in span:
            if self._top1[j].numel() != num_tokens:
                raise RuntimeError(f"lina inference: MoE layer {layer} has {num_tokens} tokens and layer {j} had "
                                   f"{self._top1[j].numel()}: a token's path needs the same tokens at every MoE layer")
        return {j: self._top1[j].long() for j in span}

    def path_counts(self, layer: int, path_length: int, num_tokens: int, num_experts: int
                    ) -> Dict[Tuple[int, ...], int]:
        """How many of this rank's tokens took each path to ``layer``: each path coded as one integer in base
        ``num_experts``, one 1-D unique and one host read, instead of a tuple per token (``torch.unique`` over
        rows, ``dim=0``, took about 3 ms for 2,048 tokens on one CPU thread; the 1-D one 0.04 ms)."""
        span = self._span(layer, path_length, num_tokens)
        if not span:
            return {(): num_tokens} if num_tokens else {}
        code_S = torch.zeros_like(span[min(span)])
        for j in sorted(span):
            code_S = code_S * num_experts + span[j]
        codes_U, counts_U = torch.unique(code_S, return_counts=True)
        return {path_digits(c, num_experts, len(span)): n for c, n in zip(codes_U.tolist(), counts_U.tolist())}


def rank_sum(rows_RE: List[List[Any]]) -> List[Any]:
    """Per column, the sum over the ranks' rows in rank order (so every rank sums floats alike)."""
    return [sum(row[j] for row in rows_RE) for j in range(len(rows_RE[0]))]


def path_digits(code: int, base: int, width: int) -> Tuple[int, ...]:
    """The path coded by :meth:`PathRecorder.path_counts`: ``width`` digits in ``base``, the earliest layer first."""
    digits = []
    for _ in range(width):
        code, digit = divmod(code, base)
        digits.append(digit)
    return tuple(reversed(digits))


@dataclass
class ModelSchedule:
    """What the scheduled MoE layers of one model share: the section, the table, the path recorder, and the
    model's MoE layer count (read from the model when it is known at setup, else counted as layers join; checked
    against the table by the first forward, after which no layer joins)."""

    config: InferenceConfig
    table: Optional[PopularityTable]
    start_layer: int
    source: str                               # where the section and table came from, for messages
    layers: int = 0
    known: bool = False                       # ``layers`` was read from the model
    sealed: bool = False
    recorder: PathRecorder = field(default_factory=PathRecorder)
    # a layer's estimate summed over the EP group, delivered by the layer before it in the same forward
    estimates: Dict[int, Tuple[float, ...]] = field(default_factory=dict)

    def join(self) -> int:
        """The next MoE layer's index (layers swapped outside a model's setup, in swap order)."""
        if self.known or self.sealed:
            raise RuntimeError("lina inference: no MoE layer can join a model whose layers are known or have run")
        self.layers += 1
        return self.layers - 1

    def seal(self) -> None:
        """At the first forward: the table must describe this many MoE layers, and some layer is scheduled."""
        if self.sealed:
            return
        problems = []
        if self.table is not None and self.table.model.num_layers != self.layers:
            problems.append(f"the popularity table {self.source} was profiled on another model: num_layers: table "
                            f"{self.table.model.num_layers}, model {self.layers}")
        if self.start_layer >= self.layers:
            problems.append(f"start_layer ({self.start_layer}) must be below the model's MoE layers "
                            f"({self.layers}): no layer would be scheduled")
        if problems:
            raise ValueError("moe_plugins.lina.inference: " + "; ".join(problems))
        self.sealed = True


@dataclass
class LayerStats:
    layer: str
    batches: int = 0
    phase2_replans: int = 0
    estimate_accurate: int = 0
    estimate_total: int = 0
    exchange_ms: List[float] = field(default_factory=list)
    experts_moved: int = 0
    weight_gathers: int = 0
    phase1_gathers: int = 0                      # phase one's own all-gathers (none when delivered or layer 0)

    def as_dict(self) -> Dict[str, Any]:
        return {"layer": self.layer, "batches": self.batches, "phase2_replans": self.phase2_replans,
                "estimate_accurate": self.estimate_accurate, "estimate_total": self.estimate_total,
                "exchange_ms": list(self.exchange_ms), "experts_moved": self.experts_moved,
                "weight_gathers": self.weight_gathers, "phase1_gathers": self.phase1_gathers}


def timed_schedule(schedule: Schedule, x_SM: torch.Tensor, params: LayerParams) -> Tuple[torch.Tensor, Any, float]:
    """``run_schedule`` at degree 1 (the schedule's own ``chunks`` / ``join``), with the wall milliseconds of its
    two exchanges."""
    dispatched = schedule.prepare(x_SM, params)
    (chunk,) = schedule.chunks(dispatched, 1)
    t0 = time.perf_counter()
    e = schedule.exchange_in(chunk)
    t1 = time.perf_counter()
    o = schedule.expert(e, params)
    t2 = time.perf_counter()
    r = schedule.exchange_out(o)
    ms = (t1 - t0 + time.perf_counter() - t2) * 1e3
    return schedule.mark_combine(schedule.finish(schedule.join([r], dispatched), dispatched)), dispatched, ms


@dataclass
class LayerScheduler:
    """Lina's inference schedule of one swapped MoE layer (module docstring)."""

    name: str
    index: int                          # MoE layer index in its model
    model: ModelSchedule
    store: ExpertStore
    group: Group                        # EP
    rec: Recorder
    num_experts: int
    stats: LayerStats = field(init=False)
    placement: Optional[Placement] = field(default=None, init=False)      # the last batch's, after phase two
    estimated: Optional[Placement] = field(default=None, init=False)      # the last batch's phase one

    def __post_init__(self) -> None:
        self.stats = LayerStats(self.name)

    @property
    def config(self) -> InferenceConfig:
        return self.model.config

    @property
    def table(self) -> Optional[PopularityTable]:
        return self.model.table

    @property
    def recorder(self) -> PathRecorder:
        return self.model.recorder

    @property
    def scheduled(self) -> bool:
        return self.index >= self.model.start_layer

    def forward(self, x_SM: torch.Tensor, route: Callable[[torch.Tensor], Routing],
                plain: Callable[[torch.Tensor, Callable[[torch.Tensor], Routing]], Tuple[torch.Tensor, Any, float]]
                ) -> Tuple[torch.Tensor, Routing]:
        """The layer's output for this rank's tokens and the gate's routing. ``route``: the host's gate;
        ``plain(x_SM, router)``: the layer's own schedule (timed_schedule) with that router."""
        if torch.is_grad_enabled() and x_SM.requires_grad:
            raise ValueError(f"MoE layer {self.name}: Lina's inference exchange runs without autograd; call the "
                             "eval-mode model under torch.no_grad() or torch.inference_mode() (or train() it)")
        self.model.seal()
        with torch.no_grad():
            return self._forward(x_SM, route, plain)

    def _forward(self, x_SM: torch.Tensor, route: Callable[[torch.Tensor], Routing], plain: Callable[..., Any]
                 ) -> Tuple[torch.Tensor, Routing]:
        routings: List[Routing] = []

        def recording(x: torch.Tensor) -> Routing:
            routings.append(route(x))
            if len(routings) == 1:                    # this layer's experts join the later layers' paths
                self.recorder.record(self.index, routings[0].expert_SK[:, 0])
            return routings[-1]

        if self.index == 0:
            self.model.estimates.clear()              # a new forward: nothing delivered before it stands
        if not self.scheduled:
            y_SM, _, ms = plain(x_SM, recording)
        else:
            y_SM, ms = self._scheduled(x_SM, recording)
        self.stats.batches += 1
        self.stats.exchange_ms.append(ms)
        return y_SM, routings[0]

    def _scheduled(self, x_SM: torch.Tensor, route: Callable[[torch.Tensor], Routing]) -> Tuple[torch.Tensor, float]:
        n, m = self.group.size, self.config.max_experts_per_device
        first: Optional[Placement] = None
        if self.config.estimation:
            loads = self._phase_one_loads(x_SM)
            first = self.estimated = plan_placement(loads, n, max_experts_per_device=m)
            self._move(first)
        routing = route(x_SM)
        kept = kept_routes(routing, self.num_experts)
        mine = torch.tensor(list(kept.counts_E) + [self.store.fingerprint()], dtype=torch.int64, device=x_SM.device)
        upcoming_E = self._next_estimate(x_SM)
        if upcoming_E is not None:                    # float64 bits ride in the int64 message, unchanged
            mine = torch.cat([mine, upcoming_E.view(torch.int64)])
        rows = self._gather(mine)
        num_e = self.num_experts
        counts_RE = [row[:num_e] for row in rows]
        self.store.check_fingerprints([row[num_e] for row in rows])
        if upcoming_E is not None:
            est_RE = torch.tensor([row[num_e + 1:] for row in rows], dtype=torch.int64).view(torch.float64).tolist()
            self.model.estimates[self.index + 1] = tuple(rank_sum(est_RE))
        actual = rank_sum(counts_RE)
        if first is not None:
            second = phase_two(first, actual)
            placement = second.placement
            self.stats.estimate_total += 1
            self.stats.estimate_accurate += not second.reallocate
            self.stats.phase2_replans += second.reallocate
        else:
            placement = plan_placement(actual, n, max_experts_per_device=m)
            self.stats.phase2_replans += 1
        self._move(placement)
        self.placement = placement
        splits = split_tokens(placement, counts_RE)
        return replica_exchange(x_SM, routing, kept, placement, splits, self.group, self.rec, self.store.compute)

    def _phase_one_loads(self, x_SM: torch.Tensor) -> List[float]:
        """This layer's estimated loads over the EP group, the same on every rank: delivered by the layer before
        (its phase-two all-gather carried them, as the paper piggybacks the estimate on a message that runs
        anyway, §6.2); for layer 0 (an empty path) the profiled marginal itself (every rank's estimate is its
        token count times it, and a placement depends only on the loads' proportions); else one all-gather."""
        delivered = self.model.estimates.pop(self.index, None)
        if delivered is not None:
            return list(delivered)
        if not path_span(self.index, self.table.path_length):
            return list(self.table.distribution(self.index, ()))
        paths = self.recorder.path_counts(self.index, self.table.path_length, x_SM.shape[0], self.num_experts)
        mine_E = torch.tensor(path_loads(self.table, self.index, paths), dtype=torch.float64, device=x_SM.device)
        rows = self._gather(mine_E)
        self.stats.phase1_gathers += 1
        return rank_sum(rows)

    def _next_estimate(self, x_SM: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's estimate for the next MoE layer (its tokens' paths end with this layer's experts, recorded
        when the gate ran), when it is scheduled with estimation; None otherwise (the same answer on every rank)."""
        upcoming = self.index + 1
        if not self.config.estimation or upcoming >= self.model.layers or upcoming < self.model.start_layer:
            return None
        paths = self.recorder.path_counts(upcoming, self.table.path_length, x_SM.shape[0], self.num_experts)
        return torch.tensor(path_loads(self.table, upcoming, paths), dtype=torch.float64, device=x_SM.device)

    def _move(self, placement: Placement) -> None:
        gathers = self.store.gathers
        self.stats.experts_moved += self.store.move(placement)
        self.stats.weight_gathers += self.store.gathers - gathers

    def _gather(self, x: torch.Tensor) -> List[List[Any]]:
        """Every EP rank's ``x`` (a flat tensor), in rank order, as host numbers."""
        if self.group.size == 1:
            return [x.tolist()]
        flat = self.rec.issue("all_gather", self.group, x, "forward")
        return flat.view(self.group.size, -1).tolist()

    def clear(self) -> None:
        """Training mode (weights may change): forget the replicas and the placement."""
        self.store.clear()
        self.placement = self.estimated = None


def _schedulers(module: torch.nn.Module) -> List[LayerScheduler]:
    found = [getattr(m, STATE_ATTR, None) for m in module.modules()]
    return [s for s in found if isinstance(s, LayerScheduler)]


def inference_stats(module: torch.nn.Module) -> List[Dict[str, Any]]:
    """One dict per swapped MoE layer under ``module`` that has Lina's inference section, in module order:
    ``layer`` (its name), ``batches``, ``phase2_replans``, ``estimate_accurate``, ``estimate_total`` (the paper's
    top-2 accuracy is their ratio), ``exchange_ms`` (per batch, the wall ms of the layer's two token
    all-to-alls), ``experts_moved`` ((expert, device) weight moves), ``weight_gathers`` (with
    ``"expert_weights": "all"``: host copies of every expert gathered) and ``phase1_gathers`` (phase one's own
    all-gathers: none where the layer before carried the estimate, or for layer 0)."""
    return [s.stats.as_dict() for s in _schedulers(module)]


def reset_inference_stats(module: torch.nn.Module) -> None:
    """Zero the statistics of every scheduled layer under ``module`` (replicas and placements stay)."""
    for s in _schedulers(module):
        s.stats = LayerStats(s.name)


def clear_inference_replicas(module: torch.nn.Module) -> None:
    """Forget every layer's resident replicas (collective in effect: call it on every rank, e.g. after writing
    expert weights in a way their version counters do not see)."""
    for s in _schedulers(module):
        s.clear()
