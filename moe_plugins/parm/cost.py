"""Parm's communication-time model (parm.txt §IV-V) and the automatic S1/S2 choice, as pure functions.

Notation (parm.txt Table I): B samples and L tokens per sample on a rank (so S = B*L tokens per MP group
member, the same tokens on every member of an MP group), M model dim, H FFN hidden, E experts, k routes
per token, f capacity factor, N_MP / N_EP / N_ESP the group sizes.

Sizes, in elements (the paper's convention; the ledger's ``numel``):

    x = B L M                      the MoE layer's input on one rank
    T = k f B L / E                slots per expert (the paper's real number; the layer uses ceil(T))
    y = E T M N_ESP                what one rank passes to an EP&ESP all-to-all when nothing is split

Times, one direction (forward; the backward issues the same collectives with the same sizes). A
collective on a group of size 1 is not issued, so it costs nothing (not even alpha):

    t_B  = AG_ESP(x N_ESP) + AR_ESP(y) + 2 A2A_EP(y)                                  (Eq. 1)
    t_D1 = 2 A2A_EP&ESP(y1) + AG_MP(x)                                                (Eq. 11, 13)
    t_D2 = 2 A2A_EP&ESP(y / N_MP) + AG_MP(E T M)             sequential (AAS)       (Eq. 7, right side)
    t_D2 = A2A_EP&ESP(y / N_MP) + SAA(y / N_MP)              with SAA               (Eq. 7, 14)
    t_TP = 2 A2A_EP(E T M / N_MP) + [AG_ESP + AR_ESP](E T M) + AG_MP(E T M)   DeepSpeed's flow (not the paper's)

where y1 = E C_l M N_ESP is S1's buffer (:func:`s1_slots`; the paper's y / N_MP when T is a multiple of
the block's demand, e.g. f = 1 with k <= 2) and every op is alpha + beta * n (Eq. 12) and SAA(n) = alpha_o + beta_o * n is the overlapped
EP&ESP-AlltoAll (n elements) run together with the MP-AllGather of the same step (E T M elements).

Typos in the paper that are not copied here (derived from the equations instead):

- Algorithm 1, line 2 writes T = k f B L M / E; T is a slot count, k f B L / E (§II-A). The extra M
  would make y quadratic in M.
- Eq. 13's second line drops N_ESP from the all-to-all size; its first line and Eq. 11 keep it.
- Eq. 14 adds AG_MP(E T M) on top of Overlap(.), the overlapped all-to-all + all-gather; Eq. 7 (and
  §III-D) count the all-gather inside the overlap. Counting it twice would make SAA never pay off, so
  t_D2 with SAA is A2A + SAA only.
- Algorithm 1, line 5 writes beta_o * y; the overlapped all-to-all moves y / N_MP elements (Eq. 14).

The choice (Algorithm 1): S1 when t_D1 <= t_D2, else S2; here near-ties go to the schedule sending fewer
all-to-all elements, and DeepSpeed's own flow (t_TP, ESP = 1 or MP) replaces the pick when it is priced no
dearer (:func:`choose_schedule`), so parm-auto never plans anything slower than the host.

Units: alpha in seconds, beta in seconds per element, sizes in elements, times in seconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
from scipy.optimize import brentq

from moe_plugins.core.costmodel import EXCHANGE_PRICING, ExchangeCurve, measured_curve

from moe_plugins.parm.volumes import (NEAR_TIE, SCHEDULE_S1, SCHEDULE_S2, SCHEDULE_TP, Op, ParmShape,  # noqa: F401
                                      Sizes, check_shape, op_volumes, s1_gate_ops, s1_slots, schedule_ops,
                                      shape_problems, sizes, tp_flow_problems)              # (re-exported)

# ---- alpha-beta costs ----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    """t(n) = alpha + beta * n: alpha in seconds, beta in seconds per element (Eq. 12)."""

    alpha: float
    beta: float

    def time(self, n: float) -> float:
        return self.alpha + self.beta * n


# The terms a measured curve can price (the ones Algorithm 1 reads), and the profile model each comes from.
CURVE_TERMS = {"a2a_ep_esp": "all_to_all@ep_esp", "ag_mp": "all_gather@mp", "saa": "saa@ep_esp+mp"}
_TERM_OF_OP = {"all_to_all@ep_esp": "a2a_ep_esp", "all_gather@mp": "ag_mp", "all_gather@esp": "ag_esp",
               "all_reduce@esp": "ar_esp", "all_to_all@ep": "a2a_ep"}


@dataclass(frozen=True, kw_only=True)
class ParmCosts:
    """The terms Parm plans with. ``a2a_ep_esp`` and ``ag_mp`` are Algorithm 1's inputs; ``saa`` is
    (alpha_o, beta_o) of the overlapped collective as a function of its all-to-all size (None: S2 is costed
    without overlap, the upper bound of Eq. 7); the last three cost the baseline (Eq. 1) and are only needed
    for ``t_baseline``.

    ``curves``: (term, curve) pairs for terms of :data:`CURVE_TERMS` priced from the profile's measured
    times instead of their line (:class:`moe_plugins.core.costmodel.ExchangeCurve`, its x in *elements* here).
    The line stays for display and for terms without a curve."""

    a2a_ep_esp: AlphaBeta
    ag_mp: AlphaBeta
    saa: Optional[AlphaBeta] = None
    ag_esp: Optional[AlphaBeta] = None
    ar_esp: Optional[AlphaBeta] = None
    a2a_ep: Optional[AlphaBeta] = None
    curves: Tuple[Tuple[str, ExchangeCurve], ...] = ()

    def problems(self) -> List[str]:
        out = []
        for name, term in self.lines().items():
            if term is None:
                continue
            for part in ("alpha", "beta"):
                value = getattr(term, part)
                if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                    out.append(f"{name}.{part} ({value!r}) must be a finite number >= 0")
        for name, curve in self.curves:
            if name not in CURVE_TERMS:
                out.append(f"curves: term {name!r} must be one of {', '.join(CURVE_TERMS)}")
            elif getattr(self, name) is None:
                out.append(f"curves: term {name!r} has a curve but no line")
            out += [f"curves[{name}]: {p}" for p in curve.problems()]
        return out

    def check(self) -> "ParmCosts":
        problems = self.problems()
        if problems:
            raise ValueError("invalid Parm costs: " + "; ".join(problems))
        return self

    def lines(self) -> Dict[str, Optional[AlphaBeta]]:
        """The six alpha-beta terms by name."""
        return {name: getattr(self, name) for name in ("a2a_ep_esp", "ag_mp", "saa", "ag_esp", "ar_esp", "a2a_ep")}

    def time(self, name: str, n: float) -> float:
        """Seconds of term ``name`` on n elements: its curve when it has one, else its line."""
        curve = dict(self.curves).get(name)
        if curve is not None:
            return curve.time(n)
        term = getattr(self, name)
        if term is None:
            raise ValueError(f"costs have no term {name!r}")
        return term.time(n)

    def term(self, op: Op) -> Optional[AlphaBeta]:
        return getattr(self, _TERM_OF_OP[op.key])

    def op_time(self, op: Op) -> float:
        return self.time(_TERM_OF_OP[op.key], op.numel)

    @staticmethod
    def from_profile(profile, element_bytes: int, pricing: str = "curve") -> "ParmCosts":
        """Fill from a :class:`moe_plugins.core.costmodel.CostProfile` (x in bytes there, elements here).
        Missing optional models (saa, the baseline's) stay None; the two Algorithm 1 needs must exist.
        ``pricing="curve"`` (the default) also prices the terms of :data:`CURVE_TERMS` from the profile's
        measured times where it holds them (>= 2 sizes); "linear" keeps the lines alone."""
        if element_bytes < 1:
            raise ValueError(f"element_bytes ({element_bytes}) must be >= 1")
        if pricing not in EXCHANGE_PRICING:
            raise ValueError(f"pricing ({pricing!r}) must be one of {', '.join(EXCHANGE_PRICING)}")

        def get(op: str, group: str, required: bool) -> Optional[AlphaBeta]:
            key = f"{op}@{group}"
            if key not in profile.models:
                if required:
                    raise ValueError(f"profile {profile.key.slug()} has no model for {key!r}, which Parm's "
                                     f"choice needs; it has: {', '.join(sorted(profile.models)) or 'none'}")
                return None
            m = profile.models[key]
            return AlphaBeta(alpha=m.alpha, beta=m.beta * element_bytes)

        lines = ParmCosts(a2a_ep_esp=get("all_to_all", "ep_esp", True), ag_mp=get("all_gather", "mp", True),
                          saa=get("saa", "ep_esp+mp", False), ag_esp=get("all_gather", "esp", False),
                          ar_esp=get("all_reduce", "esp", False), a2a_ep=get("all_to_all", "ep", False))
        if pricing == "linear":
            return lines.check()
        return dataclasses.replace(lines, curves=measured_curves(profile, element_bytes, lines)).check()


def measured_curves(profile, element_bytes: int, lines: "ParmCosts") -> Tuple[Tuple[str, ExchangeCurve], ...]:
    """The isotonic curve of each :data:`CURVE_TERMS` term the profile measured at >= 2 sizes, in elements
    (its tail grows with the term's line)."""
    out = []
    for name, key in CURVE_TERMS.items():
        line = getattr(lines, name)
        curve = measured_curve(profile, key, line.beta / element_bytes) if line is not None else None
        if curve is None:
            continue
        out.append((name, ExchangeCurve(x=tuple(x / element_bytes for x in curve.x), seconds=curve.seconds,
                                        beta_tail=line.beta)))
    return tuple(out)


# The paper's only published terms (§VI-B, Fig. 6): the MP all-gather on its two testbeds.
PAPER_AG_MP = {
    "testbed-a": AlphaBeta(alpha=6.64e-4, beta=5.38e-10),   # 8 x RTX4090, PCIe 4.0 x16, one node
    "testbed-b": AlphaBeta(alpha=1.09e-4, beta=7.14e-10),   # 32 x RTX2080Ti, 8 nodes, 100 Gb/s ConnectX-5
}

# Placeholders measured on this project's development machine (2 CPU cores, gloo) on its emulated 2-node
# cluster (2 ranks per node, 1 Gbit/s tbf link; mp=2 inside a node, ep=2, esp=2; fp32):
# `python benchmarks/parm_saa.py --rates 1gbit --fit`, 2026-11-22, benchmarks/results/parm_saa.md.
# Negative intercepts were pinned at 0 (costmodel.fit_linear). The paper publishes no all-to-all or overlap
# terms, so no paper testbed can stand in for them; these only make the CLI and parm-auto usable before
# `moe-plugins profile` has run on the real cluster.
DEFAULT_COSTS = ParmCosts(
    a2a_ep_esp=AlphaBeta(alpha=0.0, beta=3.93e-8),
    ag_mp=AlphaBeta(alpha=7.36e-4, beta=1.64e-8),
    saa=AlphaBeta(alpha=1.55e-3, beta=4.24e-8),
    ag_esp=AlphaBeta(alpha=0.0, beta=3.45e-8),
    ar_esp=AlphaBeta(alpha=2.85e-3, beta=1.49e-8),
    a2a_ep=AlphaBeta(alpha=0.0, beta=4.38e-8),
)
DEFAULT_COSTS_SOURCE = ("default: placeholders measured on the project's 2-core CPU machine (gloo, emulated 2-node "
                        "cluster at 1 Gbit/s), not a real cluster; run `moe-plugins profile` or pass alpha/beta")


# ---- times and the choice ----------------------------------------------------------------------------

def ops_time(ops: List[Op], costs: ParmCosts) -> float:
    return sum(costs.op_time(o) for o in ops)


def t_baseline(shape: ParmShape, costs: ParmCosts, T: Optional[float] = None) -> Optional[float]:
    """Eq. 1, or None when the costs lack a baseline term that the layout needs."""
    ops = schedule_ops("baseline", shape, T)
    if any(costs.term(o) is None for o in ops):
        return None
    return ops_time(ops, costs)


def t_baseline_tp(shape: ParmShape, costs: ParmCosts, T: Optional[float] = None) -> Optional[float]:
    """DeepSpeed's flow (:func:`moe_plugins.parm.volumes.schedule_ops`' t_TP), or None when it cannot run
    on the shape (:func:`tp_flow_problems`) or the costs lack one of its terms (the EP all-to-all, and the
    ESP all-gather and all-reduce when experts are sharded)."""
    if tp_flow_problems(shape):
        return None
    ops = schedule_ops(SCHEDULE_TP, shape, T)
    if any(costs.term(o) is None for o in ops):
        return None
    return ops_time(ops, costs)


def t_s1(shape: ParmShape, costs: ParmCosts, T: Optional[float] = None, *, c_l: Optional[float] = None) -> float:
    """t_D1 (Eq. 11); ``c_l``: S1's observed buffer (slots per expert), else balanced routing's."""
    return ops_time(schedule_ops(SCHEDULE_S1, shape, T, c_l=c_l), costs)


def saa_form(shape: ParmShape, costs: ParmCosts, saa: bool) -> bool:
    return saa and costs.saa is not None and shape.mp > 1


def t_s2(shape: ParmShape, costs: ParmCosts, T: Optional[float] = None, *, saa: bool = True) -> float:
    """t_D2: with SAA (Eq. 14 without its double-counted all-gather) when ``saa`` and the costs have the
    overlap term and N_MP > 1; otherwise the sequential form (Eq. 7's right side)."""
    ops = schedule_ops(SCHEDULE_S2, shape, T)
    if not saa_form(shape, costs, saa):
        return ops_time(ops, costs)
    a2a = [o for o in ops if o.key == "all_to_all@ep_esp"]
    return ops_time(a2a[:1], costs) + costs.time("saa", sizes(shape, T).y / shape.mp)


@dataclass(frozen=True)
class ParmChoice:
    """What Algorithm 1 decided, with every number it used."""

    x: float
    T: float
    y: float
    t_baseline: Optional[float]
    t_s1: float
    t_s2: float
    s2_form: str           # "saa" or "sequential": the cheaper form of S2 (sequential when SAA is not allowed)
    choice: str            # "parm-s1", "parm-s2" or "baseline-tp"
    s1_slots: float = 0.0  # S1's buffer it priced (slots per expert)
    s1_source: str = "balanced"   # "balanced" (:func:`s1_slots`) or "observed" (measured on real routing)
    t_tp: Optional[float] = None  # DeepSpeed's flow (:func:`t_baseline_tp`); None: not a candidate

    @property
    def t_chosen(self) -> float:
        return {SCHEDULE_S1: self.t_s1, SCHEDULE_S2: self.t_s2}.get(self.choice, self.t_tp)


def choose_schedule(shape: ParmShape, costs: ParmCosts, T: Optional[float] = None, *, saa: bool = True,
                    c_l: Optional[float] = None, tp: bool = True) -> ParmChoice:
    """Algorithm 1: S1 if t_D1 <= t_D2 else S2 (ties go to S1, as in the paper). ``c_l``: S1's buffer as
    observed on the layer's routing (the paper assumes balanced routing, :func:`s1_slots`).

    Near-ties (t_D1 and t_D2 within :data:`NEAR_TIE` of each other) go to the schedule that sends fewer
    elements through the EP&ESP all-to-all, S1 when equal (the paper's tie rule). A measured curve can be
    flat across sizes whose medians the noise put out of order (the isotonic fit pools them), so a price
    tie there says nothing about which is faster; the bytes on the slow link do.

    S2's form: where SAA is allowed (``saa``) and priced, t_D2 is the cheaper of S2 with SAA (Eq. 14) and
    without (Eq. 7), and ``s2_form`` says which; the paper always runs S2 with SAA, but on a slow start-up
    SAA's slices can cost more than they hide (small T). Ties go to SAA.

    DeepSpeed's own flow (``baseline-tp``, :func:`t_baseline_tp`) is a third candidate where ``tp`` is set,
    it can run on the shape and the costs price it: it is chosen when it costs no more than
    (1 + :data:`NEAR_TIE`) times Algorithm 1's pick. A near-tie goes to it, since a price that cannot
    separate the two says nothing, and the host's own flow is never slower than the host.

    With N_MP = 1 there is no tensor parallelism to pause, and S1 differs from S2 only in trimming its
    buffer to C_l: a gain priced on balanced routing that real routing does not give (the observation that
    corrects it needs MP peers), paid for with a host read of C_l every call (a synchronisation on a GPU).
    So S2 (DeepSpeed's padded flow there, no host read) is Algorithm 1's pick at N_MP = 1."""
    costs.check()
    s = sizes(shape, T)
    d1 = t_s1(shape, costs, T, c_l=c_l)
    form = "sequential"
    d2 = t_s2(shape, costs, T, saa=False)
    if saa_form(shape, costs, saa):
        overlapped = t_s2(shape, costs, T, saa=True)
        if overlapped <= d2:
            form, d2 = "saa", overlapped
    if shape.mp == 1:
        pick = SCHEDULE_S2
    elif abs(d1 - d2) <= NEAR_TIE * min(d1, d2):
        pick = SCHEDULE_S1 if _a2a_elements(shape, T, c_l, SCHEDULE_S1) <= _a2a_elements(shape, T, c_l, SCHEDULE_S2) \
            else SCHEDULE_S2
    else:
        pick = SCHEDULE_S1 if d1 < d2 else SCHEDULE_S2
    d_tp = t_baseline_tp(shape, costs, T) if tp else None
    if d_tp is not None and d_tp <= (1 + NEAR_TIE) * (d1 if pick == SCHEDULE_S1 else d2):
        pick = SCHEDULE_TP
    return ParmChoice(x=s.x, T=s.T, y=s.y, t_baseline=t_baseline(shape, costs, T), t_s1=d1, t_s2=d2,
                      s2_form=form,
                      choice=pick,
                      s1_slots=s1_slots(shape, T) if c_l is None else float(c_l),
                      s1_source="balanced" if c_l is None else "observed", t_tp=d_tp)


def _a2a_elements(shape: ParmShape, T: Optional[float], c_l: Optional[float], schedule: str) -> float:
    return sum(o.numel for o in schedule_ops(schedule, shape, T, c_l=c_l) if o.key == "all_to_all@ep_esp")


def break_even_T(shape: ParmShape, costs: ParmCosts, *, saa: bool = True) -> Optional[float]:
    """The smallest T > 0 at which t_D1 = t_D2 for this shape (balanced routing), or None when they never
    cross. With lines both are piecewise linear in T (t_D1 bends where S1's buffer stops growing,
    :func:`s1_slots`, at multiples of d = B L / (E N_MP)), so each piece is solved as a line. With measured
    curves the pieces bend at every measured size too: the sign of t_D1 - t_D2 is scanned on a fine
    geometric grid of T (and the kinks) and each sign change refined with scipy's brentq, so a crossing that
    touches zero between two grid points without changing sign is not reported."""
    d = shape.B * shape.L / (shape.E * shape.mp)
    kinks = [0.0] + [float(j) * d for j in range(1, 2 * shape.k * shape.mp + 1)] + [math.inf]

    def gap(T: float) -> float:
        return t_s1(shape, costs, T) - t_s2(shape, costs, T, saa=saa)

    if costs.curves:
        return _first_root(gap, kinks[1:-1] + list(np.geomspace(d * 1e-3, kinks[-2] * 64, 600)))
    for lo, hi in zip(kinks, kinks[1:]):
        a = lo if lo > 0 else min(d, 1.0) * 1e-6
        b = hi if math.isfinite(hi) else lo + max(d, 1.0)
        f_a, f_b = gap(a), gap(b)
        if f_b == f_a:
            continue
        root = a - f_a * (b - a) / (f_b - f_a)
        if lo <= root <= hi and root > 0:
            return root
    return None


def _first_root(gap, points: List[float]) -> Optional[float]:
    grid = sorted(set(float(p) for p in points if p > 0))
    values = [gap(T) for T in grid]
    for (a, f_a), (b, f_b) in zip(zip(grid, values), zip(grid[1:], values[1:])):
        if f_a == 0:
            return a
        if (f_a < 0) != (f_b < 0):
            return float(brentq(gap, a, b, xtol=1e-12 * b))
    return None
