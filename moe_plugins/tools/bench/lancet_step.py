"""The rank side of Lancet's one-step timeline (``benchmarks/lancet_timeline.py``, issue #26).

One network, built once per *variant* on the same weights and tokens: L blocks, each a dense pair
(M -> F -> M, GELU, residual) followed by a core MoE layer (schedule baseline, expert parallel over every rank),
then a dense head pair (the shapes of the Lina step bench, :class:`.lina_plan.StepModel`). A step is forward and
backward, no reduction, no optimizer. Variants (:data:`VARIANTS`):

- ``baseline``: ``core.layer.MoELayer``; every exchange runs inline on the caller's thread, nothing overlaps;
- ``lancet``: ``lancet.layer.LancetMoELayer`` on one ``WgradQueue`` per network: each layer's backward exchanges
  fly on the engine's pipeline lane; the dispatch-gradient one runs the layer's own expert dW;
- ``lancet+dense``: the same, and every dense Linear's dW deferred too (``lancet.dense_wgrad``, by hand: the hosts
  do not wire it), so the combine-gradient exchange of layer i runs the dW of the dense pair after it.

All variants share one engine (pipeline lane, timeline recorded). Per link rate: a check round (each variant's
gradients against ``baseline``'s, max |difference| over ranks, and whether the queue is empty after backward),
warm-up, then ``iters`` timed rounds, variants in a seeded order per round (:func:`.runner.round_order`), each
step timed on the slowest rank. Per rank and step: the engine's records (``CommRecord``), the compute spans (the
experts' forward and backward, :class:`.lancet_exposure.TimedExperts`; the dW, the queue's ``WgradSpan``), and
from them the overlap figures of :func:`overlap_figures`. Rank 0 gets every rank's figures of every round and
the full trace of the round nearest each variant's median step.

Shapes: S tokens, M hidden, F dense width, E experts.
"""

from __future__ import annotations

import gc
import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moe_plugins.core.engine import CommEngine, build_engine
from moe_plugins.core.executor import Sequential
from moe_plugins.core.groups import MoEProcessGroups, build_process_groups, destroy_process_groups
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.lancet.dense import dense_wgrad
from moe_plugins.lancet.layer import LancetMoELayer
from moe_plugins.tools.bench.ranks import max_over_ranks
from moe_plugins.lancet.overlap import exchange_intervals, hidden_fraction, overlap_fraction
from moe_plugins.lancet.wgrad_queue import WgradQueue
from moe_plugins.tools.bench.cluster import Cluster, set_rate
from moe_plugins.tools.bench.lancet_exposure import SpanLog, TimedExperts, a2a_of_records, exposure_of, queue_spans
from moe_plugins.tools.bench.lina_plan import StepModel, StepRun, network_problems
from moe_plugins.tools.bench.lina_step import StepNet
from moe_plugins.tools.bench.matrix import parse_rate

AUX_COEF = 0.01
VARIANTS = {
    "baseline": "core MoELayer: every exchange inline, nothing deferred",
    "lancet": "LancetMoELayer: expert dW run while the dispatch-gradient all-to-all flies",
    "lancet+dense": "LancetMoELayer and the dense Linears' dW deferred (lancet.dense_wgrad): expert dW behind the "
                    "dispatch-gradient all-to-all, the next dense pair's dW behind the combine-gradient one",
}
REFERENCE = "baseline"
TRACE_FIELDS = ("layer", "op", "group", "phase", "lane", "bytes", "inter_node_bytes", "issue_ns", "start_ns", "end_ns")


@dataclass(frozen=True, kw_only=True)
class TimelinePlan(StepRun):
    """What one timeline run measures: the variants, side by side at each rate (the counts: :class:`StepRun`)."""

    nodes: int = 2
    ranks_per_node: int = 2
    variants: Tuple[str, ...] = tuple(VARIANTS)
    rates: Tuple[str, ...] = ("200mbit",)
    iters: int = 5


def timeline_plan_problems(plan: TimelinePlan) -> List[str]:
    """Every problem of the plan at once, each naming the field, its value and what is allowed (pure)."""
    problems = network_problems(plan)
    unknown = [v for v in plan.variants if v not in VARIANTS]
    if unknown or not plan.variants:
        problems.append(f"variants ({', '.join(plan.variants) or 'none'}) must be one or more of "
                        f"{', '.join(VARIANTS)}")
    if len(set(plan.variants)) != len(plan.variants):
        problems.append(f"variants ({', '.join(plan.variants)}) list one twice")
    for rate in plan.rates or ("",):
        try:
            parse_rate(rate)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


class TimelineNet(StepNet):
    """The training-step bench's network (L x (dense pair, MoE layer) + dense head, residual; weights drawn from
    ``seed``, every variant the same) whose MoE layers are Lancet's when ``queue`` is given (None: the plain core
    layer), their experts timed into ``log``."""

    def __init__(self, model: StepModel, groups: MoEProcessGroups, engine: CommEngine, seed: int,
                 queue: Optional[WgradQueue], log: SpanLog):
        extra = {} if queue is None else {"queue": queue}
        cls = MoELayer if queue is None else LancetMoELayer
        super().__init__(model, groups, engine, seed,
                         layer=lambda config, i: cls(config, groups, engine=engine, name=f"moe{i}",
                                                     executor=TimedExperts(Sequential(), log), **extra))

    def dense_linears(self) -> List[Tuple[str, nn.Module]]:
        return [(f"dense.{i}.{name}", module) for i, pair in enumerate(self.dense)
                for name, module in pair.named_children() if isinstance(module, nn.Linear)]


@dataclass
class Variant:
    """One variant's network, its queue (None: baseline) and span log, on this rank's tokens."""

    name: str
    net: TimelineNet
    queue: Optional[WgradQueue]
    log: SpanLog
    x_SM: torch.Tensor
    g_SM: torch.Tensor

    def step(self) -> None:
        self.net.zero_grad(set_to_none=True)
        deferred = dense_wgrad(self.queue, self.net.dense_linears()) if self.name == "lancet+dense" else nullcontext()
        with deferred:
            y_SM, aux = self.net(self.x_SM)
            ((y_SM * self.g_SM).sum() + AUX_COEF * aux).backward()

    def spans(self) -> List[Tuple[int, int, str]]:
        return self.log.take() + (queue_spans(self.queue) if self.queue is not None else [])

    def grads(self) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) for p in self.net.parameters()])


def overlap_figures(records: Sequence[Any], spans: Sequence[Sequence[Any]]) -> Dict[str, float]:
    """Pure: one rank's figures of one step. ``overlap`` = |all-to-all ∩ compute| / |all-to-all| with the
    exchanges from their issue (``overlap_from_start``: from the lane thread's start); ``bwd_overlap``: the
    backward exchanges only; ``dw_hidden``: the share of the dW time that ran inside an exchange; exposed and
    all-to-all time in ms."""
    compute = [(s[0], s[1]) for s in spans]
    dw = [(s[0], s[1]) for s in spans if str(s[2]).startswith("dW")]
    a2a = a2a_of_records(records)
    bwd = exchange_intervals(records, phase="backward", since="issue")
    exposure = exposure_of(a2a, compute)
    return {"overlap": overlap_fraction(a2a, compute),
            "overlap_from_start": overlap_fraction(a2a_of_records(records, since="start"), compute),
            "bwd_overlap": overlap_fraction(bwd, compute), "dw_hidden": hidden_fraction(a2a, dw),
            "a2a_ms": exposure["a2a_ns"] / 1e6, "exposed_ms": exposure["exposed_ns"] / 1e6,
            "dw_ms": sum(b - a for a, b in dw) / 1e6}


def _trace(records: Sequence[Any], spans: Sequence[Sequence[Any]]) -> Dict[str, Any]:
    return {"records": [{k: getattr(r, k) for k in TRACE_FIELDS} for r in records],
            "spans": [{"start_ns": s[0], "end_ns": s[1], "kind": s[2]} for s in spans]}


def _check_round(variants: List[Variant]) -> Dict[str, Dict[str, Any]]:
    """Each variant's gradients against the reference's (max |difference| over ranks) and its queue's state."""
    grads, empty = {}, {}
    for v in variants:
        dist.barrier()
        v.step()
        v.spans()
        grads[v.name] = v.grads()
        empty[v.name] = v.queue is None or v.queue.empty()
    ref = grads.get(REFERENCE)
    return {v.name: {"grad_max_abs_diff_vs_baseline": None if ref is None else
                     max_over_ranks(float((grads[v.name] - ref).abs().max())),
                     "queue_empty": bool(max_over_ranks(0.0 if empty[v.name] else 1.0) == 0.0)}
            for v in variants}


def measure_rate(variants: List[Variant], engine: CommEngine, plan: TimelinePlan) -> Dict[str, Any]:
    """Collective: check round, warm-up, timed rounds; rank 0 returns the raw figures (others None)."""
    from moe_plugins.tools.bench.runner import round_order
    checks = _check_round(variants)
    for r in range(1, plan.warmup):
        for v in round_order(variants, plan.seed, r):
            v.step()
            v.spans()
    times: Dict[str, List[float]] = {v.name: [] for v in variants}
    mine: Dict[str, Dict[str, list]] = {v.name: {"rounds": [], "traces": []} for v in variants}
    for i in range(plan.iters):
        for v in round_order(variants, plan.seed, plan.warmup + i):
            dist.barrier()
            engine.timeline.clear()
            v.spans()
            t0 = time.perf_counter()
            v.step()
            elapsed = time.perf_counter() - t0
            records, spans = list(engine.timeline), v.spans()
            times[v.name].append(max_over_ranks(elapsed))
            mine[v.name]["rounds"].append(overlap_figures(records, spans))
            mine[v.name]["traces"].append(_trace(records, spans))
    for name, t in times.items():          # keep the trace of the round nearest the median (the same on every rank)
        keep = sorted(range(len(t)), key=lambda j: (abs(t[j] - sorted(t)[len(t) // 2]), j))[0]
        mine[name]["kept_round"] = keep
        mine[name]["trace"] = mine[name].pop("traces")[keep]
    per_rank: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    if dist.get_rank() != 0:
        return {}
    return {v.name: {"about": VARIANTS[v.name], "times_s": times[v.name], **checks[v.name],
                     "kept_round": mine[v.name]["kept_round"],
                     "rounds_per_rank": [p[v.name]["rounds"] for p in per_rank],
                     "trace_per_rank": [p[v.name]["trace"] for p in per_rank]} for v in variants}


def build_variants(plan: TimelinePlan, groups: MoEProcessGroups, engine: CommEngine) -> List[Variant]:
    gen = torch.Generator().manual_seed(plan.seed * 100_003 + 1 + dist.get_rank())
    x_SM = torch.randn(plan.model.tokens, plan.model.hidden, generator=gen)
    g_SM = torch.randn(plan.model.tokens, plan.model.hidden, generator=gen)
    out = []
    for name in plan.variants:
        queue, log = (None if name == REFERENCE else WgradQueue(record_timeline=True)), SpanLog()
        out.append(Variant(name, TimelineNet(plan.model, groups, engine, plan.seed, queue, log), queue, log,
                           x_SM, g_SM))
    return out


@dataclass(frozen=True, kw_only=True)
class TimelineJob:
    """What every rank runs (pickled by the harness; :mod:`.rank_main` calls :meth:`run_rank`)."""

    plan: TimelinePlan
    cluster: Optional[Cluster]          # None: loopback, rates cannot be applied
    progress_path: Optional[str] = None

    def run_rank(self) -> Optional[List[Dict[str, Any]]]:
        """Collective over the default group. Rank 0 returns one record per rate; the others None."""
        plan = self.plan
        if dist.get_world_size() != plan.world:
            raise ValueError(f"the plan needs {plan.world} ranks (nodes {plan.nodes} x ranks_per_node "
                             f"{plan.ranks_per_node}); this group has {dist.get_world_size()}")
        groups = build_process_groups(ParallelLayout(world=plan.world, ranks_per_node=plan.ranks_per_node,
                                                     ep=plan.world))
        engine = build_engine(groups, pipeline=True, record_timeline=True, timeout_s=plan.collective_timeout_s)
        records: List[Dict[str, Any]] = []
        try:
            variants = build_variants(plan, groups, engine)
            for done, rate in enumerate(plan.rates, 1):
                if self.cluster is not None and dist.get_rank() == 0:
                    set_rate(self.cluster, rate)
                dist.barrier()
                records.append({"rate": rate, "variants": measure_rate(variants, engine, plan)})
                if self.progress_path and dist.get_rank() == 0:
                    with open(self.progress_path, "a") as f:
                        f.write(json.dumps({"done": done, "total": len(plan.rates), "case": plan.model.label,
                                            "rate": rate}) + "\n")
            variants = None
        finally:
            engine.close()
            destroy_process_groups(groups)
            gc.collect()
        return records if dist.get_rank() == 0 else None
