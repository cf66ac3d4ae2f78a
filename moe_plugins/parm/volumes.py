"""Parm's sizes and collectives per schedule, as pure functions (the notation and the equations are in
:mod:`moe_plugins.parm.cost`'s docstring; this module is its first half: what each schedule sends, before
any price).

Units: sizes in elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

SCHEDULE_S1 = "parm-s1"
SCHEDULE_S2 = "parm-s2"
SCHEDULE_TP = "baseline-tp"     # DeepSpeed's own tensor-parallel flow (moe_plugins/core/baseline_tp.py)
# t_D1 and t_D2 within this fraction of each other are a near-tie: decided by all-to-all bytes, not by price
NEAR_TIE = 0.02


@dataclass(frozen=True, kw_only=True)
class ParmShape:
    """One MoE layer and its parallel degrees, in the paper's letters (per rank: B samples of L tokens)."""

    B: int
    L: int
    M: int
    H: int
    E: int
    k: int = 1
    f: float = 1.0
    mp: int = 1
    ep: int = 1
    esp: int = 1


def shape_problems(shape: ParmShape) -> List[str]:
    """Every reason the shape cannot be planned, each naming the field and the values (empty when fine)."""
    problems = []
    for name in ("B", "L", "M", "H", "E", "k", "mp", "ep", "esp"):
        value = getattr(shape, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{name} ({value!r}) must be a positive integer")
    if not isinstance(shape.f, (int, float)) or not math.isfinite(shape.f) or shape.f <= 0:
        problems.append(f"f ({shape.f!r}) must be a finite number > 0")
    if problems:
        return problems
    if shape.k > shape.E:
        problems.append(f"k ({shape.k}) must not exceed E ({shape.E})")
    if shape.E % shape.ep:
        problems.append(f"E ({shape.E}) must be divisible by ep ({shape.ep})")
    if shape.H % shape.esp:
        problems.append(f"H ({shape.H}) must be divisible by esp ({shape.esp})")
    return problems


def check_shape(shape: ParmShape) -> ParmShape:
    problems = shape_problems(shape)
    if problems:
        raise ValueError("invalid Parm shape: " + "; ".join(problems))
    return shape


@dataclass(frozen=True)
class Sizes:
    """x, T and y of §IV (elements, slots, elements)."""

    x: float
    T: float
    y: float


def s1_slots(shape: ParmShape, T: Optional[float] = None) -> float:
    """Slots per expert in S1's buffer under balanced routing: C_l of moe_plugins/parm/schedules.py.

    Not the paper's T / N_MP. This S1 drops exactly the baseline's routes, so the capacity positions are
    GShard's over the MP group's whole token block: route rank r of token block p holds the positions
    [(r N_MP + p) d, (r N_MP + p + 1) d) of every expert, d = B L / (E N_MP) routes. Block 0 keeps the
    most, sum_r clamp(T - r N_MP d, 0, d), and every block's buffer has that many slots. That is T / N_MP
    when T is a multiple of N_MP d (f = 1 with k = 1 or 2), up to T when capacity is short (f < 1 / N_MP),
    and k d, below T / N_MP, when capacity is to spare (large f): S1 sends kept routes, S2 the capacity."""
    slots = sizes(shape, T).T
    d = shape.B * shape.L / (shape.E * shape.mp)
    return sum(min(max(slots - r * shape.mp * d, 0.0), d) for r in range(shape.k))


def sizes(shape: ParmShape, T: Optional[float] = None) -> Sizes:
    """x = B L M, T = k f B L / E (or the given T, e.g. a measured capacity), y = E T M N_ESP."""
    check_shape(shape)
    slots = shape.k * shape.f * shape.B * shape.L / shape.E if T is None else float(T)
    return Sizes(x=float(shape.B * shape.L * shape.M), T=slots, y=float(shape.E * slots * shape.M * shape.esp))


# ---- the collectives each schedule issues (one direction) ----------------------------------------------

@dataclass(frozen=True)
class Op:
    """One collective: ``op`` on the group kind ``group``, passing ``numel`` elements (ledger convention:
    the gathered size for an all-gather, the input size otherwise)."""

    op: str
    group: str
    numel: float

    @property
    def key(self) -> str:
        return f"{self.op}@{self.group}"


def tp_flow_problems(shape: ParmShape) -> List[str]:
    """Why DeepSpeed's tensor-parallel flow (``baseline-tp``) is not a candidate for this shape: it needs
    N_MP > 1 (without MP it is the EP all-to-all pair every schedule sends) and N_ESP equal to 1 or to N_MP
    (DeepSpeed shards experts over the tensor-parallel group)."""
    out = []
    if shape.mp == 1:
        out.append("mp (1) must be > 1")
    if shape.esp not in (1, shape.mp):
        out.append(f"esp ({shape.esp}) must be 1 or mp ({shape.mp})")
    return out


def schedule_ops(schedule: str, shape: ParmShape, T: Optional[float] = None, *,
                 c_l: Optional[float] = None) -> List[Op]:
    """The collectives of one direction of ``schedule`` ("baseline", "parm-s1", "parm-s2", "baseline-tp"),
    with the paper's sizes; collectives on groups of size 1 are left out (the layer does not issue them).
    ``c_l``: S1's buffer in slots per expert as observed on real routing (None: :func:`s1_slots`, balanced
    routing).

    "baseline-tp" is DeepSpeed's flow (not in the paper): each MP rank sends its 1/N_MP of the capacity
    through the EP all-to-all (E T M / N_MP elements), all-gathers it over ESP (= MP) when experts are
    sharded and all-reduces their output (E T M), sends it back and all-gathers the capacity over MP::

        t_TP = 2 A2A_EP(E T M / N_MP) + [AG_ESP(E T M) + AR_ESP(E T M)] + AG_MP(E T M)"""
    if c_l is not None and not (isinstance(c_l, (int, float)) and math.isfinite(c_l) and c_l >= 0):
        raise ValueError(f"c_l ({c_l!r}) must be a finite number >= 0 (S1's slots per expert)")
    s = sizes(shape, T)
    etm = shape.E * s.T * shape.M
    if schedule == "baseline":
        ops = [Op("all_gather", "esp", s.x * shape.esp), Op("all_to_all", "ep", s.y),
               Op("all_reduce", "esp", s.y), Op("all_to_all", "ep", s.y)]
    elif schedule == SCHEDULE_S1:
        y1 = shape.E * (s1_slots(shape, T) if c_l is None else c_l) * shape.M * shape.esp
        ops = [Op("all_to_all", "ep_esp", y1)] * 2 + [Op("all_gather", "mp", s.x)]
    elif schedule == SCHEDULE_S2:
        ops = [Op("all_to_all", "ep_esp", s.y / shape.mp)] * 2 + [Op("all_gather", "mp", etm)]
    elif schedule == SCHEDULE_TP:
        problems = tp_flow_problems(shape)
        if problems:
            raise ValueError(f"schedule {SCHEDULE_TP!r} cannot run on this shape: {'; '.join(problems)}")
        a2a = Op("all_to_all", "ep", etm / shape.mp)
        ops = [a2a, Op("all_gather", "esp", etm), Op("all_reduce", "esp", etm), a2a, Op("all_gather", "mp", etm)]
    else:
        raise ValueError(f"schedule ({schedule!r}) must be 'baseline', {SCHEDULE_S1!r}, {SCHEDULE_S2!r} or "
                         f"{SCHEDULE_TP!r}")
    size = {"mp": shape.mp, "ep": shape.ep, "esp": shape.esp, "ep_esp": shape.ep * shape.esp}
    return [o for o in ops if size[o.group] > 1]


def s1_gate_ops(shape: ParmShape, phase: str) -> List[Op]:
    """The O(E) collectives of S1's split gate (each MP rank gates its 1/N_MP of the tokens), outside the
    paper's model and not costed: forward, the all-gather of every block's route counts (k E integers per
    MP rank) and the all-reduce of the gate sums (E); backward, the all-reduce of the gate weight's partial
    gradient (E M). None with N_MP = 1. (Dropless capacity adds the integer maxes every schedule issues.)"""
    check_shape(shape)
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase ({phase!r}) must be 'forward' or 'backward'")
    if shape.mp == 1:
        return []
    if phase == "forward":
        return [Op("all_gather", "mp", float(shape.mp * shape.k * shape.E)), Op("all_reduce", "mp", float(shape.E))]
    return [Op("all_reduce", "mp", float(shape.E * shape.M))]


def op_volumes(ops: List[Op]) -> Dict[str, Tuple[int, float]]:
    """``op@group`` -> (count, total elements): the shape of a CommLedger summary row."""
    out: Dict[str, Tuple[int, float]] = {}
    for o in ops:
        count, total = out.get(o.key, (0, 0.0))
        out[o.key] = (count + 1, total + o.numel)
    return out
