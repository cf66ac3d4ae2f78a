"""The project's one cost-model layer: linear (alpha-beta) time models and the profile that holds them.

Every op is modelled as ``t(x) = alpha + beta * x`` (pipemoe.txt Eq. 13/16, parm.txt Eq. 12):

==============  ===============================================  ==========================
op               x (the same convention as the CommLedger)        unit of x
==============  ===============================================  ==========================
``gemm``         m * k * n of one (batched) matmul                 multiply-add ("mac")
``all_to_all``   bytes each rank passes in                         byte
``all_to_all_    bytes each rank passes in, one of several         byte
stream``         exchanges issued back to back (time per exchange)
``all_gather``   bytes of the gathered (output) tensor             byte
``all_reduce``   bytes of the reduced tensor                       byte
``saa``          bytes each rank passes to the all-to-all, run     byte
                 concurrently with an all-gather of the same
                 bytes (Parm's simultaneous all-to-all/all-gather)
==============  ===============================================  ==========================

alpha is in seconds, beta in seconds per unit of x. Collectives are keyed per group kind
(``all_to_all@ep``, ``all_gather@mp``, ``saa@ep_esp+mp``): alpha and beta depend on the group's size
and on how many of its members sit on other nodes (pipemoe.txt Table II, parm.txt §IV-A).

A :class:`CostProfile` is what ``moe-plugins profile`` measures and caches. Its :class:`ProfileKey` (world
size, layout, backend, device) names the cache file; the cache directory is always passed in explicitly
(the CLI resolves the default with :func:`default_cache_dir`). Nothing here touches torch.distributed.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np
from scipy.optimize import lsq_linear

from moe_plugins.core.curves import ExchangeCurve  # noqa: F401  (re-exported: the measured-curve pricing)

OPS = ("gemm", "all_to_all", "all_to_all_stream", "all_gather", "all_reduce", "saa")
UNITS = {"gemm": "mac", "all_to_all": "byte", "all_to_all_stream": "byte", "all_gather": "byte",
         "all_reduce": "byte", "saa": "byte", "chunk": "chunk"}
PROFILE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class LinearModel:
    """t(x) = alpha + beta * x, in seconds; ``r2`` and ``samples`` describe the fit (None when given by hand)."""

    alpha: float
    beta: float
    unit: str
    r2: Optional[float] = None
    samples: int = 0
    alpha_clamped: bool = False   # unbounded least squares gave alpha < 0; pinned at 0
    beta_clamped: bool = False    # unbounded least squares gave beta < 0; pinned at 0

    def time(self, x: float) -> float:
        return self.alpha + self.beta * x


def model_problems(name: str, model: LinearModel) -> List[str]:
    """Reasons a model cannot be used for planning (negative or non-finite terms), naming ``name``."""
    problems = []
    for term in ("alpha", "beta"):
        value = getattr(model, term)
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            problems.append(f"{name}.{term} ({value!r}) must be a finite number >= 0")
    return problems


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def fit_linear(x: Sequence[float], t: Sequence[float], unit: str) -> LinearModel:
    """Least-squares fit of t = alpha + beta * x with alpha, beta >= 0, and R^2 of the fit.

    The bounded problem is solved by scipy's ``lsq_linear``. A negative start-up time or a negative cost
    per unit is not physical (noise on small or flat samples gives one): where the unbounded fit would go
    negative the term is pinned at 0 and the model is marked ``alpha_clamped`` / ``beta_clamped``
    (reported by ``moe-plugins profile``, never silent)."""
    x_N, t_N = np.asarray(x, dtype=np.float64), np.asarray(t, dtype=np.float64)
    if x_N.shape != t_N.shape or x_N.ndim != 1:
        raise ValueError(f"fit_linear: x and t must be 1-D of equal length (got {x_N.shape} and {t_N.shape})")
    if len(np.unique(x_N)) < 2:
        raise ValueError(f"fit_linear: need at least 2 distinct sizes (got {sorted(set(x_N.tolist()))})")
    # Scale the columns so that the solver sees a well-conditioned problem (x spans bytes to GiB).
    x_scale, t_scale = float(np.abs(x_N).max()) or 1.0, float(np.abs(t_N).max()) or 1.0
    A_N2 = np.stack([np.ones_like(x_N), x_N / x_scale], 1)
    (a_unbounded, b_unbounded), *_ = np.linalg.lstsq(A_N2, t_N / t_scale, rcond=None)
    sol = lsq_linear(A_N2, t_N / t_scale, bounds=(0.0, np.inf), method="bvls").x
    alpha, beta = float(sol[0] * t_scale), float(sol[1] * t_scale / x_scale)
    return LinearModel(alpha=alpha, beta=beta, unit=unit, r2=r_squared(x_N, t_N, alpha, beta),
                       samples=int(x_N.size), alpha_clamped=bool(a_unbounded < 0),
                       beta_clamped=bool(b_unbounded < 0))


def r_squared(x_N: np.ndarray, t_N: np.ndarray, alpha: float, beta: float) -> float:
    resid = t_N - (alpha + beta * x_N)
    total = float(((t_N - t_N.mean()) ** 2).sum())
    return 1.0 - float((resid ** 2).sum()) / total if total > 0 else 1.0


def runner_chunk_terms(measured: "Measurement") -> Tuple[LinearModel, float]:
    """Pure: the pipelined runner's costs from the profile's ``chunk`` points (forward + backward of a tiny
    layer at degrees 1, 2, 3, ...; x = the degree).

    r = 1 runs the schedule's sequential loop; r >= 2 runs the pipeline (a lane thread, twin groups, an
    autograd island per stage), so the points are a step then a line, not one line. Returns the line through
    the degrees >= 2 (its slope: what one more chunk costs) and the step: how far the line, taken back to
    r = 1, lies above the sequential loop's time, ``max(0, line(1) - t(1))`` (what turning the pipeline on
    costs beyond its chunks). Without a degree-1 point the step is 0."""
    x_N, t_N = np.asarray(measured.x, dtype=np.float64), np.asarray(measured.seconds, dtype=np.float64)
    piped = x_N >= 2
    line = fit_linear(x_N[piped], t_N[piped], "chunk")
    sequential = t_N[x_N == 1]
    step = max(0.0, line.time(1.0) - float(np.median(sequential))) if sequential.size else 0.0
    return line, step


def model_key(op: str, group: Optional[str] = None) -> str:
    """``gemm`` or ``<op>@<group kind>``."""
    if op not in OPS:
        raise ValueError(f"op ({op!r}) is unknown; allowed: {', '.join(OPS)}")
    if op == "gemm":
        if group is not None:
            raise ValueError(f"op 'gemm' takes no group (got {group!r})")
        return op
    if not group:
        raise ValueError(f"op ({op!r}) needs a group kind, e.g. 'ep'")
    return f"{op}@{group}"


@dataclass(frozen=True, kw_only=True)
class ProfileKey:
    """What a profile is valid for: the cache is keyed by all of it."""

    world: int
    ranks_per_node: int
    mp: int
    ep: int
    esp: int
    backend: str     # gloo | nccl
    device: str      # cpu | a device name such as "NVIDIA H100 80GB HBM3"

    def slug(self) -> str:
        dev = re.sub(r"[^A-Za-z0-9]+", "-", self.device).strip("-").lower() or "unknown"
        return (f"w{self.world}-n{self.ranks_per_node}-mp{self.mp}-ep{self.ep}-esp{self.esp}-"
                f"{self.backend}-{dev}")


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """Raw timings of one op: sizes x and the per-size median seconds (kept for the plot and re-fits)."""

    x: Tuple[float, ...]
    seconds: Tuple[float, ...]

    def to_json(self) -> dict:
        return {"x": list(self.x), "seconds": list(self.seconds)}


@dataclass(frozen=True, kw_only=True)
class CostProfile:
    key: ProfileKey
    dtype: str
    models: Mapping[str, LinearModel]
    measurements: Mapping[str, Measurement] = field(default_factory=dict)
    source: str = ""           # how it was made (a command line, "paper", ...)

    def model(self, op: str, group: Optional[str] = None) -> LinearModel:
        key = model_key(op, group)
        if key not in self.models:
            raise ValueError(f"profile {self.key.slug()} has no model for {key!r}; it has: "
                             f"{', '.join(sorted(self.models)) or 'none'}")
        return self.models[key]

    def time(self, op: str, x: float, group: Optional[str] = None) -> float:
        return self.model(op, group).time(x)

    def to_json(self) -> str:
        return json.dumps({"version": PROFILE_VERSION, "key": asdict(self.key), "dtype": self.dtype,
                           "source": self.source,
                           "models": {k: asdict(m) for k, m in sorted(self.models.items())},
                           "measurements": {k: m.to_json() for k, m in sorted(self.measurements.items())}},
                          indent=1)

    @staticmethod
    def from_json(text: str) -> "CostProfile":
        try:                                     # a ValueError, never a JSON, key or type error, on a bad text
            raw = json.loads(text)
            if raw.get("version") != PROFILE_VERSION:
                raise ValueError(f"profile version ({raw.get('version')!r}) is not {PROFILE_VERSION}")
            profile = CostProfile(key=ProfileKey(**raw["key"]), dtype=raw["dtype"], source=raw.get("source", ""),
                                  models={k: LinearModel(**m) for k, m in raw["models"].items()},
                                  measurements={k: Measurement(x=tuple(m["x"]), seconds=tuple(m["seconds"]))
                                                for k, m in raw.get("measurements", {}).items()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a cost profile of version {PROFILE_VERSION} ({type(exc).__name__}: {exc})") from None
        problems = [p for k, m in sorted(profile.models.items()) for p in model_problems(f"models[{k}]", m)]
        problems += [f"measurements[{k}] ({m.to_json()!r}) must hold numbers" for k, m in sorted(
            profile.measurements.items()) if not all(_is_number(v) for v in m.x + m.seconds)]
        if problems:
            raise ValueError("not a usable cost profile: " + "; ".join(problems))
        return profile

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path

    @staticmethod
    def load(path: Path) -> "CostProfile":
        try:
            return CostProfile.from_json(Path(path).read_text())
        except (OSError, ValueError) as exc:     # unreadable, not JSON, another version: name the file
            raise ValueError(f"cost profile {os.fspath(path)!r} cannot be used: {exc}") from None


def cache_path(cache_dir: Path, key: ProfileKey) -> Path:
    return Path(cache_dir) / f"profile-{key.slug()}.json"


def load_cached(cache_dir: Path, key: ProfileKey) -> Optional[CostProfile]:
    """The cached profile for ``key``, or None when there is none; a file there that is not it: ValueError."""
    path = cache_path(cache_dir, key)
    profile = CostProfile.load(path) if path.is_file() else None
    if profile is not None and profile.key != key:
        raise ValueError(f"cost profile {str(path)!r} holds the profile of {profile.key.slug()}, not {key.slug()}")
    return profile


def default_cache_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    """CLI boundary only: ``$MOE_PLUGINS_CACHE``, else ``$XDG_CACHE_HOME/moe_plugins``, else
    ``~/.cache/moe_plugins``. Library code takes the directory as an argument."""
    env = os.environ if environ is None else environ
    if env.get("MOE_PLUGINS_CACHE"):
        return Path(env["MOE_PLUGINS_CACHE"])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "moe_plugins"


# ---- the PipeMoE terms (pipemoe.txt Table I, Eq. 15 and 17) ----------------------------------------------

EXCHANGE_PRICING = ("curve", "linear")


@dataclass(frozen=True, kw_only=True)
class PipeCosts:
    """The four numbers PipeMoE plans with, and optionally the measured exchange curve.

    - ``alpha_a`` [s], ``beta_a`` [s/byte]: one dispatch (or combine) exchange of n_d bytes per rank;
    - ``alpha_e`` [s], ``beta_e`` [s/mac]: the expert FFN forward on n_e = rows * M * H_shard multiply-adds
      per GEMM, i.e. two GEMMs: alpha_e = 2 alpha_gemm, beta_e = 2 beta_gemm (Eq. 14-15); from a profile with
      ``chunk`` points alpha_e also carries a third of the runner's per-chunk slope (:meth:`from_profile`).
    - ``exchange_curve``: when set, an exchange of x bytes takes ``exchange_curve.time(x)`` instead of
      alpha_a + beta_a x. Theorem 1's closed forms assume the line, so the degree is then found by timing
      the recurrence at every r (pipemoe.choose_degree).
    - ``stream_curve``: when set, the time of one exchange of x bytes issued right behind another, as a
      pipeline issues its chunks (the profile's ``all_to_all_stream``). An exchange after idle link time can
      be faster than one in a stream (the emulated link's token bucket passes its first 128 KiB at once; on
      any link the next message's start-up can hide behind a compute gap), so with r >= 2 every exchange but
      the first dispatch is priced from this curve (pipemoe.moe_time).
    - ``pipeline_step`` [s]: what running r >= 2 chunks costs once per forward + backward beyond its
      per-chunk terms (the runner's lane, twin groups and autograd islands; r = 1 runs the sequential loop),
      measured by the profile's ``chunk`` points (:func:`runner_chunk_terms`). 0 for the paper's model.
    """

    alpha_a: float
    beta_a: float
    alpha_e: float
    beta_e: float
    exchange_curve: Optional[ExchangeCurve] = None
    stream_curve: Optional[ExchangeCurve] = None
    pipeline_step: float = 0.0

    def exchange_time(self, x: float) -> float:
        """Seconds of one exchange of x bytes per rank."""
        if self.exchange_curve is not None:
            return self.exchange_curve.time(x)
        return self.alpha_a + self.beta_a * x

    def stream_time(self, x: float) -> float:
        """Seconds of one exchange of x bytes right behind another (the exchange time without a stream curve)."""
        if self.stream_curve is not None:
            return self.stream_curve.time(x)
        return self.exchange_time(x)

    def problems(self) -> List[str]:
        out = []
        for name in ("alpha_a", "beta_a", "alpha_e", "beta_e", "pipeline_step"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                out.append(f"{name} ({value!r}) must be a finite number >= 0")
        for curve in (self.exchange_curve, self.stream_curve):
            out += curve.problems() if curve is not None else []
        return out

    def check(self) -> "PipeCosts":
        problems = self.problems()
        if problems:
            raise ValueError("invalid PipeMoE costs: " + "; ".join(problems))
        return self

    @staticmethod
    def from_profile(profile: CostProfile, exchange: str = "ep", pricing: str = "curve") -> "PipeCosts":
        """alpha_a/beta_a from the all-to-all on ``exchange``; alpha_e/beta_e from the GEMM model (x2).

        ``pricing="curve"`` (the default) also keeps the all-to-all's measured curve
        (:class:`ExchangeCurve`) when the profile holds its measurements, and the back-to-back one
        (``all_to_all_stream``) when it holds that too; "linear" plans with the line alone.

        With the ``chunk`` points (the runner's measured forward + backward at several degrees, see
        :mod:`moe_plugins.tools.profiler`), :func:`runner_chunk_terms` splits them into a slope and a step. A third
        of the slope is added to alpha_e: the start-up a chunk pays in the runner (threads, autograd,
        synchronisation), measured on a layer too small to have GEMM start-up of its own, so a real layer's
        chunk pays both (in the compute-bound regime the model's time grows by 3 alpha_e per chunk: forward
        e, backward 2 e). The step becomes ``pipeline_step``. A profile with a ``chunk`` model but no points
        (written by hand) gives the slope alone."""
        if pricing not in EXCHANGE_PRICING:
            raise ValueError(f"pricing ({pricing!r}) must be one of {', '.join(EXCHANGE_PRICING)}")
        key = model_key("all_to_all", exchange)
        a2a, gemm = profile.model("all_to_all", exchange), profile.model("gemm")
        problems = model_problems(key, a2a) + model_problems("gemm", gemm)
        if problems:
            raise ValueError(f"profile {profile.key.slug()} cannot plan: " + "; ".join(problems))
        slope, step = runner_terms(profile)
        stream_key = model_key("all_to_all_stream", exchange)
        curve, stream = ((measured_curve(profile, key, a2a.beta), measured_curve(profile, stream_key, a2a.beta))
                         if pricing == "curve" else (None, None))
        return PipeCosts(alpha_a=a2a.alpha, beta_a=a2a.beta, alpha_e=2 * gemm.alpha + slope / 3,
                         beta_e=2 * gemm.beta, exchange_curve=curve, stream_curve=stream if curve else None,
                         pipeline_step=step)


def measured_curve(profile: CostProfile, key: str, beta_tail: float) -> Optional[ExchangeCurve]:
    """The isotonic curve of the op ``key`` when the profile measured it at >= 2 sizes, else None."""
    measured = profile.measurements.get(key)
    if measured is None or len(set(measured.x)) < 2:
        return None
    return ExchangeCurve.fit(measured, beta_tail)


def runner_terms(profile: CostProfile) -> Tuple[float, float]:
    """(slope per chunk, step) from the profile's ``chunk`` points, or the fitted model's slope alone."""
    points = profile.measurements.get("chunk")
    if points is not None and len({x for x in points.x if x >= 2}) >= 2:
        line, step = runner_chunk_terms(points)
        return line.beta, step
    model = profile.models.get("chunk")
    return (model.beta, 0.0) if model is not None else (0.0, 0.0)


# The paper's 16-GPU testbed (pipemoe.txt Fig. 6 caption: 16 x RTX2080Ti over 100 Gb/s InfiniBand):
# alpha_gemm = 6.19e-5 s, beta_gemm = 4.1e-14 s/mac, (alpha_a, beta_a) = (1.72e-5 s, 2.96e-10 s/byte).
PAPER_TESTBED = PipeCosts(alpha_a=1.72e-5, beta_a=2.96e-10, alpha_e=2 * 6.19e-5, beta_e=2 * 4.1e-14)
PAPER_TESTBED_SOURCE = ("default: PipeMoE paper's 16-GPU testbed (Fig. 6: alpha_gemm=6.19e-5 s, "
                        "beta_gemm=4.1e-14 s/mac, alpha_a=1.72e-5 s, beta_a=2.96e-10 s/byte)")
