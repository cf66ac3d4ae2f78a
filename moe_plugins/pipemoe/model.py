"""PipeMoE (pipemoe.txt): pipelined dispatch / experts / combine with the optimal pipeline degree r.

The time model and its units:

1. **The time model.** Eq. 9-12 as an executable recurrence over per-chunk times, and Theorem 1's optimal r.
   Eq. 9-12 as printed let a combine C_1 start while dispatches D_2..D_r still hold the link, yet the
   paper's closed forms (Eq. 25, 33, 40 and the condition Q2) only hold if dispatch and combine share one
   link in FIFO order D_1..D_r, C_1..C_r (Tutel's single communication stream). We add that one
   constraint (C_1 starts after D_r) and then, for equal chunks d = t_d(n_d/r), e = t_e(n_e/r),

       T(r) = max(2 r d, 2 d + r e) = max(f4(r), f3(r))                      (f2 = f4 as functions)

   exactly: Q2 <=> f3 > f4, and Q1 (d >= e) implies not Q2 for r >= 2. T is convex in r, so the integer
   optimum is a neighbour of the continuous one; f3/f4 are solved on their regions by scipy's SLSQP and
   every candidate is re-timed with the recurrence itself. r = 1 costs 2 t_d + t_e (Eq. 19; Algorithm 1's
   line 5, 2 t_e + t_d, contradicts it and is not used). ``shared_link=False`` gives Eq. 9-12 verbatim.
   Training runs the pipeline twice: forward, then backward with the mirrored stages (combine-grad,
   expert backward = ``backward_factor`` x the forward GEMM work, dispatch-grad) and the same r; its
   optimum lies between the two passes' optima (a sum of convex functions) and is found there exactly.
   With a measured exchange curve (``PipeCosts.exchange_curve``, the default when the profile holds the
   all-to-all's measurements) t_d is no longer a line, the closed forms do not apply, and the degree is
   the recurrence's minimum over every r = 1..r_max (:func:`searched_degree`).

2. **Units.** n_d = bytes one rank sends in one dispatch exchange (E * C * M * element bytes for the
   plain expert-parallel layer), n_e = multiply-adds of one expert GEMM summed over local experts
   (rows * M * H_shard). alpha_* in seconds, beta_a in s/byte, beta_e in s/mac (:class:`PipeCosts`).

The runner is :mod:`moe_plugins.pipemoe.runner`; the auto degree :mod:`moe_plugins.pipemoe.degree`.

Shapes: E experts, C capacity (c = a chunk of it), M model dim, H FFN hidden, S tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

from moe_plugins.core.costmodel import PipeCosts
from moe_plugins.core.gating import capacity

R_MAX = 64
OBJECTIVES = ("forward", "training")
# Degrees predicted within 1% of the optimum count as ties, broken towards fewer chunks (choose_degree).
# Chosen offline on the two committed PipeMoE bench runs (git a2e58f3 and ce23b08): among the groups where
# the choice was a measured degree, it was within 5% of the best in 8/11 and 9/11 with tolerance 0, and in
# 9/12 and 10/11 with 1%; the picks r = 10, 25, 45 went away. Later runs test it out of sample.
TIE_TOLERANCE = 0.01


# ================================ 1. the time model (pure) ============================================

def pipeline_time(t_d: Sequence[float], t_e: Sequence[float], t_c: Sequence[float], *,
                  shared_link: bool = True) -> float:
    """Eq. 9-12 for r chunks with the given per-chunk times; returns t_moe.

    ``shared_link``: dispatch and combine use one link in FIFO order, so C_1 also waits for D_r to end
    (the assumption behind the paper's closed forms). False: Eq. 9-12 exactly as printed."""
    r = len(t_d)
    if not r or len(t_e) != r or len(t_c) != r:
        raise ValueError(f"pipeline_time: t_d, t_e, t_c need the same length >= 1 (got {len(t_d)}, "
                         f"{len(t_e)}, {len(t_c)})")
    tau_d, tau_e, tau_c = [0.0] * r, [0.0] * r, [0.0] * r
    for i in range(1, r):                                                  # Eq. 9
        tau_d[i] = tau_d[i - 1] + t_d[i - 1]
    tau_e[0] = tau_d[0] + t_d[0]                                           # Eq. 10
    for i in range(1, r):
        tau_e[i] = max(tau_e[i - 1] + t_e[i - 1], tau_d[i] + t_d[i])
    tau_c[0] = tau_e[0] + t_e[0]                                           # Eq. 11
    if shared_link:
        tau_c[0] = max(tau_c[0], tau_d[r - 1] + t_d[r - 1])
    for i in range(1, r):
        tau_c[i] = max(tau_e[i] + t_e[i], tau_c[i - 1] + t_c[i - 1])
    return tau_c[r - 1] + t_c[r - 1] - tau_d[0]                            # Eq. 12


def chunk_costs(costs: PipeCosts, n_d: float, n_e: float, r: float) -> Tuple[float, float]:
    """(t_d, t_e) of one of r equal chunks (Eq. 15, 17); t_c = t_d (Eq. 18). With r >= 2 and a stream
    curve, t_d is that of a chunk behind another (all but the first dispatch, see :func:`moe_time`)."""
    x = n_d / r
    return (costs.stream_time(x) if r >= 2 else costs.exchange_time(x)), costs.alpha_e + costs.beta_e * n_e / r


def moe_time(costs: PipeCosts, n_d: float, n_e: float, r: int, *, shared_link: bool = True,
             expert_factor: float = 1.0) -> float:
    """The recurrence for r equal chunks; ``expert_factor`` scales the expert stage (backward = 2).

    The first dispatch follows idle link time and costs ``exchange_time``; with r >= 2 every later exchange
    leaves right behind another on the lane (D_1..D_r, then C_1..C_r, FIFO) and costs ``stream_time``
    (the same without a stream curve). With r = 1 the combine follows the experts' compute, like the
    profile's isolated exchange."""
    first, e = costs.exchange_time(n_d / r), costs.alpha_e + costs.beta_e * n_e / r
    d = costs.stream_time(n_d / r) if r >= 2 else first
    return pipeline_time([first] + [d] * (r - 1), [expert_factor * e] * r, [d] * r, shared_link=shared_link)


def step_time(costs: PipeCosts, r: int, objective: str) -> float:
    """The runner's measured cost of pipelining at all (``PipeCosts.pipeline_step``, forward + backward):
    0 at r = 1, which runs the sequential loop. The forward pass carries a third of it, as it carries one of
    the three expert stages (forward e, backward 2 e) whose start-up the chunk slope is charged to."""
    if r <= 1:
        return 0.0
    return costs.pipeline_step / 3 if objective == "forward" else costs.pipeline_step


def forward_time(costs: PipeCosts, n_d: float, n_e: float, r: int) -> float:
    """The forward pipeline's recurrence plus its share of the step."""
    return moe_time(costs, n_d, n_e, r) + step_time(costs, r, "forward")


def training_time(costs: PipeCosts, n_d: float, n_e: float, r: int, backward_factor: float = 2.0) -> float:
    """Forward pipeline plus the mirrored backward pipeline, same r, plus the step."""
    return (moe_time(costs, n_d, n_e, r) + moe_time(costs, n_d, n_e, r, expert_factor=backward_factor)
            + step_time(costs, r, "training"))


def objective_time(costs: PipeCosts, n_d: float, n_e: float, r: int, objective: str,
                   backward_factor: float = 2.0) -> float:
    """T(r) of one of :data:`OBJECTIVES`: :func:`forward_time`, or :func:`training_time`."""
    if objective == "forward":
        return forward_time(costs, n_d, n_e, r)
    return training_time(costs, n_d, n_e, r, backward_factor)


# -- Theorem 1's pieces (Eq. 19-44), continuous in r ---------------------------------------------------

def f1(c: PipeCosts, n_d: float, n_e: float) -> float:                          # Eq. 19
    return 2 * c.alpha_a + c.alpha_e + 2 * c.beta_a * n_d + c.beta_e * n_e


def f2(c: PipeCosts, n_d: float, n_e: float, r: float) -> float:                # Eq. 25 (= Eq. 40)
    return 2 * r * c.alpha_a + 2 * n_d * c.beta_a


def f3(c: PipeCosts, n_d: float, n_e: float, r: float) -> float:                # Eq. 33-34
    return 2 * c.alpha_a + c.beta_e * n_e + 2 * c.beta_a * n_d / r + c.alpha_e * r


f4 = f2                                                                         # Eq. 41


def q1(c: PipeCosts, n_d: float, n_e: float, r: float) -> float:
    """Q1 (Eq. 21) holds iff this is >= 0: t_d(n_d/r) - t_e(n_e/r)."""
    d, e = chunk_costs(c, n_d, n_e, r)
    return d - e


def q2(c: PipeCosts, n_d: float, n_e: float, r: float) -> float:
    """Q2 (Eq. 30) holds iff this is > 0: r alpha_e + beta_e n_e - 2(r-1)(alpha_a + beta_a n_d / r)."""
    return r * c.alpha_e + c.beta_e * n_e - 2 * (r - 1) * (c.alpha_a + c.beta_a * n_d / r)


@dataclass(frozen=True)
class Candidate:
    r: int
    time_s: float
    case: str          # "r=1", "Q1 (f2)", "Q2 (f3)", "not Q2 (f4)", or the training search


@dataclass(frozen=True)
class DegreeChoice:
    degree: int
    predicted_time_s: float
    case: str
    candidates: Tuple[Candidate, ...]
    objective: str


Fn = Tuple[Callable[[float], float], Callable[[float], float]]       # a function of r and its derivative


def _slsqp(objective: Fn, constraints: List[Fn], r_max: int, starts: Sequence[float]) -> Optional[float]:
    """Minimise objective(r) on [2, r_max] subject to g(r) >= 0 for every constraint (analytic gradients);
    best of several starts (Q2's feasible set can be two intervals). None when no start ends feasible."""
    from scipy.optimize import minimize
    fun, grad = objective
    cons = [{"type": "ineq", "fun": (lambda v, g=g: g(float(v[0]))), "jac": (lambda v, dg=dg: [dg(float(v[0]))])}
            for g, dg in constraints]
    best: Optional[Tuple[float, float]] = None
    for start in starts:
        res = minimize(lambda v: fun(float(v[0])), x0=[min(max(start, 2.0), r_max)], method="SLSQP",
                       jac=lambda v: [grad(float(v[0]))], bounds=[(2.0, float(r_max))], constraints=cons,
                       options={"ftol": 1e-12, "maxiter": 200})
        r = float(res.x[0])
        scale = max(1.0, abs(fun(r)))
        if all(g(r) >= -1e-9 * scale for g, _ in constraints) and (best is None or fun(r) < best[1]):
            best = (r, fun(r))
    return None if best is None else best[0]


def _neighbours(r: float, r_max: int) -> List[int]:
    return sorted({min(max(v, 2), r_max) for v in (math.floor(r), math.ceil(r))})


def _r2(c: PipeCosts, n_d: float, n_e: float, r_max: int) -> Optional[int]:
    """Eq. 28 with the sign of (alpha_a - alpha_e) handled: the smallest r >= 2 where Q1 holds."""
    da, rhs = c.alpha_a - c.alpha_e, c.beta_e * n_e - c.beta_a * n_d       # Q1 <=> da * r >= rhs
    if da > 0:
        r = max(2, math.ceil(rhs / da - 1e-12))
    elif da < 0:
        r = 2 if 2 * da >= rhs else None
    else:
        r = 2 if rhs <= 0 else None
    return r if r is not None and r <= r_max else None


def optimal_degree(costs: PipeCosts, n_d: float, n_e: float, *, r_max: int = R_MAX) -> DegreeChoice:
    """Theorem 1 for one pass: candidates from r = 1, Q1 (Eq. 28), Q2 (f3 by SLSQP) and not-Q2 (f4 by
    SLSQP), each SLSQP optimum rounded both ways and re-timed with the recurrence; the fastest wins
    (ties go to the smaller r)."""
    _check_theorem_inputs(costs, n_d, n_e, r_max)
    cands = [Candidate(1, forward_time(costs, n_d, n_e, 1), "r=1")]
    if r_max >= 2:
        c, ad, ae = costs, costs.beta_a * n_d, costs.beta_e * n_e
        obj3: Fn = (lambda r: f3(c, n_d, n_e, r), lambda r: c.alpha_e - 2 * ad / r ** 2)
        obj4: Fn = (lambda r: f4(c, n_d, n_e, r), lambda r: 2 * c.alpha_a)
        not_q1: Fn = (lambda r: -q1(c, n_d, n_e, r), lambda r: (ad - ae) / r ** 2)
        is_q2: Fn = (lambda r: q2(c, n_d, n_e, r), lambda r: c.alpha_e - 2 * c.alpha_a - 2 * ad / r ** 2)
        not_q2: Fn = (lambda r: -is_q2[0](r), lambda r: -is_q2[1](r))
        r2 = _r2(costs, n_d, n_e, r_max)
        if r2 is not None:
            cands.append(Candidate(r2, forward_time(costs, n_d, n_e, r2), "Q1 (f2)"))
        # not-Q1 is monotone in r: when it fails at both ends, cases 2 and 3 are empty (no solver needed)
        if max(not_q1[0](2.0), not_q1[0](float(r_max))) < 0:
            return _pick(cands, "forward")
        free = math.sqrt(2 * ad / c.alpha_e) if c.alpha_e > 0 else float(r_max)   # f3's unconstrained optimum
        starts = {"Q2 (f3)": sorted({2.0, float(r_max), min(max(free, 2.0), r_max)}),
                  "not Q2 (f4)": [2.0, float(r_max)]}           # f4 rises with r: its optimum is a left end
        for obj, cons, case in ((obj3, [not_q1, is_q2], "Q2 (f3)"), (obj4, [not_q1, not_q2], "not Q2 (f4)")):
            r = _slsqp(obj, cons, r_max, starts[case])
            if r is not None:
                cands += [Candidate(v, forward_time(costs, n_d, n_e, v), case) for v in _neighbours(r, r_max)]
    return _pick(cands, "forward")


def optimal_training_degree(costs: PipeCosts, n_d: float, n_e: float, *, r_max: int = R_MAX,
                            backward_factor: float = 2.0) -> DegreeChoice:
    """The r minimising forward + backward time: Theorem 1 on each pass, then every integer between
    (and one beyond) the two optima, timed with the recurrence for both passes."""
    fwd = optimal_degree(costs, n_d, n_e, r_max=r_max)
    bwd_costs = PipeCosts(alpha_a=costs.alpha_a, beta_a=costs.beta_a, alpha_e=backward_factor * costs.alpha_e,
                          beta_e=backward_factor * costs.beta_e)
    bwd = optimal_degree(bwd_costs, n_d, n_e, r_max=r_max)
    lo, hi = max(1, min(fwd.degree, bwd.degree) - 1), min(r_max, max(fwd.degree, bwd.degree) + 1)
    case = f"forward + backward (Theorem 1: forward r={fwd.degree}, backward r={bwd.degree})"
    cands = [Candidate(r, training_time(costs, n_d, n_e, r, backward_factor), case) for r in range(lo, hi + 1)]
    if lo > 1:
        cands.insert(0, Candidate(1, training_time(costs, n_d, n_e, 1, backward_factor), "r=1"))
    return _pick(cands, "training")


def searched_degree(costs: PipeCosts, n_d: float, n_e: float, *, objective: str = "training",
                    r_max: int = R_MAX, backward_factor: float = 2.0) -> DegreeChoice:
    """The r in 1..r_max with the smallest recurrence time, every r timed: for costs whose exchange time is
    not a line (a measured curve), where Theorem 1's closed forms do not hold."""
    _check_plan_inputs(costs, n_d, n_e, r_max)
    case = "recurrence at every r (measured exchange curve)"
    cands = [Candidate(r, objective_time(costs, n_d, n_e, r, objective, backward_factor), case)
             for r in range(1, r_max + 1)]
    return _pick(cands, objective)


def _pick(cands: List[Candidate], objective: str) -> DegreeChoice:
    best = min(cands, key=lambda c: (c.time_s, c.r))
    uniq = {c.r: c for c in sorted(cands, key=lambda c: (c.r, c.time_s))}
    return DegreeChoice(degree=best.r, predicted_time_s=best.time_s, case=best.case,
                        candidates=tuple(uniq[r] for r in sorted(uniq)), objective=objective)


def _check_theorem_inputs(costs: PipeCosts, n_d: float, n_e: float, r_max: int) -> None:
    """Theorem 1's closed forms price an exchange with the line; a measured curve would be silently ignored."""
    if costs.exchange_curve is not None or costs.stream_curve is not None:
        raise ValueError("Theorem 1 assumes t_d = alpha_a + beta_a n_d / r; costs with an exchange_curve or "
                         "stream_curve are planned by searched_degree (choose_degree picks it)")
    _check_plan_inputs(costs, n_d, n_e, r_max)


def _check_plan_inputs(costs: PipeCosts, n_d: float, n_e: float, r_max: int) -> None:
    problems = costs.problems()
    for name, value in (("n_d", n_d), ("n_e", n_e)):
        if not math.isfinite(value) or value < 0:
            problems.append(f"{name} ({value!r}) must be a finite number >= 0")
    if not isinstance(r_max, int) or r_max < 1:
        problems.append(f"r_max ({r_max!r}) must be a positive integer")
    if problems:
        raise ValueError("cannot plan a pipeline degree: " + "; ".join(problems))


def fewest_chunks_near(times_s: Sequence[float], tie_tolerance: float) -> int:
    """The smallest r (``times_s[r - 1]`` is T(r)) whose time is within ``(1 + tie_tolerance)`` of the fastest
    (pure). A near-flat optimum is common when the link dominates: T(r) falls by fractions of a percent from
    r = 4 to r = 45, and each chunk carries costs the model leaves out (thread hand-offs, autograd, memory)."""
    bound = (1.0 + tie_tolerance) * min(times_s)
    return next(i + 1 for i, t in enumerate(times_s) if t <= bound)


def choose_degree(costs: PipeCosts, n_d: float, n_e: float, *, objective: str = "training",
                  r_max: int = R_MAX, backward_factor: float = 2.0,
                  tie_tolerance: float = TIE_TOLERANCE) -> DegreeChoice:
    """Theorem 1's optimum (:func:`optimal_degree`, :func:`optimal_training_degree`), or with a measured
    exchange curve the searched one (:func:`searched_degree`); then the fewest chunks whose recurrence time
    is within ``tie_tolerance`` of it (0: the optimum itself)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective ({objective!r}) must be one of {', '.join(OBJECTIVES)}")
    if not (isinstance(tie_tolerance, (int, float)) and 0 <= tie_tolerance < 1):
        raise ValueError(f"tie_tolerance ({tie_tolerance!r}) must be a number in [0, 1)")
    if costs.exchange_curve is not None or costs.stream_curve is not None:
        best = searched_degree(costs, n_d, n_e, objective=objective, r_max=r_max, backward_factor=backward_factor)
    elif objective == "forward":
        best = optimal_degree(costs, n_d, n_e, r_max=r_max)
    else:
        best = optimal_training_degree(costs, n_d, n_e, r_max=r_max, backward_factor=backward_factor)
    timed = {c.r: c.time_s for c in best.candidates}       # the search timed every r; Theorem 1 a few
    time_of = lambda r: timed[r] if r in timed else objective_time(costs, n_d, n_e, r, objective, backward_factor)
    r = fewest_chunks_near([time_of(v) for v in range(1, best.degree)] + [best.predicted_time_s], tie_tolerance)
    if r == best.degree:
        return best
    case = (f"fewest chunks within {tie_tolerance:.1%} of the optimum "
            f"(r={best.degree}, {best.predicted_time_s * 1e3:.3f} ms)")
    others = tuple(c for c in best.candidates if c.r != r)
    return replace(best, degree=r, predicted_time_s=time_of(r), case=case,
                   candidates=tuple(sorted(others + (Candidate(r, time_of(r), case),), key=lambda c: c.r)))


@dataclass(frozen=True)
class Workload:
    capacity: int     # C, slots per expert per rank
    n_d: float        # bytes one rank sends per dispatch
    n_e: float        # multiply-adds of one expert GEMM over this rank's experts


def plan_workload(*, B: int, L: int, M: int, H: int, E: int, k: int, f: float, P: int,
                  element_bytes: int = 4) -> Workload:
    """The paper's layer (Table I/IV) on P expert-parallel ranks: C = ceil(k f B L / E); each rank sends
    n_d = E C M element_bytes and its E/P experts receive P C rows each: n_e = (E/P)(P C) M H = E C M H.

    (Algorithm 1 lines 2-3 multiply by l = E/P instead; with the capacity rule above the buffer a rank
    exchanges does not grow with l, so the sizes here are those of the tensors actually moved.)"""
    problems = []
    for name, value in (("B", B), ("L", L), ("M", M), ("H", H), ("E", E), ("k", k), ("P", P),
                        ("element_bytes", element_bytes)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name} ({value!r}) must be a positive integer")
    if not (isinstance(f, (int, float)) and f > 0):
        problems.append(f"f ({f!r}) must be > 0")
    if not problems and E % P:
        problems.append(f"E ({E}) must be divisible by P ({P})")
    if not problems and k > E:
        problems.append(f"k ({k}) must not exceed E ({E})")
    if problems:
        raise ValueError("invalid PipeMoE layer: " + "; ".join(problems))
    cap = capacity(B * L, E, k, f, 0)
    return Workload(capacity=cap, n_d=float(E * cap * M * element_bytes), n_e=float(E * cap * M * H))
