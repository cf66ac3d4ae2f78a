"""Lina's expert-popularity estimation for inference (§5.2), as pure functions over routing records.

A *routing record* is one token's top-1 expert at every MoE layer of the model, in layer order (``records_NL``:
N tokens, L MoE layers; the gate's first choice, before any capacity drop). Layers are MoE layers numbered
from 0.

**Path.** The paper groups the tokens by the experts they took on the ``n`` layers before ``l`` (their *sample
path*) and profiles, per path, the distribution of the expert at ``l``; it schedules from the fourth MoE layer
with ``n = 3`` (§7.1). Here the path of a token at layer ``l`` is its experts on layers
``max(0, l - n) .. l - 1`` (:func:`path_span`): the paper's ``n`` once ``l >= n``, and the whole prefix below
that, so that a model with fewer MoE layers than the paper's (the recipes' tiny GPT-2-MoE has 2) still has a
table from ``start_layer >= 1``. The default ``n`` is the paper's 3. ``start_layer = 0`` is allowed too: layer
0's path is empty, so its estimate is the layer's profiled marginal, the same for every batch (this
reproduction's extension: the paper does not say how the layers before its start are served; with the marginal
they get phase one from the profile instead of no scheduling).

**Table.** Per layer ``l >= start_layer``: the counts of the expert at ``l`` per path seen, and the layer's
marginal counts. P(expert at l | path) is the path's counts normalised; a path seen fewer than ``min_count``
times (default 1: never seen) falls back to the layer's marginal distribution.

**Estimate** (:func:`expected_loads`). For a batch, the expected tokens of expert ``e`` at ``l`` is the sum over
its tokens of P(e | the token's actual path). The paper keeps each token's top-k experts only ("we pick the
top-k expert(s) ... and use their probabilities"); ``keep`` does that, and ``keep=None`` (the default) keeps the
whole distribution, the unbiased expected count: the paper uses ``k`` both for the gate (1 in inference, §7.1)
and for the compared set (2, §7.3.2), so its truncation is ambiguous, and on the recipe model the full
distribution was at least as accurate (docs/lina.md, "Inference").

**Accuracy** (:func:`estimation_accuracy`), the paper's §7.3.2 definition, which is also phase two's test: for
one batch at one layer, the estimate is accurate when the set of the ``top`` most loaded experts by estimate
equals the set of the ``top`` most loaded by the gate's actual counts (order inside the set ignored; ties
broken by lower expert id, :func:`top_set`; where fewer than ``top`` experts got tokens, when the estimate's set
holds those that did, :func:`top_matches`). Accuracy is the fraction of (batch, layer >= start_layer) pairs
that are accurate. ``top`` defaults to the paper's 2; with ``num_experts <= top`` every estimate is accurate.
A finer figure beside it: the mean total-variation distance between the estimated and actual load shares.

**File.** A versioned JSON table (:func:`save_table`, :func:`load_table`). Loading refuses a missing file, a
file of another schema or schema version, and, given the model's facts, a table of another model, listing
every mismatch at once (:class:`TableError`, a ``ValueError``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

SCHEMA = "moe_plugins.lina.popularity"
SCHEMA_VERSION = 1
DEFAULT_PATH_LENGTH = 3        # §7.1
DEFAULT_TOP = 2                # §7.3.2: the top-2 set, as phase two compares

Path_ = Tuple[int, ...]
Counts = Tuple[int, ...]


class TableError(ValueError):
    """A popularity table that cannot be used: missing, of another schema, malformed, or of another model."""


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What a table must agree on with the model it estimates for."""
    num_layers: int            # MoE layers
    num_experts: int           # experts per MoE layer
    top_k: int                 # the gate's k

    def __post_init__(self) -> None:
        problems = [f"{name} ({getattr(self, name)!r}) must be an integer >= 1"
                    for name in ("num_layers", "num_experts", "top_k") if not _is_int(getattr(self, name), 1)]
        if problems:
            raise ValueError("model facts: " + "; ".join(problems))

    def mismatches(self, model: "ModelFacts") -> List[str]:
        """One line per field where this (the table's) differs from ``model``."""
        return [f"{name}: table {getattr(self, name)}, model {getattr(model, name)}"
                for name in ("num_layers", "num_experts", "top_k") if getattr(self, name) != getattr(model, name)]


@dataclass(frozen=True, kw_only=True)
class LayerCounts:
    """Counts of the expert at one layer: ``marginal`` (length E) and, per path, ``paths[path]`` (length E)."""
    layer: int
    marginal: Counts
    paths: Mapping[Path_, Counts]


@dataclass(frozen=True, kw_only=True)
class PopularityTable:
    model: ModelFacts
    start_layer: int
    path_length: int
    tokens: int                          # routing records the counts came from
    layers: Tuple[LayerCounts, ...]      # layers start_layer .. num_layers - 1, in order

    def counts(self, layer: int) -> LayerCounts:
        if not _is_int(layer, self.start_layer) or layer >= self.model.num_layers:
            raise ValueError(f"layer ({layer!r}) must be in [{self.start_layer}, {self.model.num_layers}) "
                             f"(the table's start_layer .. num_layers - 1)")
        return self.layers[layer - self.start_layer]

    def distribution(self, layer: int, path: Path_, min_count: int = 1) -> Tuple[float, ...]:
        """P(expert at ``layer`` | ``path``), or the layer's marginal when the path has < ``min_count`` tokens."""
        counts = self.counts(layer)
        row = counts.paths.get(tuple(path))
        if row is None or sum(row) < min_count:
            row = counts.marginal
        total = sum(row)
        if total == 0:                    # a layer with no tokens at all: nothing known, uniform
            return tuple(1.0 / self.model.num_experts for _ in row)
        return tuple(c / total for c in row)


# ---- building ---------------------------------------------------------------------------------------------

def path_span(layer: int, path_length: int) -> range:
    """The layers whose experts form a token's path at ``layer``: the ``path_length`` before it, or fewer."""
    return range(max(0, layer - path_length), layer)


def check_records(records_NL: Sequence[Sequence[int]], model: ModelFacts, *, name: str = "records") -> None:
    """Every row has one expert id in [0, E) per layer; the first bad row is named."""
    for i, row in enumerate(records_NL):
        if len(row) != model.num_layers:
            raise ValueError(f"{name}[{i}] has {len(row)} entries; expected one per MoE layer "
                             f"({model.num_layers})")
        for layer, e in enumerate(row):
            if not _is_int(e, 0) or e >= model.num_experts:
                raise ValueError(f"{name}[{i}][{layer}] ({e!r}) must be an expert id in [0, {model.num_experts})")


def build_table(records_NL: Sequence[Sequence[int]], model: ModelFacts, *, start_layer: int,
                path_length: int = DEFAULT_PATH_LENGTH) -> PopularityTable:
    """Count, per layer ``l >= start_layer``, the expert at ``l`` per path and overall."""
    problems = []
    if not _is_int(start_layer, 0) or start_layer >= model.num_layers:
        problems.append(f"start_layer ({start_layer!r}) must be in [0, {model.num_layers}) (the model's MoE layers; "
                        "layer 0 has an empty path: its profiled marginal)")
    if not _is_int(path_length, 1):
        problems.append(f"path_length ({path_length!r}) must be an integer >= 1")
    if problems:
        raise ValueError("; ".join(problems))
    check_records(records_NL, model)
    layers = []
    for layer in range(start_layer, model.num_layers):
        span = path_span(layer, path_length)
        marginal = [0] * model.num_experts
        paths: Dict[Path_, List[int]] = {}
        for row in records_NL:
            e = row[layer]
            marginal[e] += 1
            paths.setdefault(tuple(row[j] for j in span), [0] * model.num_experts)[e] += 1
        layers.append(LayerCounts(layer=layer, marginal=tuple(marginal),
                                  paths=MappingProxyType({p: tuple(c) for p, c in sorted(paths.items())})))
    return PopularityTable(model=model, start_layer=start_layer, path_length=path_length,
                           tokens=len(records_NL), layers=tuple(layers))


# ---- estimating -------------------------------------------------------------------------------------------

def expected_loads(table: PopularityTable, layer: int, prefixes_NL: Iterable[Sequence[int]], *,
                   keep: Optional[int] = None, min_count: int = 1) -> Tuple[float, ...]:
    """Estimated tokens per expert at ``layer`` for a batch, from each token's experts on the layers before it
    (rows of at least ``layer`` entries; full routing records do). ``keep``: each token's ``keep`` most
    probable experts only (ties: lower id), the paper's truncation; None keeps all."""
    span = path_span(layer, table.path_length)
    paths: Dict[Path_, int] = {}
    for i, row in enumerate(prefixes_NL):
        if len(row) < layer:
            raise ValueError(f"prefixes[{i}] has {len(row)} entries; layer {layer} needs the experts of the "
                             f"{layer} MoE layers before it")
        path = tuple(row[j] for j in span)
        paths[path] = paths.get(path, 0) + 1
    return path_loads(table, layer, paths, keep=keep, min_count=min_count)


def path_loads(table: PopularityTable, layer: int, path_counts: Mapping[Path_, int], *,
               keep: Optional[int] = None, min_count: int = 1) -> Tuple[float, ...]:
    """Estimated tokens per expert at ``layer`` from how many of a batch's tokens took each path (the paths of
    :func:`path_span`'s length): sum over paths of count x P(e | path), paths in sorted order, so that every rank
    sums alike. ``keep`` as in :func:`expected_loads`."""
    if keep is not None and not _is_int(keep, 1):
        raise ValueError(f"keep ({keep!r}) must be None (every expert) or an integer >= 1")
    table.counts(layer)
    width = len(path_span(layer, table.path_length))
    loads = [0.0] * table.model.num_experts
    for path in sorted(path_counts):
        if len(path) != width:
            raise ValueError(f"path {path!r} has {len(path)} entries; layer {layer}'s paths have {width}")
        p = table.distribution(layer, path, min_count)
        ranked = sorted(range(len(p)), key=lambda e: (-p[e], e))
        for e in (ranked if keep is None else ranked[:keep]):
            loads[e] += path_counts[path] * p[e]
    return tuple(loads)


def actual_counts(records_NL: Iterable[Sequence[int]], layer: int, num_experts: int) -> Tuple[int, ...]:
    """Tokens per expert at ``layer`` as the gate routed them."""
    counts = [0] * num_experts
    for row in records_NL:
        counts[row[layer]] += 1
    return tuple(counts)


def top_set(loads_E: Sequence[float], top: int = DEFAULT_TOP) -> frozenset:
    """The ``top`` most loaded experts (ties: the lower expert id ranks first)."""
    if not _is_int(top, 1):
        raise ValueError(f"top ({top!r}) must be an integer >= 1")
    return frozenset(sorted(range(len(loads_E)), key=lambda e: (-loads_E[e], e))[:top])


def top_matches(estimate_E: Sequence[float], actual_E: Sequence[float], top: int = DEFAULT_TOP) -> bool:
    """The estimate's top set equals the actual one (:func:`top_set`). Where fewer than ``top`` experts got any
    token, the actual top set's idle members are only the tie rule's pick, so the estimate is right when its top
    set holds every expert that got tokens (this reproduction's reading: the paper compares the top-k lists and
    does not say what an idle expert in them means; otherwise a batch routed wholly to one expert would count
    as wrong, and phase two re-plan, unless the estimate's runner-up were the lowest idle id)."""
    actual = top_set(actual_E, top)
    busy = frozenset(e for e in actual if actual_E[e] > 0)
    estimated = top_set(estimate_E, top)
    return estimated == actual if len(busy) == len(actual) else busy <= estimated


@dataclass(frozen=True, kw_only=True)
class Accuracy:
    top: int
    per_layer: Tuple[Tuple[int, int, int], ...]     # (layer, accurate batches, batches)
    load_error: Tuple[float, ...]                   # per layer: mean total-variation distance of the load shares

    @property
    def mean_load_error(self) -> float:
        """Mean over (batch, layer) of 1/2 sum_e |estimated share_e - actual share_e| (0 exact, 1 disjoint)."""
        return (sum(err * n for err, (_, _, n) in zip(self.load_error, self.per_layer)) / self.total
                if self.total else math.nan)

    @property
    def accurate(self) -> int:
        return sum(hit for _, hit, _ in self.per_layer)

    @property
    def total(self) -> int:
        return sum(n for _, _, n in self.per_layer)

    @property
    def value(self) -> float:
        """Fraction of (batch, layer) pairs whose estimated top set equals the actual one (NaN when none)."""
        return self.accurate / self.total if self.total else math.nan


def estimation_accuracy(table: PopularityTable, batches: Iterable[Sequence[Sequence[int]]], *,
                        top: int = DEFAULT_TOP, keep: Optional[int] = None, min_count: int = 1) -> Accuracy:
    """The paper's accuracy (module docstring) of ``table`` over ``batches`` of full routing records."""
    top_set((), top)                                         # validates ``top``
    hits = {layer: [0, 0, 0.0] for layer in range(table.start_layer, table.model.num_layers)}
    for b, batch in enumerate(batches):
        check_records(batch, table.model, name=f"batches[{b}]")
        for layer, tally in hits.items():
            estimate = expected_loads(table, layer, batch, keep=keep, min_count=min_count)
            actual = actual_counts(batch, layer, table.model.num_experts)
            tally[0] += top_matches(estimate, actual, top)
            tally[1] += 1
            tally[2] += _tv_distance(estimate, actual)
    return Accuracy(top=top, per_layer=tuple((layer, h, n) for layer, (h, n, _) in hits.items()),
                    load_error=tuple(err / n if n else math.nan for _, n, err in hits.values()))


def _tv_distance(a_E: Sequence[float], b_E: Sequence[float]) -> float:
    sa, sb = sum(a_E), sum(b_E)
    if sa <= 0 or sb <= 0:
        return 0.0 if sa == sb else 1.0
    return 0.5 * sum(abs(x / sa - y / sb) for x, y in zip(a_E, b_E))


# ---- the JSON file ----------------------------------------------------------------------------------------

def table_to_json(table: PopularityTable, meta: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "model": {"num_layers": table.model.num_layers, "num_experts": table.model.num_experts,
                  "top_k": table.model.top_k},
        "start_layer": table.start_layer, "path_length": table.path_length, "tokens": table.tokens,
        "layers": [{"layer": c.layer, "marginal": list(c.marginal),
                    "paths": {",".join(map(str, p)): list(v) for p, v in c.paths.items()}} for c in table.layers],
        "meta": dict(meta or {}),
    }


def table_from_json(obj: Any, source: str = "table") -> PopularityTable:
    """The table in ``obj``; refuses another schema or version, and lists every malformed field at once."""
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        found = obj.get("schema") if isinstance(obj, dict) else type(obj).__name__
        raise TableError(f"{source}: not a lina popularity table (schema {found!r}; expected {SCHEMA!r})")
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TableError(f"{source}: schema_version {version!r} is not supported; this moe_plugins reads "
                         f"schema_version {SCHEMA_VERSION} only (re-create the table with `moe-plugins lina-profile`)")
    problems: List[str] = []
    model_obj = obj.get("model") if isinstance(obj.get("model"), dict) else {}
    for name in ("num_layers", "num_experts", "top_k"):
        if not _is_int(model_obj.get(name), 1):
            problems.append(f"model.{name} ({model_obj.get(name)!r}) must be an integer >= 1")
    for name, low in (("start_layer", 0), ("path_length", 1), ("tokens", 0)):
        if not _is_int(obj.get(name), low):
            problems.append(f"{name} ({obj.get(name)!r}) must be an integer >= {low}")
    if problems:
        raise TableError(f"{source}: " + "; ".join(problems))
    model = ModelFacts(**{k: model_obj[k] for k in ("num_layers", "num_experts", "top_k")})
    start, n = obj["start_layer"], obj["path_length"]
    expected = list(range(start, model.num_layers))
    rows = obj.get("layers")
    if not isinstance(rows, list) or [r.get("layer") if isinstance(r, dict) else None for r in rows] != expected:
        raise TableError(f"{source}: layers must be one entry per layer {expected} (start_layer .. num_layers - 1), "
                         f"in order")
    layers = tuple(_layer_from_json(r, model, n, f"layers[{i}]", problems) for i, r in enumerate(rows))
    if problems:
        raise TableError(f"{source}: " + "; ".join(problems))
    return PopularityTable(model=model, start_layer=start, path_length=n, tokens=obj["tokens"], layers=layers)


def _layer_from_json(row: Dict[str, Any], model: ModelFacts, n: int, where: str,
                     problems: List[str]) -> LayerCounts:
    layer = row["layer"]
    marginal = _counts(row.get("marginal"), model.num_experts, f"{where}.marginal", problems)
    paths: Dict[Path_, Counts] = {}
    raw = row.get("paths")
    if not isinstance(raw, dict):
        problems.append(f"{where}.paths must be an object of path -> counts")
        raw = {}
    for key, counts in raw.items():
        try:
            path = tuple(int(p) for p in str(key).split(","))
        except ValueError:
            path = ()
        if len(path) != len(path_span(layer, n)) or not all(0 <= e < model.num_experts for e in path):
            problems.append(f"{where}.paths[{key!r}] must be {len(path_span(layer, n))} comma-separated expert ids "
                            f"in [0, {model.num_experts})")
            continue
        paths[path] = _counts(counts, model.num_experts, f"{where}.paths[{key!r}]", problems)
    return LayerCounts(layer=layer, marginal=marginal, paths=MappingProxyType(dict(sorted(paths.items()))))


def _counts(value: Any, num_experts: int, where: str, problems: List[str]) -> Counts:
    if not isinstance(value, list) or len(value) != num_experts or not all(_is_int(c, 0) for c in value):
        problems.append(f"{where} must be {num_experts} counts >= 0")
        return tuple([0] * num_experts)
    return tuple(value)


def save_table(table: PopularityTable, path: str | Path, meta: Optional[Mapping[str, Any]] = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table_to_json(table, meta), indent=1) + "\n", encoding="utf-8")
    return path


def load_table(path: str | Path, expect: Optional[ModelFacts] = None) -> PopularityTable:
    """The table at ``path``; with ``expect`` (the model's facts), refuses a table of another model, naming
    every field that differs."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"lina popularity table {str(path)!r} does not exist (create it with "
                         f"`moe-plugins lina-profile`)")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TableError(f"lina popularity table {str(path)!r} cannot be read as JSON: {exc}") from exc
    table = table_from_json(obj, source=str(path))
    if expect is not None:
        diff = table.model.mismatches(expect)
        if diff:
            raise TableError(f"lina popularity table {str(path)!r} was profiled on another model: "
                             + "; ".join(diff))
    return table


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
