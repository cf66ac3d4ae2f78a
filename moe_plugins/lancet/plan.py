"""Lancet's operator partition pass (lancet-slides "Operator Partition Pass"): which runs of consecutive ops to
split into k equal batch partitions, so that one partition's all-to-all runs while another partition computes.
Pure: no torch, no process groups, no module state. ``moe-plugins plan lancet`` (:mod:`.plan_cli`) prints it.

Legend (the papers' letters; units in brackets):
  B  samples per rank            L  tokens per sample           M  model dim        H  FFN hidden dim
  E  experts                     k  routes per token (top-k)    f  capacity factor  P  expert-parallel ranks
  C  capacity, slots per expert: C = ceil(k f B L / E)          heads: attention heads (M % heads == 0)
  alpha_a [s], beta_a [s/byte]: one all-to-all of x bytes takes alpha_a + beta_a x
  alpha_c [s], beta_c [s/mac]: one GEMM of x multiply-adds ("mac") takes alpha_c + beta_c x
  In the planner, k (the slides' k) is a segment's number of batch partitions, K = ``max_partitions``.

1. **Ops.** An :class:`Op` costs ``alpha`` [s] per call and ``beta`` [s] for the whole batch's work; a segment cut
   into k partitions runs it k times at ``alpha + beta / k``. ``barrier=True`` marks an op that must see the
   whole batch (the MoE gate: capacity and the balance loss are per batch), so it only runs in k = 1 segments.
2. **Executor model** (:func:`segment_time`): one compute thread and one FIFO communication lane, stage-major.
3. **The DP** (:func:`plan_segments`): T(0) = 0, T(n) = min over 0 <= i < n and allowed k of T(i) + P(i, n, k),
   P the segment's time. Segments run one after another (a segment starts when the previous one has finished
   everything: its partitions are concatenated), so the total is the sum. The slides index from 1 (T(1) the
   first op); with T(0) = 0 the whole op list as one segment is a candidate too.
4. **Objective.** ``"training"`` (default) adds the mirrored backward of each segment with the same k: its ops
   reversed, compute beta x ``backward_factor`` (dX and dW: 2 GEMMs per forward GEMM; alpha is kept, a
   simplification) and comm unchanged (the gradient all-to-all moves the same bytes). ``"forward"`` plans the
   forward pass alone, the slides' objective.
5. **GPT-2-MoE ops** (:func:`gpt2_moe_ops`): per block, attention (with ln_1), then the dense FFN, or in an MoE
   block gate, dispatch, experts, combine. Block i (from 0) is an MoE block when (i + 1) % moe_every == 0.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

COMPUTE, COMM = "compute", "comm"
KINDS = (COMPUTE, COMM)
OBJECTIVES = ("training", "forward")
BACKWARD_FACTOR = 2.0
TIE = 1e-9              # plans within this fraction of the best are ties: fewer partitions, longer segments win
NOT_ALLOWED = "not allowed"     # Candidate.excluded when allowed(k) is False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class Op:
    name: str
    kind: str            # "compute" | "comm"
    alpha: float         # [s] per call
    beta: float          # [s] the whole batch's work
    barrier: bool = False

    def __post_init__(self) -> None:
        problems = [] if self.kind in KINDS else [f"kind ({self.kind!r}) must be one of {', '.join(KINDS)}"]
        problems += [f"{term} ({getattr(self, term)!r}) must be a finite number >= 0" for term in ("alpha", "beta")
                     if not (_is_number(getattr(self, term)) and getattr(self, term) >= 0)]
        if not isinstance(self.barrier, bool):
            problems.append(f"barrier ({self.barrier!r}) must be True or False")
        if problems:
            raise ValueError(f"invalid Op {self.name!r}: " + "; ".join(problems))

    def time(self, k: int) -> float:
        """Seconds of one of k partitions."""
        return self.alpha + self.beta / k


# ================================ 1. the executor model ===============================================

@dataclass(frozen=True, kw_only=True)
class Event:
    op: str
    part: int           # 1..k
    where: str          # "thread" (compute) | "lane" (comm)
    start: float
    end: float


def check_k(k: Any) -> None:
    if not (_is_int(k) and k >= 1):
        raise ValueError(f"k ({k!r}) must be an integer >= 1")


def segment_timeline(ops: Sequence[Op], k: int) -> Tuple[Event, ...]:
    """Every (op, partition)'s interval under :func:`segment_time`'s model, in the thread's walk order."""
    check_k(k)
    thread, lane = 0.0, 0.0         # when the compute thread / the communication lane is next free
    done = [0.0] * k                # when each partition's previous op finished
    events = []
    for op in ops:
        t = op.time(k)
        for p in range(k):
            if op.kind == COMPUTE:      # the thread waits for the partition's input, then computes
                start = max(thread, done[p])
                thread = done[p] = start + t
            else:                       # issued when the thread gets here and the input is ready; runs FIFO
                start = max(thread, done[p], lane)
                lane = done[p] = start + t
            events.append(Event(op=op.name, part=p + 1, where="thread" if op.kind == COMPUTE else "lane",
                                start=start, end=start + t))
    return tuple(events)


def segment_time(ops: Sequence[Op], k: int) -> float:
    """The makespan of a segment run as k equal batch partitions, from all inputs ready at 0.

    The runtime issues stage-major: one compute thread walks the ops in order and, for each op, the partitions
    p = 1..k. A compute op of p starts when the thread is free and p's previous op has finished. A comm op of p
    is issued (no thread time) when the thread reaches it and p's previous op has finished, and runs on the one
    communication lane when it is free, FIFO in issue order; the thread waits for it only when p's next op
    needs it. k = 1 is the serial sum. Ops X (compute), D (comm), Y (compute), each 4 s of work, k = 2::

        time    0   2   4   6   8   10
        thread  |X1 |X2 |...|Y1 |Y2 |        D1 is issued after X2 (stage-major), D2 right behind it;
        lane            |D1 |D2 |            D2 runs under Y1: 10 s instead of 12 s.

    The makespan is when the last op of any partition ends."""
    return max((e.end for e in segment_timeline(ops, k)), default=0.0)


def backward_ops(ops: Sequence[Op], backward_factor: float = BACKWARD_FACTOR) -> Tuple[Op, ...]:
    """The mirrored backward: ops reversed, compute beta x ``backward_factor``, comm unchanged."""
    return tuple(replace(op, beta=op.beta * backward_factor) if op.kind == COMPUTE else op for op in reversed(ops))


# ================================ 2. the DP ===========================================================

@dataclass(frozen=True, kw_only=True)
class Candidate:
    k: int
    time_s: Optional[float]       # the objective's time of the segment with k partitions; None: barrier inside
    forward_s: Optional[float]
    backward_s: Optional[float]   # 0 with objective "forward"
    excluded: str = ""            # why the planner may not pick this k ("" = it may)


@dataclass(frozen=True, kw_only=True)
class Segment:
    start: int                    # ops[start:end]
    end: int
    k: int
    time_s: float
    forward_s: float
    backward_s: float
    candidates: Tuple[Candidate, ...]     # every k in 1..max_partitions, for the explanation


@dataclass(frozen=True, kw_only=True)
class Plan:
    segments: Tuple[Segment, ...]
    time_s: float                 # the sum of the segments' times
    serial_s: float               # no pipelining: the one k = 1 segment
    objective: str
    backward_factor: float
    ks: Tuple[int, ...]           # the k the planner could choose from


def candidate_ks(max_partitions: int, allowed: Callable[[int], bool]) -> Tuple[int, ...]:
    """1..max_partitions filtered by ``allowed``; 1 must be allowed (a barrier has nowhere else to go)."""
    if not (_is_int(max_partitions) and max_partitions >= 1):
        raise ValueError(f"max_partitions ({max_partitions!r}) must be an integer >= 1")
    ks = tuple(k for k in range(1, max_partitions + 1) if allowed(k))
    if 1 not in ks:
        raise ValueError("allowed(1) is False: every plan needs k = 1 (barrier ops run unpartitioned)")
    return ks


def plan_segments(ops: Sequence[Op], max_partitions: int, allowed: Callable[[int], bool] = lambda k: True, *,
                  objective: str = "training", backward_factor: float = BACKWARD_FACTOR) -> Plan:
    """The optimal segmentation of ``ops`` and each segment's k (T(n) of the module docstring).

    k ranges over 1..``max_partitions`` with ``allowed(k)`` (the executor accepts only k that divide the batch);
    a segment with k >= 2 holds no barrier op. Ties within :data:`TIE` go to the longer last segment, then to the
    fewer partitions. Each chosen segment carries every k's time (:class:`Candidate`) for the explanation."""
    ops = tuple(ops)
    problems = [f"ops[{i}] ({op!r}) must be an Op" for i, op in enumerate(ops) if not isinstance(op, Op)]
    if not ops:
        problems.append("ops must hold at least one Op")
    if objective not in OBJECTIVES:
        problems.append(f"objective ({objective!r}) must be one of {', '.join(OBJECTIVES)}")
    if not (_is_number(backward_factor) and backward_factor > 0):
        problems.append(f"backward_factor ({backward_factor!r}) must be a finite number > 0")
    if problems:
        raise ValueError("plan_segments: " + "; ".join(problems))
    ks, n = candidate_ks(max_partitions, allowed), len(ops)
    back = backward_ops(ops, backward_factor) if objective == "training" else ()
    barriers = [0]
    for op in ops:
        barriers.append(barriers[-1] + op.barrier)
    memo: Dict[Tuple[int, int, int], Tuple[float, float]] = {}

    def cost(i: int, j: int, k: int) -> Tuple[float, float]:       # (forward, backward) of ops[i:j] at k
        if (i, j, k) not in memo:
            memo[i, j, k] = (segment_time(ops[i:j], k), segment_time(back[n - j:n - i], k) if back else 0.0)
        return memo[i, j, k]

    best, choice = [0.0] + [math.inf] * n, [(0, 1)] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            for k in ks:
                if k >= 2 and barriers[j] > barriers[i]:
                    continue
                total = best[i] + sum(cost(i, j, k))
                if total < best[j] * (1 - TIE):
                    best[j], choice[j] = total, (i, k)
    bounds, j = [], n
    while j > 0:
        i, k = choice[j]
        bounds.append((i, j, k))
        j = i
    segments = []
    for i, j, k in reversed(bounds):
        fwd, bwd = cost(i, j, k)
        segments.append(Segment(start=i, end=j, k=k, time_s=fwd + bwd, forward_s=fwd, backward_s=bwd,
                                candidates=_candidates(ops, i, j, max_partitions, ks, cost)))
    return Plan(segments=tuple(segments), time_s=sum(s.time_s for s in segments), serial_s=sum(cost(0, n, 1)),
                objective=objective, backward_factor=backward_factor, ks=ks)


def _candidates(ops, i, j, max_partitions, ks, cost) -> Tuple[Candidate, ...]:
    barrier = next((op.name for op in ops[i:j] if op.barrier), None)
    out = []
    for k in range(1, max_partitions + 1):
        if k >= 2 and barrier is not None:
            out.append(Candidate(k=k, time_s=None, forward_s=None, backward_s=None,
                                 excluded=f"holds the barrier op {barrier}"))
            continue
        fwd, bwd = cost(i, j, k)
        out.append(Candidate(k=k, time_s=fwd + bwd, forward_s=fwd, backward_s=bwd,
                             excluded="" if k in ks else NOT_ALLOWED))
    return tuple(out)


# ================================ 3. GPT-2-MoE ops ====================================================

INT_SIZES = ("B", "L", "M", "H", "heads", "E", "k", "P", "layers", "moe_every", "element_bytes")
COST_TERMS = ("alpha_a", "beta_a", "alpha_c", "beta_c")
GEMMS = {"attention": 6, "ffn": 2, "gate": 1, "experts": 2}    # GEMM launches per op: alpha = GEMMS x alpha_c


def size_problems(values: Mapping[str, Any], label: Callable[[str], str] = str) -> List[str]:
    """Every problem of the sizes in ``values`` (keys: :data:`INT_SIZES` and ``f``), each named by ``label``."""
    problems = [f"{label(n)} ({values[n]!r}) must be an integer >= 1" for n in INT_SIZES
                if not (_is_int(values[n]) and values[n] >= 1)]
    if not (_is_number(values["f"]) and values["f"] > 0):
        problems.append(f"{label('f')} ({values['f']!r}) must be a finite number > 0")
    if problems:
        return problems
    v = values
    if v["M"] % v["heads"]:
        problems.append(f"{label('M')} ({v['M']}) must be divisible by {label('heads')} ({v['heads']})")
    if v["E"] % v["P"]:
        problems.append(f"{label('E')} ({v['E']}) must be divisible by {label('P')} ({v['P']})")
    if v["k"] > v["E"]:
        problems.append(f"{label('k')} ({v['k']}) must not exceed {label('E')} ({v['E']})")
    return problems


def cost_problems(values: Mapping[str, Any], label: Callable[[str], str] = str) -> List[str]:
    return [f"{label(n)} ({values[n]!r}) must be a finite number >= 0" for n in COST_TERMS
            if not (_is_number(values[n]) and values[n] >= 0)]


@dataclass(frozen=True, kw_only=True)
class GPT2MoESizes:
    B: int
    L: int
    M: int
    H: int
    heads: int
    E: int
    k: int = 1
    f: float = 1.0
    P: int = 1
    layers: int = 1
    moe_every: int = 1
    element_bytes: int = 4

    def __post_init__(self) -> None:
        problems = size_problems(asdict(self))
        if problems:
            raise ValueError("invalid GPT2MoESizes: " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class LancetCosts:
    alpha_a: float      # [s] per all-to-all
    beta_a: float       # [s/byte]
    alpha_c: float      # [s] per GEMM
    beta_c: float       # [s/mac]

    def __post_init__(self) -> None:
        problems = cost_problems(asdict(self))
        if problems:
            raise ValueError("invalid LancetCosts: " + "; ".join(problems))


def capacity(*, B: int, L: int, E: int, k: int, f: float) -> int:
    """C = ceil(k f B L / E), the core's rule (core.gating.capacity with min_capacity 0)."""
    return int(math.ceil(k * f * B * L / E))


def attention_macs(*, B: int, L: int, M: int) -> int:
    """Q, K, V, O projections 4 B L M^2; scores and values 2 B L^2 M (summed over heads)."""
    return 4 * B * L * M * M + 2 * B * L * L * M


def ffn_macs(*, B: int, L: int, M: int, H: int) -> int:
    return 2 * B * L * M * H


def gate_macs(*, B: int, L: int, M: int, E: int) -> int:
    return B * L * M * E


def exchange_bytes(*, E: int, C: int, M: int, element_bytes: int) -> int:
    """Bytes one rank sends in one dispatch (and one combine): E C M elements."""
    return E * C * M * element_bytes


def expert_macs(*, E: int, C: int, M: int, H: int) -> int:
    """The rank's E/P experts, P C rows each, two GEMMs: 2 (E/P)(P C) M H = 2 E C M H."""
    return 2 * E * C * M * H


def is_moe_block(i: int, moe_every: int) -> bool:
    return (i + 1) % moe_every == 0


def gpt2_moe_ops(sizes: GPT2MoESizes, costs: LancetCosts) -> Tuple[Op, ...]:
    """The forward op list of the transformer stack, named ``block<i>.<op>``."""
    s, c = sizes, costs
    C = capacity(B=s.B, L=s.L, E=s.E, k=s.k, f=s.f)
    nbytes = exchange_bytes(E=s.E, C=C, M=s.M, element_bytes=s.element_bytes)

    def compute(name: str, kind: str, macs: int, barrier: bool = False) -> Op:
        return Op(name=name, kind=COMPUTE, alpha=GEMMS[kind] * c.alpha_c, beta=macs * c.beta_c, barrier=barrier)

    def comm(name: str) -> Op:
        return Op(name=name, kind=COMM, alpha=c.alpha_a, beta=nbytes * c.beta_a)

    ops: List[Op] = []
    for i in range(s.layers):
        ops.append(compute(f"block{i}.attention", "attention", attention_macs(B=s.B, L=s.L, M=s.M)))
        if not is_moe_block(i, s.moe_every):
            ops.append(compute(f"block{i}.ffn", "ffn", ffn_macs(B=s.B, L=s.L, M=s.M, H=s.H)))
            continue
        ops += [compute(f"block{i}.gate", "gate", gate_macs(B=s.B, L=s.L, M=s.M, E=s.E), barrier=True),
                comm(f"block{i}.dispatch"),
                compute(f"block{i}.experts", "experts", expert_macs(E=s.E, C=C, M=s.M, H=s.H)),
                comm(f"block{i}.combine")]
    return tuple(ops)
