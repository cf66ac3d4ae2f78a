"""The rank side of the training-step contention bench (``moe-plugins bench --preset lina``).

One network (:class:`StepNet`: L dense pairs each followed by an MoE layer, expert parallel over every rank,
plus a dense head), one communication engine with a background lane, and one row per way of reducing the
dense gradients over DP (:mod:`.lina_plan`). Every row runs the same forward and backward on the same weights
and tokens; only the reduction differs. Per link rate:

1. round 0 (untimed): every row's first step; the reduced dense gradients are compared with the ``sync``
   row's (max |difference| over ranks), so a row that reduced differently shows in the report;
2. rounds 1 .. warmup-1: untimed;
3. ``iters`` timed rounds, rows in an order shuffled from (seed, round) (as :mod:`.runner` does). A step is:
   barrier, read the node's NIC counter, forward + backward + the row's reduction finished, max-reduce the
   time over ranks (the slowest rank), read the NIC again. The engine's timeline of the step is kept.

At the end of a rate every rank sends rank 0 its per-step backward all-to-all start/end stamps, NIC bytes and
the full timeline of one step per row (the round nearest the row's median); :mod:`.lina_stats` turns them into
per-op times, slowdowns and ratios.

Shapes: S tokens, M hidden, F dense width, E experts.
"""

from __future__ import annotations

import gc
import importlib
import json
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moe_plugins.core.config import MoEConfig
from moe_plugins.core.engine import CommEngine, build_engine
from moe_plugins.core.experts import init_full_weights
from moe_plugins.core.groups import MoEProcessGroups, build_process_groups, destroy_process_groups
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.tools.bench.ranks import max_over_ranks
from moe_plugins.lina.reducer import GradReducer
from moe_plugins.tools.bench.cluster import Cluster, set_rate
from moe_plugins.tools.bench.lina_plan import (STEP_ROW_KINDS, StepModel, StepPlan, StepRowSpec,
                                               bucket_bytes_of, micro_op_bytes_of)
from moe_plugins.tools.bench.runner import round_order
from moe_plugins.tools.bench.traffic import nic_tx_bytes

AUX_COEF = 0.01
REDUCING_LAYERS = ("sync", "fifo", "lina")      # the ``layer`` names of the rows' gradient all-reduces
TRACE_FIELDS = ("layer", "op", "group", "group_ranks", "bytes", "inter_node_bytes", "phase", "priority", "lane", "rank",
                "issue_ns", "start_ns", "end_ns")


class StepNet(nn.Module):
    """L x (dense pair, MoE layer) + dense head, residual; weights drawn from ``seed``, the same on every rank.
    ``layer(config, i)`` builds MoE layer i (default: the core ``MoELayer`` on ``engine``)."""

    def __init__(self, model: StepModel, groups: MoEProcessGroups, engine: CommEngine, seed: int,
                 layer: Optional[Callable[[MoEConfig, int], nn.Module]] = None):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        m, f = model.hidden, model.dense_ffn

        def pair() -> nn.Sequential:
            seq = nn.Sequential(nn.Linear(m, f), nn.GELU(), nn.Linear(f, m))
            with torch.no_grad():
                for p in seq.parameters():
                    p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / p.shape[-1] ** 0.5)
            return seq
        config = MoEConfig(hidden=m, ffn=model.ffn, num_experts=model.experts, k=model.k,
                           capacity_factor=model.capacity_factor, min_capacity=0)
        if layer is None:
            layer = lambda cfg, i: MoELayer(cfg, groups, engine=engine, name=f"moe{i}")   # noqa: E731
        self.dense = nn.ModuleList(pair() for _ in range(model.blocks + 1))
        self.moe = nn.ModuleList(layer(config, i) for i in range(model.blocks))
        for layer in self.moe:
            full = init_full_weights(model.experts, m, model.ffn, gen)
            layer.load_full(torch.randn(model.experts, m, generator=gen) / m ** 0.5, full)

    def forward(self, x_SM: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        aux = x_SM.new_zeros(())
        for dense, moe in zip(self.dense, self.moe):
            x_SM = x_SM + dense(x_SM)
            out = moe(x_SM)
            x_SM, aux = x_SM + out.y, aux + out.aux_loss
        return x_SM + self.dense[-1](x_SM), aux

    def dense_parameters(self) -> List[nn.Parameter]:
        """The data-parallel parameters (expert weights carry ``allreduce = False``), in registration order."""
        return [p for p in self.parameters() if getattr(p, "allreduce", True)]


@dataclass
class StepContext:
    """What every row's step works on; ``on_grad`` is the active row's gradient hook (None: no hook)."""

    net: StepNet
    engine: CommEngine
    groups: MoEProcessGroups
    x_SM: torch.Tensor
    g_SM: torch.Tensor
    dense: List[nn.Parameter]
    on_grad: Optional[Callable[[nn.Parameter], None]] = None
    # host rows (:mod:`.lina_hosts`): what they share (a plugin handle, a ledger), and what undoes it, in order
    hosts: Dict[str, Any] = field(default_factory=dict)
    host_stack: ExitStack = field(default_factory=ExitStack)

    def __post_init__(self) -> None:
        for p in self.dense:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: nn.Parameter) -> None:
        if self.on_grad is not None:
            self.on_grad(p)

    def forward_backward(self, on_grad: Optional[Callable[[nn.Parameter], None]] = None) -> None:
        self.net.zero_grad(set_to_none=True)
        self.on_grad = on_grad
        try:
            y_SM, aux = self.net(self.x_SM)
            ((y_SM * self.g_SM).sum() + AUX_COEF * aux).backward()
        finally:
            self.on_grad = None


@dataclass(frozen=True)
class StepRow:
    """A built row: ``step()`` runs one training step's forward, backward and gradient reduction (finished).
    Rows on their own network (the host rows) also give ``grads`` (its reduced dense gradients as summed over
    DP, flat in :meth:`StepNet.dense_parameters`' order) and ``timeline`` (the list their ops are recorded in,
    cleared before each timed step; None: the context's engine's). ``compare_with``: the check round compares the
    row's gradients with the first other row of that kind (``sync`` with itself)."""

    label: str
    kind: str
    step: Callable[[], None]
    notes: Tuple[str, ...] = ()
    grads: Optional[Callable[[], Optional[torch.Tensor]]] = None
    timeline: Optional[list] = None
    compare_with: Optional[str] = "sync"     # the kind of the row its gradients are checked against (None: none)


def build_sync(spec: StepRowSpec, ctx: StepContext) -> StepRow:
    def step() -> None:
        ctx.forward_backward()
        flat = torch.cat([p.grad.reshape(-1) for p in ctx.dense])
        out = ctx.engine.issue("all_reduce", ctx.groups.dp, flat, layer="sync", phase="backward").wait()
        offset = 0
        for p in ctx.dense:
            p.grad.copy_(out[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
    return StepRow(spec.label, spec.name, step, ("one flat all-reduce after backward",))


class _Buckets:
    """Gradients gathered in arrival order into flat buckets of at least ``size`` bytes (PyTorch DDP's and
    DeepSpeed's bucketing); a full bucket is submitted at once, the last one when backward ends. ``size`` 0:
    every gradient on its own, in place."""

    def __init__(self, ctx: StepContext, reducer: GradReducer, size: int):
        self.ctx, self.reducer, self.size = ctx, reducer, size
        self.params: List[nn.Parameter] = []
        self.pending: List[Tuple[List[nn.Parameter], Any]] = []

    def add(self, p: nn.Parameter) -> None:
        self.params.append(p)
        if sum(q.grad.numel() * q.grad.element_size() for q in self.params) >= self.size:
            self.flush()

    def flush(self) -> None:
        params, self.params = self.params, []
        if params:
            flat = params[0].grad.view(-1) if len(params) == 1 else torch.cat([q.grad.reshape(-1) for q in params])
            self.pending.append((params, self.reducer.submit(flat, self.ctx.groups.dp)))

    def wait(self) -> None:
        for params, handle in self.pending:
            flat, offset = handle.wait(), 0
            if len(params) > 1:
                for q in params:
                    q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                    offset += q.numel()
        self.pending = []


def _during_backward(spec: StepRowSpec, ctx: StepContext, reducer: GradReducer, note: str) -> StepRow:
    size = bucket_bytes_of(spec)

    def step() -> None:
        buckets = _Buckets(ctx, reducer, size)
        ctx.forward_backward(buckets.add)
        buckets.flush()
        buckets.wait()
    return StepRow(spec.label, spec.name, step, (note + (f", gradients in buckets of >= {size} B" if size else ""),))


def build_fifo(spec: StepRowSpec, ctx: StepContext) -> StepRow:
    reducer = GradReducer(ctx.engine, micro_op_bytes=None, priority=False, name="fifo")
    return _during_backward(spec, ctx, reducer, "one non-yielding background all-reduce per gradient (bucket)")


def build_lina(spec: StepRowSpec, ctx: StepContext) -> StepRow:
    size = micro_op_bytes_of(spec)
    reducer = GradReducer(ctx.engine, micro_op_bytes=size, priority=True, name="lina")
    return _during_backward(spec, ctx, reducer, f"micro-ops of {size} B, yielding to exchanges")


def build_noreduce(spec: StepRowSpec, ctx: StepContext) -> StepRow:
    return StepRow(spec.label, spec.name, ctx.forward_backward, ("no reduction",))


def build_step_row(spec: StepRowSpec, ctx: StepContext) -> StepRow:
    module, _, function = STEP_ROW_KINDS[spec.name].build.partition(":")
    return getattr(importlib.import_module(module), function)(spec, ctx)


@dataclass(frozen=True, kw_only=True)
class StepJob:
    plan: StepPlan
    cluster: Optional[Cluster]          # None: loopback, rates cannot be applied
    progress_path: Optional[str] = None


def _grads(ctx: StepContext) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in ctx.dense]).clone()


def _check_round(rows: List[StepRow], ctx: StepContext) -> Dict[str, Optional[float]]:
    """Round 0: each row's reduced dense gradients against the ``sync`` row's (a row's ``compare_with``; None:
    no reference or not reduced), max |difference| over ranks."""
    reduced: Dict[str, Optional[torch.Tensor]] = {}
    for row in rows:
        dist.barrier()
        row.step()
        reduced[row.label] = row.grads() if row.grads is not None else _grads(ctx)
    out: Dict[str, Optional[float]] = {}
    for row in rows:
        other = next((r for r in rows if r.kind == row.compare_with and (r is not row or r.kind == "sync")), None)
        mine, ref = reduced[row.label], None if other is None else reduced[other.label]
        comparable = ref is not None and mine is not None and row.kind != "noreduce"
        diff = float((mine - ref).abs().max()) if comparable else -1.0
        diff = max_over_ranks(diff)
        out[row.label] = None if diff < 0 else diff
    return out


def _trace(records) -> List[Dict[str, Any]]:
    return [{k: v for k, v in asdict(r).items() if k in TRACE_FIELDS} for r in records]


def _backward_exchanges(records) -> List[Tuple[int, int]]:
    """(start_ns, end_ns) of the step's urgent backward all-to-alls, in issue order."""
    return [(r.start_ns, r.end_ns) for r in records
            if r.op == "all_to_all" and r.phase == "backward" and r.priority == "urgent"]


def _reduction_ns(records) -> int:
    """Time this rank spent in the step's gradient all-reduces (the rows' own ops: the sync all-reduce, the
    reducer's background ops), summed; they run one at a time on one lane, so this is that lane's busy time."""
    return sum(r.end_ns - r.start_ns for r in records if r.op == "all_reduce" and r.layer in REDUCING_LAYERS)


def measure_rate(rows: List[StepRow], ctx: StepContext, plan: StepPlan, ifname: Optional[str]) -> Dict[str, Any]:
    """Collective: check round, warm-up, interleaved timed rounds; rank 0 returns the raw measurements."""
    grad_diff = _check_round(rows, ctx)
    for r in range(1, plan.warmup):
        for row in round_order(rows, plan.seed, r):
            row.step()
    times: Dict[str, List[float]] = {row.label: [] for row in rows}
    mine: Dict[str, Dict[str, list]] = {row.label: {"a2a": [], "nic": [], "traces": [], "model": [], "reduce": []}
                                        for row in rows}
    for i in range(plan.iters):
        for row in round_order(rows, plan.seed, plan.warmup + i):
            timeline = row.timeline if row.timeline is not None else ctx.engine.timeline
            dist.barrier()
            timeline.clear()
            tx0 = nic_tx_bytes(ifname)
            t0 = time.perf_counter()
            row.step()
            elapsed = time.perf_counter() - t0
            times[row.label].append(max_over_ranks(elapsed))
            tx1 = nic_tx_bytes(ifname)
            m = mine[row.label]
            m["a2a"].append(_backward_exchanges(timeline))
            m["nic"].append(None if tx0 is None or tx1 is None else tx1 - tx0)
            m["model"].append(sum(r.inter_node_bytes for r in timeline))
            m["reduce"].append(_reduction_ns(timeline))
            m["traces"].append(_trace(timeline))
    for row in rows:                                   # keep one step's timeline: the round nearest the median
        t = times[row.label]
        keep = sorted(range(len(t)), key=lambda j: (abs(t[j] - sorted(t)[len(t) // 2]), j))[0]
        mine[row.label]["trace_round"] = keep
        mine[row.label]["traces"] = mine[row.label]["traces"][keep]
    for row in rows:
        (row.timeline if row.timeline is not None else ctx.engine.timeline).clear()
    per_rank: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    return {row.label: {"kind": row.kind, "notes": list(row.notes), "times_s": times[row.label],
                        "grad_max_abs_diff_vs_sync": grad_diff[row.label],
                        "bwd_a2a_ns_per_rank": [p[row.label]["a2a"] for p in per_rank],
                        "nic_tx_bytes_per_rank": [p[row.label]["nic"] for p in per_rank],
                        "model_bytes_per_rank": [p[row.label]["model"] for p in per_rank],
                        "reduce_ns_per_rank": [p[row.label]["reduce"] for p in per_rank],
                        "trace_round": per_rank[0][row.label]["trace_round"],
                        "trace_per_rank": [p[row.label]["traces"] for p in per_rank]}
            for row in rows}


def _emit(job: StepJob, event: Dict[str, Any]) -> None:
    if job.progress_path and dist.get_rank() == 0:
        with open(job.progress_path, "a") as f:
            f.write(json.dumps(event) + "\n")


def make_context(plan: StepPlan, groups: MoEProcessGroups, engine: CommEngine) -> StepContext:
    """The network and this rank's tokens (from the seed and the rank) and upstream gradient."""
    model = plan.model
    net = StepNet(model, groups, engine, plan.seed)
    gen = torch.Generator().manual_seed(plan.seed * 100_003 + 1 + dist.get_rank())
    x_SM = torch.randn(model.tokens, model.hidden, generator=gen)
    g_SM = torch.randn(model.tokens, model.hidden, generator=gen)
    return StepContext(net=net, engine=engine, groups=groups, x_SM=x_SM, g_SM=g_SM, dense=net.dense_parameters())


def run_step_plan(job: StepJob) -> Optional[List[Dict[str, Any]]]:
    """Collective over the default group. Rank 0 returns one record per rate; the others None."""
    plan = job.plan
    if dist.get_world_size() != plan.world:
        raise ValueError(f"the plan needs {plan.world} ranks (nodes {plan.nodes} x ranks_per_node "
                         f"{plan.ranks_per_node}); this group has {dist.get_world_size()}")
    ifname = job.cluster.ifname if job.cluster is not None else None
    groups = build_process_groups(ParallelLayout(world=plan.world, ranks_per_node=plan.ranks_per_node,
                                                 ep=plan.world))
    engine = build_engine(groups, background=True, record_timeline=True, timeout_s=plan.collective_timeout_s)
    records: List[Dict[str, Any]] = []
    hosts = ExitStack()
    try:
        ctx = make_context(plan, groups, engine)
        hosts.enter_context(ctx.host_stack)            # host rows' engines and plugins, undone before the engine
        rows = [build_step_row(spec, ctx) for spec in plan.rows]
        for done, rate in enumerate(plan.rates, 1):
            if job.cluster is not None and dist.get_rank() == 0:
                set_rate(job.cluster, rate)
            dist.barrier()
            records.append({"rate": rate, "rows": measure_rate(rows, ctx, plan, ifname)})
            _emit(job, {"done": done, "total": len(plan.rates), "case": plan.model.label, "rate": rate})
        ctx = rows = None
    finally:
        try:
            hosts.close()
        finally:
            engine.close()
        destroy_process_groups(groups)
        gc.collect()
    return records if dist.get_rank() == 0 else None
