"""The benchmark plan: MoE layer cases x rows x link rates, as small typed configs and pure parsers.

A *case* is one MoE layer and its parallel layout, in the papers' letters: S tokens per rank, M model dim,
H FFN hidden, E experts, k routes per token, f capacity factor, and the MP / EP / ESP degrees.
A *row* is one implementation of that layer: a schedule name from the registry (``moe_plugins.plugins.default_registry()``)
(with options such as the pipeline degree ``r``) or a stock layer (``deepspeed``, ``megatron``).
A *rate* is a tc rate for the inter-node link (``200mbit``, ``1gbit``) or ``unshaped``.

Written on the command line as:

- case: ``S=512,M=256,H=512,E=8,k=2,f=1.0,ep=4``; a value list ``S=256/512/1024`` expands to one case per
  value (the product over all lists), which is how sweeps are written; ``skew=0.5`` makes expert 0 the first
  choice of half of every rank's tokens (and of no other token), ``drop=false`` a dropless case;
- row: ``baseline``, ``baseline@r=4``, ``baseline@exchange=ragged``, ``megatron@dispatcher=allgather``,
  ``deepspeed@plugin=baseline``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

DTYPES = ("float32", "bfloat16")
UNSHAPED = "unshaped"
_RATE_UNITS = {"bit": 1, "kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9}   # tc's units: SI, bits per second


@dataclass(frozen=True, kw_only=True)
class CaseConfig:
    """One MoE layer (paper letters) and its parallel layout."""

    tokens: int                 # S, tokens per rank (B*L)
    hidden: int                 # M
    ffn: int                    # H
    experts: int                # E
    k: int = 2
    capacity_factor: float = 1.0    # f
    min_capacity: int = 0
    drop_tokens: bool = True
    mp: int = 1
    ep: int = 1
    esp: int = 1
    skew: float = 0.0           # the share of tokens whose first choice is expert 0 (0: the plain random gate)
    drift: int = 0              # with skew: the hot expert moves on to the next one every ``drift`` rounds (0: stays)

    @property
    def label(self) -> str:
        drop = "" if self.drop_tokens else " dropless"
        skew = f" skew{self.skew:g}" if self.skew else ""
        drift = f" drift{self.drift}" if self.drift else ""
        return (f"S{self.tokens} M{self.hidden} H{self.ffn} E{self.experts} k{self.k} f{self.capacity_factor:g} "
                f"mp{self.mp} ep{self.ep} esp{self.esp}{drop}{skew}{drift}")


@dataclass(frozen=True, kw_only=True)
class RowSpec:
    """A row of the matrix: a registered name plus ``key=value`` options."""

    name: str
    options: Tuple[Tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + "@" + ",".join(f"{k}={v}" for k, v in self.options)

    def option(self, key: str, default: Optional[str] = None) -> Optional[str]:
        return dict(self.options).get(key, default)


def row_schedule(spec: RowSpec) -> str:
    """The schedule a row runs: a plugin row's name, or a host row's ``plugin`` option (``deepspeed@plugin=...``:
    the schedule the host adapter swaps in); a stock row's own name otherwise (pure)."""
    return spec.option("plugin", spec.name)


@dataclass(frozen=True, kw_only=True)
class BenchPlan:
    """Everything one ``moe-plugins bench`` run measures; every (case, rate) is one side-by-side group."""

    nodes: int
    ranks_per_node: int
    cases: Tuple[CaseConfig, ...]
    rows: Tuple[RowSpec, ...]
    rates: Tuple[str, ...]
    iters: int = 10
    warmup: int = 3
    seed: int = 0
    dtype: str = "float32"
    collective_timeout_s: float = 300.0
    notes: Tuple[str, ...] = field(default=())
    profile_repeats: Optional[int] = None    # timed runs per size of the auto rows' profile (None: profiles.py's)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


def parse_rate(text: str) -> Optional[int]:
    """A tc rate (``200mbit``, ``1.5gbit``) in bits per second; ``unshaped`` gives None."""
    if text == UNSHAPED:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate ({text!r}) must be a positive number followed by bit, kbit, mbit or gbit "
                         f"(tc's SI units), or {UNSHAPED!r}")
    return int(round(float(m.group(1)) * _RATE_UNITS[m.group(2)]))


def parse_row(text: str) -> RowSpec:
    """``name`` or ``name@key=value,key=value``."""
    name, _, opts = text.partition("@")
    if not re.fullmatch(r"[A-Za-z0-9_.+\-]+", name):
        raise ValueError(f"row ({text!r}): the name must be letters, digits, or _ . + -")
    options = []
    for item in filter(None, opts.split(",")) if opts else ():
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"row ({text!r}): option {item!r} must be key=value")
        options.append((key, value))
    if opts and not options:
        raise ValueError(f"row ({text!r}): nothing after '@'")
    return RowSpec(name=name, options=tuple(options))


# flag letter -> (CaseConfig field, type)
CASE_KEYS: Dict[str, Tuple[str, type]] = {
    "S": ("tokens", int), "M": ("hidden", int), "H": ("ffn", int), "E": ("experts", int), "k": ("k", int),
    "f": ("capacity_factor", float), "min_capacity": ("min_capacity", int), "drop": ("drop_tokens", bool),
    "mp": ("mp", int), "ep": ("ep", int), "esp": ("esp", int), "skew": ("skew", float), "drift": ("drift", int),
}


def _convert(key: str, value: str, kind: type):
    if kind is bool:
        if value.lower() not in ("0", "1", "true", "false"):
            raise ValueError(f"{key} ({value!r}) must be true/false/1/0")
        return value.lower() in ("1", "true")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{key} ({value!r}) must be a{'n int' if kind is int else ' number'}") from None


def parse_cases(text: str) -> List[CaseConfig]:
    """``S=512,M=256,H=512,E=8,k=2,f=1,ep=4``; ``S=256/512`` expands to one case per value."""
    axes: Dict[str, list] = {}
    problems, seen = [], set()
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in CASE_KEYS:
            problems.append(f"{item!r} is not KEY=VALUE with KEY one of {', '.join(CASE_KEYS)}")
            continue
        seen.add(key)
        fname, kind = CASE_KEYS[key]
        try:
            axes[fname] = [_convert(key, v, kind) for v in value.split("/")]
        except ValueError as exc:
            problems.append(str(exc))
    missing = [k for k in ("S", "M", "H", "E") if k not in seen]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if problems:
        raise ValueError(f"case ({text!r}): " + "; ".join(problems))
    names = list(axes)
    return [CaseConfig(**dict(zip(names, values))) for values in itertools.product(*(axes[n] for n in names))]


def case_problems(case: CaseConfig, world: int, ranks_per_node: int) -> List[str]:
    """Every reason ``case`` cannot run on ``world`` ranks (reuses the core's layout and config checks)."""
    from moe_plugins.core.config import moe_config_problems
    from moe_plugins.core.layout import ParallelLayout, layout_problems
    problems = layout_problems(world, ranks_per_node, case.mp, case.ep, case.esp)
    if case.tokens < 1:
        problems.append(f"S ({case.tokens}) must be >= 1")
    if not 0.0 <= case.skew <= 1.0:
        problems.append(f"skew ({case.skew:g}) must be between 0 and 1 (the hot expert's share of first choices)")
    if case.drift < 0:
        problems.append(f"drift ({case.drift}) must be >= 0 (rounds before the hot expert moves on; 0: it stays)")
    elif case.drift and not case.skew:
        problems.append(f"drift ({case.drift}) moves the hot expert: it needs skew > 0")
    elif case.drift and case.experts > case.hidden:
        problems.append(f"drift ({case.drift}) gives each expert a gate direction of its own: it needs E "
                        f"({case.experts}) <= M ({case.hidden})")
    if problems:
        return [f"case [{case.label}]: {p}" for p in problems]
    layout = ParallelLayout(world=world, ranks_per_node=ranks_per_node, mp=case.mp, ep=case.ep, esp=case.esp)
    return [f"case [{case.label}]: {p}" for p in moe_config_problems(moe_config(case), layout)]


def moe_config(case: CaseConfig):
    from moe_plugins.core.config import MoEConfig
    return MoEConfig(hidden=case.hidden, ffn=case.ffn, num_experts=case.experts, k=case.k,
                     capacity_factor=case.capacity_factor, min_capacity=case.min_capacity,
                     drop_tokens=case.drop_tokens)


def plan_problems(plan: BenchPlan, row_problems: Callable[["RowSpec"], List[str]] = lambda spec: []) -> List[str]:
    """Every problem with the plan at once, each naming the field and its value; ``row_problems`` checks each
    row (:func:`moe_plugins.tools.bench.rows.row_problems`, which builds on this module)."""
    problems = []
    optional = ("profile_repeats",) if plan.profile_repeats is not None else ()
    for name in ("nodes", "ranks_per_node", "iters") + optional:
        value = getattr(plan, name)
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name} ({value!r}) must be a positive integer")
    if not isinstance(plan.warmup, int) or plan.warmup < 1:
        problems.append(f"warmup ({plan.warmup!r}) must be >= 1 (the first round measures traffic and agreement)")
    if plan.dtype not in DTYPES:
        problems.append(f"dtype ({plan.dtype!r}) must be one of {', '.join(DTYPES)}")
    for label, items in (("cases", plan.cases), ("rows", plan.rows), ("rates", plan.rates)):
        if not items:
            problems.append(f"{label} is empty")
    labels = [r.label for r in plan.rows]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        problems.append(f"rows ({', '.join(dupes)}) are listed twice")
    for rate in plan.rates:
        try:
            parse_rate(rate)
        except ValueError as exc:
            problems.append(str(exc))
    if problems and any(p.startswith(("nodes", "ranks_per_node")) for p in problems):
        return problems
    for case in plan.cases:
        problems += case_problems(case, plan.world, plan.ranks_per_node)
    for row in plan.rows:
        problems += row_problems(row)
    return problems


LANCET_ROWS = ("deepspeed", "baseline", "baseline@r=2", "baseline@r=4", "baseline@r=auto", "lancet", "lancet@r=2")

# Named plans. ``committed`` is the run in benchmarks/results/ (2 emulated nodes x 2 ranks, two link rates,
# the baseline schedule against both stock layers); ``smoke`` is a seconds-long check of the whole path.
PRESETS: Dict[str, Dict[str, object]] = {
    "committed": dict(nodes=2, ranks_per_node=2, rates=("1gbit", "200mbit"), iters=20, warmup=3,
                      cases="S=1024,M=256,H=512,E=8,k=2,f=1.0,ep=4",
                      rows=("baseline", "deepspeed", "megatron")),
    "smoke": dict(nodes=2, ranks_per_node=2, rates=("200mbit",), iters=3, warmup=1,
                  cases="S=64,M=32,H=64,E=4,k=2,f=1.0,ep=4", rows=("baseline", "deepspeed", "megatron")),
    # Lancet (#26): the rows side by side, H = 256 (the link dominates) and 2048 (the experts do) at
    # 200 Mbit/s and 1 Gbit/s; EP over every rank (2 x 1: ep=2, 2 x 2: ep=4, S halved to stay within ~6 minutes)
    "lancet-2x1": dict(nodes=2, ranks_per_node=1, rates=("200mbit", "1gbit"), iters=12, warmup=2,
                       cases="S=1024,M=256,H=256/2048,E=8,k=2,f=1.0,ep=2", rows=LANCET_ROWS),
    "lancet-2x2": dict(nodes=2, ranks_per_node=2, rates=("200mbit", "1gbit"), iters=12, warmup=2,
                       cases="S=512,M=256,H=256/2048,E=8,k=2,f=1.0,ep=4", rows=LANCET_ROWS),
    "lancet-smoke": dict(nodes=2, ranks_per_node=2, rates=("200mbit",), iters=2, warmup=1,
                         cases="S=64,M=32,H=64,E=4,k=2,f=1.0,ep=4", rows=LANCET_ROWS),
}
