"""Lancet's model-level bench (issue #26, "Benchmark"): the recipes' GPT-2-MoE trained through the real DeepSpeed
host on the emulated cluster, one row per way of running its MoE layers, side by side in one run.

This module is the pure part: the rows (what each one puts in the ds_config), the cases (model sizes, batch and
link rate), and their checks. The rank side is :mod:`.lancet_model_rank`, the exchange meter
:mod:`.lancet_model_meter`, the summary and outputs :mod:`.lancet_model_report`; the command is
``benchmarks/lancet_model.py``.

Rows (``name`` or ``name@key=value,...``):

- ``deepspeed``: stock DeepSpeed (no ``moe_plugins`` section);
- ``baseline`` / ``baseline@r=N``: the plugin's schedule ``baseline`` at PipeMoE's fixed pipeline degree N (1 when
  not given); the rows with N >= 2 are the PipeMoE candidates the report picks the best of;
- ``lancet`` (``@r=N``, ``@partitions=n|auto|tune``, ``@dw=0|1``): schedule ``baseline`` with the section
  ``"lancet": {"defer_wgrad": dw, "partitions": n}`` (dw 1 unless given) at pipeline degree N.
- ``baseline@exchange=ragged``: the baseline sending only the kept routes (Hecate's reference);
- ``hecate`` / ``hecate@prefetch=1`` / ``hecate@r=N`` / ``hecate@reshard=N`` / ``hecate@remat=1``: ``"hecate":
  {"enabled": true, "prefetch": ..., "reshard_every": N, "rematerialize": ...}`` (Hecate's FSSDP, with its early
  gather issued when each MoE block starts; at PipeMoE's degree N; re-homing the experts by Algorithm 2 every N
  optimizer steps, which needs ``--zero 0``; the copies freed after forward and gathered again in backward,
  ``@remat=1,regather=at_need``: only when the backward needs them).

Shapes: B samples per rank, L tokens per sample, M hidden, H expert FFN width, E experts, k routes per token,
f capacity factor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from moe_plugins.tools.bench.matrix import parse_rate

KINDS = ("deepspeed", "baseline", "lancet", "hecate")
OPTIONS: Mapping[str, Tuple[str, ...]] = MappingProxyType({"deepspeed": (), "baseline": ("r", "exchange"),
                                                           "lancet": ("r", "partitions", "dw", "dense"),
                                                           "hecate": ("prefetch", "r", "reshard", "remat",
                                                                      "regather")})
AUTO = "auto"
TUNE = "tune"
DEFAULT_ROWS = ("deepspeed", "baseline", "baseline@r=2", "baseline@r=4", "lancet", "lancet@partitions=2",
                "lancet@partitions=4", "lancet@partitions=auto", "lancet@r=2")
REFERENCE = "deepspeed"          # the rows' losses are compared with this row's
BOUNDS = ("link", "compute")
STEP_TARGET: Mapping[str, float] = MappingProxyType({"link": 0.87, "compute": 1.05})   # step / best PipeMoE's
EXPOSED_TARGET = 0.5                            # exposed all-to-all / the best PipeMoE degree's


@dataclass(frozen=True)
class ModelRow:
    """One parsed row: its label as given, its kind and options (``r``: pipeline degree; ``partitions``: an int
    or ``"auto"``; ``dw``: defer the experts' weight gradients; ``dense``: the dense layers' too, ``dense_wgrad``;
    ``exchange``: the baseline's; ``prefetch``: Hecate's early gather; ``remat``: its re-materialisation)."""

    label: str
    kind: str
    r: int = 1
    partitions: Union[int, str] = 1
    dw: bool = True
    dense: bool = False
    exchange: str = "padded"
    prefetch: bool = False
    reshard: int = 0
    remat: bool = False
    regather: str = "early"

    @property
    def pipemoe_candidate(self) -> bool:
        """A fixed PipeMoE degree >= 2 without Lancet: the rows the reference is the best of."""
        return self.kind == "baseline" and self.r >= 2

    @property
    def padded(self) -> bool:
        """Whether it sends the padded (E, C, M) exchange; batch partitions, the ragged exchange and Hecate send only
        the kept routes."""
        return self.partitions == 1 and self.exchange == "padded" and self.kind != "hecate"

    def section(self) -> Optional[Dict[str, Any]]:
        """The ``moe_plugins`` section of the row's ds_config (None: stock DeepSpeed)."""
        if self.kind == "deepspeed":
            return None
        out: Dict[str, Any] = {"schedule": "baseline", "pipeline_degree": self.r}
        if self.exchange != "padded":
            out["exchange"] = self.exchange
        if self.kind == "hecate":
            out["hecate"] = {"enabled": True, "prefetch": self.prefetch, "reshard_every": self.reshard,
                             "rematerialize": self.remat, "regather": self.regather}
        if self.kind == "lancet":
            out["lancet"] = {"defer_wgrad": self.dw, "partitions": self.partitions}
            if self.dense:
                out["lancet"]["dense_wgrad"] = True
        return out


def _int_option(label: str, key: str, value: str, low: int) -> int:
    if not re.fullmatch(r"\d+", value) or int(value) < low:
        raise ValueError(f"row ({label!r}): option {key} ({value!r}) must be an integer >= {low}")
    return int(value)


def parse_row(label: str) -> ModelRow:
    """``name`` or ``name@key=value,key=value``; a ValueError naming the row, the option and what is allowed."""
    kind, _, opts = label.partition("@")
    if kind not in KINDS:
        raise ValueError(f"row ({label!r}): {kind!r} is unknown; allowed: {', '.join(KINDS)}")
    values: Dict[str, Any] = {}
    for item in [o for o in opts.split(",") if o] if opts else []:
        key, eq, value = item.partition("=")
        if not eq or key not in OPTIONS[kind]:
            allowed = ", ".join(OPTIONS[kind]) or "none"
            raise ValueError(f"row ({label!r}): option {item!r} is unknown for {kind}; allowed: {allowed}")
        if key in values:
            raise ValueError(f"row ({label!r}): option {key} is given twice")
        if key == "partitions":
            values[key] = value if value in (AUTO, TUNE) else _int_option(label, key, value, 1)
        elif key == "regather":
            if value not in ("early", "at_need"):
                raise ValueError(f"row ({label!r}): option regather ({value!r}) must be early or at_need")
            values[key] = value
        elif key == "exchange":
            if value not in ("padded", "ragged"):
                raise ValueError(f"row ({label!r}): option exchange ({value!r}) must be padded or ragged")
            values[key] = value
        elif key in ("dw", "dense", "prefetch", "remat"):
            if value not in ("0", "1"):
                raise ValueError(f"row ({label!r}): option {key} ({value!r}) must be 0 or 1")
            values[key] = value == "1"
        else:
            values[key] = _int_option(label, key, value, 1)
    row = ModelRow(label, kind, **values)
    if row.partitions != 1 and row.r != 1:
        raise ValueError(f"row ({label!r}): partitions ({row.partitions}) need pipeline degree r 1 (the partitions "
                         f"replace PipeMoE's chunks), not {row.r}")
    return row


def rows_problems(labels: List[str]) -> List[str]:
    """Every problem of a row list at once (empty: fine)."""
    problems: List[str] = []
    for label in labels:
        try:
            parse_row(label)
        except ValueError as exc:
            problems.append(str(exc))
    problems += [f"row {r!r} is listed twice" for r in sorted(set(labels)) if labels.count(r) > 1]
    if REFERENCE not in labels:
        problems.append(f"rows must include {REFERENCE!r} (the losses are compared with it)")
    if not any(parse_row(r).pipemoe_candidate for r in labels if not _fails(r)):
        problems.append("rows need at least one PipeMoE candidate (baseline@r=N, N >= 2): the targets compare "
                        "with the best of them")
    return problems


def _fails(label: str) -> bool:
    try:
        parse_row(label)
    except ValueError:
        return True
    return False


# ---- cases -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ModelCase:
    """One model size, batch and link rate. ``bound``: which target applies (``link``: step <= 0.87x the best
    PipeMoE degree; ``compute``: <= 1.05x); the report also shows the measured share of the step the stock row
    spends blocked in exchanges."""

    name: str
    bound: str
    rate: str
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    ffn: int = 256
    seq_len: int = 64
    batch: int = 8
    experts: int = 4
    k: int = 2
    capacity_factor: float = 1.0
    vocab: int = 512
    moe_every: int = 2
    drop: int = 1                  # 1: DeepSpeed drops routes past the capacity; 0: dropless (padded to the largest)
    skew: float = 0.0              # > 0: each MoE gate biased towards expert 0, aiming at this share of the routes
    grade: float = 0.0             # > 0: each MoE gate's expert e favoured by grade (1 - e / (E - 1)) (lancet_model_rank)

    def capacity(self) -> int:
        """C: DeepSpeed's capacity per expert for S = B L tokens (top-2: ceil(2 f S / E); top-1: ceil(f S / E))."""
        tokens = self.batch * self.seq_len
        return -(-int(self.k * self.capacity_factor * tokens) // self.experts)

    def exchange_bytes(self) -> int:
        """Bytes one rank puts into one padded all-to-all: E C M fp32 values."""
        return self.experts * self.capacity() * self.hidden * 4

    def moe_layers(self) -> int:
        return len([i for i in range(self.layers) if i % self.moe_every == self.moe_every - 1])

    def describe(self) -> str:
        return (f"{self.name} ({self.bound}-bound target): GPT-2-MoE {self.layers} blocks (MoE every "
                f"{self.moe_every}: {self.moe_layers()} MoE layers), M {self.hidden}, heads {self.heads}, H "
                f"{self.ffn}, E {self.experts}, k {self.k}, f {self.capacity_factor:g}"
                f"{'' if self.drop else ' dropless'}{f', gate skew {self.skew:g}' if self.skew else ''}"
                f"{f', gate grade {self.grade:g}' if self.grade else ''}, "
                f"vocab {self.vocab}; "
                f"B {self.batch} x L {self.seq_len} per rank; link {self.rate}; padded exchange "
                f"{self.exchange_bytes() / 1024:.0f} KiB per rank")


# 5 blocks, MoE blocks 1 and 3: after each MoE block a dense block (and the next block's attention) that batch
# partitions can run while the other partitions' exchanges fly
PRESETS: Mapping[str, ModelCase] = MappingProxyType({
    # a narrow model, many tokens, a slow link: the all-to-alls are most of the step and most of the link's bytes
    # (smoke, 2 x 2, quiet machine: stock DeepSpeed blocked in them 64% of its step, 156 ms at 1gbit)
    "link": ModelCase(name="link", bound="link", rate="100mbit", layers=5, hidden=64, heads=4, ffn=128, seq_len=128,
                      batch=8, experts=4),
    # wider experts on a fast link: compute is most of the step
    "compute": ModelCase(name="compute", bound="compute", rate="1gbit", layers=5, hidden=128, heads=4, ffn=1024,
                         seq_len=128, batch=8, experts=4),
    # the tests' and smoke runs' size
    "tiny": ModelCase(name="tiny", bound="compute", rate="1gbit", layers=4, hidden=16, heads=2, ffn=32, seq_len=8,
                      batch=4, experts=4, vocab=64),
})
_INT_FIELDS = tuple(f.name for f in fields(ModelCase) if f.type in ("int", int))


def parse_case(text: str) -> ModelCase:
    """``preset`` or ``preset:key=value,...`` (keys: the :class:`ModelCase` fields); a ValueError naming them."""
    name, _, opts = text.partition(":")
    if name not in PRESETS:
        raise ValueError(f"case ({text!r}): preset {name!r} is unknown; allowed: {', '.join(PRESETS)}")
    case, changes = PRESETS[name], {}
    for item in [o for o in opts.split(",") if o]:
        key, eq, value = item.partition("=")
        if not eq or key not in {f.name for f in fields(ModelCase)} - {"name"}:
            raise ValueError(f"case ({text!r}): {item!r} is not key=value with a key among "
                             f"{', '.join(f.name for f in fields(ModelCase) if f.name != 'name')}")
        if key in _INT_FIELDS:
            if not re.fullmatch(r"\d+", value):
                raise ValueError(f"case ({text!r}): {key} ({value!r}) must be a positive integer")
            changes[key] = int(value)
        elif key in ("capacity_factor", "skew", "grade"):
            try:
                changes[key] = float(value)
            except ValueError:
                raise ValueError(f"case ({text!r}): {key} ({value!r}) must be a number") from None
        else:
            changes[key] = value
    return replace(case, **changes)


def case_problems(case: ModelCase, world: int, rows: List[ModelRow]) -> List[str]:
    """Every problem of a case on ``world`` ranks (EP = world) with these rows, at once."""
    where = f"case {case.name!r}"
    problems = [f"{where}: {n} ({getattr(case, n)}) must be >= 1" for n in _INT_FIELDS
                if n != "drop" and getattr(case, n) < 1]
    if problems:
        return problems
    if case.bound not in BOUNDS:
        problems.append(f"{where}: bound ({case.bound!r}) must be one of {', '.join(BOUNDS)}")
    try:
        parse_rate(case.rate)
    except ValueError as exc:
        problems.append(f"{where}: {exc}")
    if case.experts % world:
        problems.append(f"{where}: experts ({case.experts}) must be a multiple of the world ({world}): EP = world")
    if case.hidden % case.heads:
        problems.append(f"{where}: hidden ({case.hidden}) must be a multiple of heads ({case.heads})")
    if case.k not in (1, 2):
        problems.append(f"{where}: k ({case.k}) must be 1 or 2 (DeepSpeed's gates)")
    if case.drop not in (0, 1):
        problems.append(f"{where}: drop ({case.drop}) must be 0 (dropless) or 1")
    if case.skew and not 1 / case.experts < case.skew <= 1 / case.k:
        problems.append(f"{where}: skew ({case.skew:g}) must lie in (1/E, 1/k] = ({1 / case.experts:g}, "
                        f"{1 / case.k:g}]: the hot expert's share of the routes, each token routing to it once")
    if case.grade < 0 or (case.grade and case.skew):
        problems.append(f"{where}: grade ({case.grade:g}) must be >= 0, and not given with skew ({case.skew:g})")
    if not case.moe_layers():
        problems.append(f"{where}: layers ({case.layers}) hold no MoE block at moe_every {case.moe_every}")
    for row in rows:
        if isinstance(row.partitions, int) and case.batch % row.partitions:
            problems.append(f"{where}: row {row.label!r}: partitions ({row.partitions}) must divide batch "
                            f"({case.batch})")
        if row.r > case.capacity():
            problems.append(f"{where}: row {row.label!r}: pipeline degree r ({row.r}) must be at most the capacity "
                            f"({case.capacity()})")
    return problems


def parse_layout(text: str) -> Tuple[int, int]:
    """``NxR``: N nodes x R ranks per node (N >= 2)."""
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or int(m.group(1)) < 2 or int(m.group(2)) < 1:
        raise ValueError(f"layout ({text!r}) must be NxR: N >= 2 nodes x R >= 1 ranks per node (2x1, 2x2)")
    return int(m.group(1)), int(m.group(2))
