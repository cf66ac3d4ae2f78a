"""The plan of the training-step contention bench (``moe-plugins bench --preset lina``), as small typed configs
and pure parsers.

A *step model* is L blocks, each a dense pair (M -> F -> M, replicated: data parallel over all ranks) followed
by an MoE layer (expert parallel over all ranks), and a dense head pair after the last block; written
``L=4,S=256,M=256,H=512,E=4,k=2,f=1,F=512`` (S tokens per rank, H the experts' FFN width, F the dense width).
The dense gradients, all-reduced over DP, cross the same shaped link as the MoE all-to-alls.

A *row* is one way of reducing those gradients in the same step (:data:`STEP_ROW_KINDS`):

- ``sync``: all-reduced synchronously after backward, one flat buffer (stock DeepSpeed on CPU);
- ``fifo``: each gradient submitted during backward as one background op that does not yield to exchanges
  (no priority, no chunking: DeepSpeed's reduction stream on GPU);
- ``lina@kib=N`` / ``lina@mb=X``: Lina's micro-ops of N KiB (or X MB = 10^6 B), yielding to exchanges;
- ``noreduce``: a timing reference that skips the reduction.

- host rows (:mod:`.lina_hosts`): ``deepspeed`` and ``megatron`` (the host's stock reduction), and
  ``deepspeed@lina,kib=N`` / ``megatron@lina,kib=N`` (the host with the plugin's Lina section).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from moe_plugins.tools.bench.matrix import RowSpec, parse_rate

KIB = 1024
MB = 1_000_000


@dataclass(frozen=True, kw_only=True)
class StepModel:
    """The benchmarked network, in the papers' letters (see the module docstring)."""

    blocks: int = 4            # L
    tokens: int = 256          # S, per rank
    hidden: int = 256          # M
    ffn: int = 512             # H, each expert's FFN width
    experts: int = 4           # E
    k: int = 2
    capacity_factor: float = 1.0   # f
    dense_ffn: int = 512       # F, the dense pair's width

    @property
    def label(self) -> str:
        return (f"L{self.blocks} S{self.tokens} M{self.hidden} H{self.ffn} E{self.experts} k{self.k} "
                f"f{self.capacity_factor:g} F{self.dense_ffn}")


MODEL_KEYS: Dict[str, Tuple[str, type]] = {
    "L": ("blocks", int), "S": ("tokens", int), "M": ("hidden", int), "H": ("ffn", int), "E": ("experts", int),
    "k": ("k", int), "f": ("capacity_factor", float), "F": ("dense_ffn", int),
}


def parse_model(text: str) -> StepModel:
    """``L=4,S=256,M=256,H=512,E=4,k=2,f=1,F=512``; keys left out keep :class:`StepModel`'s defaults."""
    values, problems = {}, []
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in MODEL_KEYS:
            problems.append(f"{item!r} is not KEY=VALUE with KEY one of {', '.join(MODEL_KEYS)}")
            continue
        name, kind = MODEL_KEYS[key]
        try:
            values[name] = kind(value)
        except ValueError:
            problems.append(f"{key} ({value!r}) must be a{'n int' if kind is int else ' number'}")
    if problems:
        raise ValueError(f"step model ({text!r}): " + "; ".join(problems))
    return StepModel(**values)


def dense_bytes(model: StepModel, element_size: int = 4) -> int:
    """Bytes of the data-parallel (dense) parameters whose gradients every row reduces: L + 1 dense pairs
    (2 M F weights, F + M biases) and L gates (E M)."""
    pair = 2 * model.hidden * model.dense_ffn + model.dense_ffn + model.hidden
    return ((model.blocks + 1) * pair + model.blocks * model.experts * model.hidden) * element_size


def exchange_bytes(model: StepModel, element_size: int = 4) -> int:
    """Bytes of one rank's dispatch buffer (one all-to-all's input): E x T x M, T = ceil(k f S / E) (the core's
    capacity rule, min_capacity 0 as the step model builds its layers)."""
    capacity = math.ceil(model.k * model.capacity_factor * model.tokens / model.experts)
    return model.experts * capacity * model.hidden * element_size


@dataclass(frozen=True, kw_only=True)
class StepRowKind:
    """A row kind: the options it takes and its builder, ``module:function`` (imported on the ranks)."""

    options: Tuple[str, ...]
    build: str
    about: str


# The row kinds. Host rows (``deepspeed``, ``deepspeed@lina,kib=N``, ``megatron``, ``megatron@lina,kib=N``) run
# the same network through the real host: moe_plugins.tools.bench.lina_hosts.
STEP_ROW_KINDS: Dict[str, StepRowKind] = {
    "sync": StepRowKind(options=(), build="moe_plugins.tools.bench.lina_step:build_sync",
                        about="all-reduce after backward, one flat buffer (stock DeepSpeed on CPU)"),
    "fifo": StepRowKind(options=("bucket_mb",), build="moe_plugins.tools.bench.lina_step:build_fifo",
                        about="one non-yielding background op per gradient (or per bucket of bucket_mb MB) during "
                              "backward (no priority, no chunks)"),
    "lina": StepRowKind(options=("kib", "mb", "bucket_mb"), build="moe_plugins.tools.bench.lina_step:build_lina",
                        about="Lina's micro-ops (kib=N KiB or mb=X MB), yielding to exchanges"),
    "noreduce": StepRowKind(options=(), build="moe_plugins.tools.bench.lina_step:build_noreduce",
                            about="timing reference: no reduction"),
    "deepspeed": StepRowKind(options=("lina", "kib", "mb"), build="moe_plugins.tools.bench.lina_hosts:build_deepspeed",
                             about="deepspeed.initialize (ZeRO 0) over DeepSpeed MoE layers with the plugin; "
                                   "@lina,kib=N: its Lina section"),
    "megatron": StepRowKind(options=("lina", "kib", "mb", "bucket_mb"),
                            build="moe_plugins.tools.bench.lina_hosts:build_megatron",
                            about="Megatron-core DDP (overlap_grad_reduce) over the plugin's MoE layers; "
                                  "@lina,kib=N: its Lina section"),
}
HOSTS = ("deepspeed", "megatron")
REFERENCE, NO_PRIORITY, LINA = "noreduce", "fifo", "lina"


@dataclass(frozen=True, kw_only=True)
class StepRowSpec(RowSpec):
    """The layer bench's row spec, where a bare ``@word`` is also allowed: the option ``word=on``."""

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + "@" + ",".join(k if v == "on" else f"{k}={v}" for k, v in self.options)


def parse_step_row(text: str) -> StepRowSpec:
    name, at, opts = text.strip().partition("@")
    if not re.fullmatch(r"[A-Za-z0-9_.+\-]+", name):
        raise ValueError(f"row ({text!r}): the name must be letters, digits, or _ . + -")
    options = []
    for item in opts.split(",") if at else ():
        key, eq, value = item.partition("=")
        if not key or (eq and not value):
            raise ValueError(f"row ({text!r}): option {item!r} must be key=value or a word")
        options.append((key, value if eq else "on"))
    return StepRowSpec(name=name, options=tuple(options))


def micro_op_bytes_of(spec: StepRowSpec) -> int:
    """A lina row's micro-op size in bytes: ``kib=N`` (N x 1024) or ``mb=X`` (X x 10^6)."""
    kib, mb = spec.option("kib"), spec.option("mb")
    if (kib is None) == (mb is None):
        raise ValueError(f"row {spec.label!r}: give the micro-op size as exactly one of kib=N or mb=X")
    try:
        size = int(kib) * KIB if kib is not None else int(round(float(mb) * MB))
    except ValueError:
        raise ValueError(f"row {spec.label!r}: kib must be an integer and mb a number") from None
    if size <= 0:
        raise ValueError(f"row {spec.label!r}: the micro-op size ({size} B) must be > 0")
    return size


def bucket_bytes_of(spec: StepRowSpec) -> int:
    """A row's gradient bucket in bytes (``bucket_mb=X``, X x 10^6; gradients gathered in arrival order until
    a bucket holds at least that much, as DDP and DeepSpeed bucket); 0 (the default): one op per gradient."""
    text = spec.option("bucket_mb")
    if text is None:
        return 0
    try:
        size = int(round(float(text) * MB))
    except ValueError:
        raise ValueError(f"row {spec.label!r}: bucket_mb ({text!r}) must be a number") from None
    if size <= 0:
        raise ValueError(f"row {spec.label!r}: bucket_mb ({text!r}) must be > 0")
    return size


def step_row_problems(spec: StepRowSpec) -> List[str]:
    kind = STEP_ROW_KINDS.get(spec.name)
    if kind is None:
        return [f"row {spec.label!r}: unknown; known rows: {', '.join(STEP_ROW_KINDS)}"]
    bad = [k for k, _ in spec.options if k not in kind.options]
    if bad:
        return [f"row {spec.label!r}: option(s) {', '.join(bad)} not among {list(kind.options) or 'none'}"]
    out = []
    if spec.name in HOSTS and spec.option("lina") is None and (spec.option("kib") or spec.option("mb")):
        out.append(f"row {spec.label!r}: kib / mb size Lina's micro-ops: add lina (e.g. {spec.name}@lina,kib=128)")
    lina = spec.name == LINA or (spec.name in HOSTS and spec.option("lina") is not None)
    checks = [bucket_bytes_of] + ([micro_op_bytes_of] if lina else [])
    for check in checks:
        try:
            check(spec)
        except ValueError as exc:
            out.append(str(exc))
    return out


@dataclass(frozen=True, kw_only=True)
class StepRun:
    """What every step-bench run has: its network (checked by :func:`network_problems`), its counts, and what the
    harness reads (nodes, ranks_per_node, world, iters, warmup, notes, collective_timeout_s). The training-step
    :class:`StepPlan` and the Lancet timeline plan add their rows."""

    model: StepModel
    nodes: int
    ranks_per_node: int
    iters: int
    warmup: int = 2
    seed: int = 0
    collective_timeout_s: float = 300.0
    notes: Tuple[str, ...] = field(default=())

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True, kw_only=True)
class StepPlan(StepRun):
    """One run of the step bench: every rate is one side-by-side group of all rows."""

    rows: Tuple[StepRowSpec, ...]
    rates: Tuple[str, ...]
    iters: int = 10


def network_problems(plan: StepRun) -> List[str]:
    """The problems of a step bench's counts (nodes, ranks_per_node, iters, warmup) and its network
    (``plan.model``, a :class:`StepModel` whose MoE layers are expert parallel over every rank), each naming the
    field and its value (pure; the training-step and Lancet timeline plans share it)."""
    problems = []
    for name in ("nodes", "ranks_per_node", "iters", "warmup"):
        value = getattr(plan, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{name} ({value!r}) must be a positive integer")
    m = plan.model
    sizes = [f"model.{name} ({getattr(m, name)!r}) must be >= 1"
             for name in ("blocks", "tokens", "hidden", "ffn", "experts", "k", "dense_ffn") if getattr(m, name) < 1]
    problems += sizes
    world_ok = all(isinstance(getattr(plan, n), int) and getattr(plan, n) >= 1
                   for n in ("nodes", "ranks_per_node"))
    if not sizes and world_ok and m.experts % plan.world:
        problems.append(f"model.experts ({m.experts}) must be divisible by the world size ({plan.world}): "
                        f"the MoE layers are expert parallel over every rank")
    if not sizes and m.k > m.experts:
        problems.append(f"model.k ({m.k}) must be <= model.experts ({m.experts})")
    if not sizes and exchange_bytes(m) == 0:
        problems.append(f"model.capacity_factor ({m.capacity_factor}) must be > 0")
    return problems


def step_plan_problems(plan: StepPlan) -> List[str]:
    """Every problem with the plan at once, each naming the field and its value."""
    problems = network_problems(plan)
    if not plan.rows:
        problems.append("rows is empty")
    labels = [r.label for r in plan.rows]
    problems += [f"row {x!r} is listed twice" for x in sorted({x for x in labels if labels.count(x) > 1})]
    if REFERENCE not in {r.name for r in plan.rows}:
        problems.append(f"rows must include {REFERENCE!r}: the all-to-all slowdowns are relative to it")
    for row in plan.rows:
        problems += step_row_problems(row)
    megatron_lina = [r.label for r in plan.rows if r.name == "megatron" and r.option("lina") is not None]
    if len(megatron_lina) > 1:
        problems.append(f"rows {', '.join(megatron_lina)}: at most one megatron@lina row per run (one Megatron plugin "
                        f"is enabled at a time, and a Lina one stays enabled)")
    if not plan.rates:
        problems.append("rates is empty")
    for rate in plan.rates:
        try:
            parse_rate(rate)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


SWEEP_KIB = (64, 128, 256, 512, 1024, 2048, 4096)      # the micro-op sizes the issue asks to sweep

# Named plans. ``lina``: the counted run (both rates, the four rows and the micro-op sweep; S = 128 keeps each
# all-to-all small enough to wait behind the all-reduce's queued bytes, see docs/benchmarks.md); ``lina-smoke``:
# the whole path in well under a minute.
STEP_PRESETS: Dict[str, Dict[str, object]] = {
    "lina": dict(nodes=2, ranks_per_node=2, rates=("200mbit", "1gbit"), iters=20, warmup=3,
                 model="L=4,S=128,M=256,H=2048,E=4,k=2,f=1,F=384",
                 rows=("sync", "fifo", "lina@kib=128", "noreduce")
                 + tuple(f"lina@kib={n}" for n in SWEEP_KIB if n != 128)),
    "lina-smoke": dict(nodes=2, ranks_per_node=2, rates=("200mbit",), iters=2, warmup=1,
                       model="L=2,S=32,M=32,H=64,E=4,k=2,f=1,F=64",
                       rows=("sync", "fifo", "lina@kib=8", "noreduce")),
}
