"""Hecate's sparse materialisation plan (hecate.txt §4.2 Algorithm 1, §4.4): pure functions of host integers.

1. **Load.** Each rank counts the routes its gate sends to every expert; :func:`global_load` sums those E
   integers over the FSSDP group (one all-reduce through the layer's Recorder, so every rank plans the same) and
   :class:`LoadWindow` averages the last ``width`` iterations (Hecate: w = 5).
2. **Budget.** :func:`overlap_degree`: t = floor(T_non-MoE * bw / expert_bytes), the copies a rank can receive
   while the non-MoE work before the layer runs (and, this reproduction's addition, :func:`paying_experts`: the
   experts whose copies save more token bytes than they cost, hidden or not); :func:`materialise_budget`
   applies Algorithm 1's line 1, t <- min(t, E), m <- min(m, t), with m the memory budget ``extra_experts``
   (copies per rank).
3. **Placement.** :func:`plan_placement`: if t <= m the top-t experts go to every rank; otherwise the |D| m
   slots are given to the top-t experts by load (:func:`assign_slots`) and each expert's copies are placed
   node-first (:func:`place_copies`). The result contains the home placement (P' is a superset of P).
4. **Dispatch.** :func:`split_routes`: a source's routes for an expert go to its own copy, else evenly to the
   copies on its node, else evenly to all copies (all remote then); remainders rotate with the source rank.

Where the paper's pseudo-code is loose, the equations and the prose decide: ``assignSlotsByLoad`` gives slots
"by load" with the greedy rule that repeatedly copies the expert whose copies carry the most routes each
(D'Hondt's apportionment; it minimises the largest per-copy load, checked by brute force in the tests).

Letters: E experts, R ranks of the FSSDP group (devices), W iterations in the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import Group
from moe_plugins.core.layout import ParallelLayout

WINDOW = 5      # Hecate's sliding window (iterations)


# ---- 1. load ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadWindow:
    """The per-expert loads of the last ``width`` iterations (oldest first), ``loads_WE``; immutable:
    :meth:`push` returns the next window."""

    num_experts: int
    width: int = WINDOW
    loads_WE: Tuple[Tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        problems = [f"{name} ({value!r}) must be an integer >= 1" for name, value in
                    (("num_experts", self.num_experts), ("width", self.width)) if not _positive_int(value)]
        if not problems and len(self.loads_WE) > self.width:
            problems.append(f"loads_WE holds {len(self.loads_WE)} iterations, more than width ({self.width})")
        if not problems:
            problems += [f"loads_WE[{i}] ({list(row)}) must be {self.num_experts} integers >= 0"
                         for i, row in enumerate(self.loads_WE) if not _counts_ok(row, self.num_experts)]
        if problems:
            raise ValueError("invalid LoadWindow: " + "; ".join(problems))

    def push(self, load_E: Sequence[int]) -> "LoadWindow":
        """The window after one more iteration's global loads ``load_E`` (E integers >= 0); the oldest
        iteration drops out once ``width`` are held."""
        row = tuple(int(n) for n in load_E)
        if not _counts_ok(row, self.num_experts):
            raise ValueError(f"load_E ({list(load_E)}) must be {self.num_experts} integers >= 0, one per expert")
        kept = (self.loads_WE + (row,))[-self.width:]
        return LoadWindow(num_experts=self.num_experts, width=self.width, loads_WE=kept)

    def mean(self) -> Tuple[float, ...]:
        """F: the mean load per expert over the iterations held (all 0.0 before the first push)."""
        if not self.loads_WE:
            return (0.0,) * self.num_experts
        return tuple(sum(col) / len(self.loads_WE) for col in zip(*self.loads_WE))


def global_load(load_E: torch.Tensor, group: Group, rec: Recorder) -> Tuple[int, ...]:
    """This rank's routes per expert (E integers) summed over ``group``: one all-reduce of E int64, recorded
    in the Recorder's ledger, then one host read. Collective: every member calls it with the same E."""
    if load_E.dim() != 1:
        raise ValueError(f"load_E must be 1-d (E,), got shape {tuple(load_E.shape)}")
    counts_E = load_E.detach().to(torch.int64).contiguous()
    if group.size > 1:
        counts_E = rec.issue("all_reduce", group, counts_E, "forward")
    return tuple(int(n) for n in counts_E.tolist())


# ---- 2. budget -------------------------------------------------------------------------------------------

def overlap_degree(non_moe_s: float, bandwidth_bytes_per_s: float, expert_bytes: int) -> int:
    """t = floor(T_non-MoE * bw / expert_bytes): how many experts' parameters a rank can receive while the
    non-MoE work before the layer runs (bw: the inter-node bandwidth where links differ, §4.2)."""
    problems = []
    if not (isinstance(non_moe_s, (int, float)) and math.isfinite(non_moe_s) and non_moe_s >= 0):
        problems.append(f"non_moe_s ({non_moe_s!r}) must be a finite number of seconds >= 0")
    if not (isinstance(bandwidth_bytes_per_s, (int, float)) and math.isfinite(bandwidth_bytes_per_s)
            and bandwidth_bytes_per_s > 0):
        problems.append(f"bandwidth_bytes_per_s ({bandwidth_bytes_per_s!r}) must be a finite number > 0")
    if not _positive_int(expert_bytes):
        problems.append(f"expert_bytes ({expert_bytes!r}) must be an integer >= 1")
    if problems:
        raise ValueError("invalid overlap degree inputs: " + "; ".join(problems))
    return int(math.floor(non_moe_s * bandwidth_bytes_per_s / expert_bytes))


def paying_experts(load_E: Sequence[float], row_bytes: int, expert_bytes: int, num_ranks: int) -> int:
    """How many experts save more bytes than a copy on every rank costs (this reproduction's addition to the
    overlap degree, used by the early gather: a copy worth making even where its gather is not hidden).

    Copied to all R ranks, an expert's routes from the R - 1 ranks that do not own it stay local: per step
    load_e (R - 1) / R rows each way in forward (dispatch and combine) and again in backward, 4 row_bytes each.
    The copies cost spAG plus spRS: 2 (R - 1) expert_bytes. So an expert pays when
    2 load_e row_bytes > R expert_bytes."""
    if not (_positive_int(row_bytes) and _positive_int(expert_bytes) and _positive_int(num_ranks)):
        raise ValueError(f"row_bytes ({row_bytes!r}), expert_bytes ({expert_bytes!r}) and num_ranks "
                         f"({num_ranks!r}) must be integers >= 1")
    if any(not (isinstance(n, (int, float)) and n >= 0) for n in load_E):
        raise ValueError(f"load_E ({list(load_E)}) must be numbers >= 0")
    return sum(1 for n in load_E if 2 * n * row_bytes > num_ranks * expert_bytes)


@dataclass(frozen=True)
class Budget:
    """Algorithm 1's line 1: ``t`` experts worth materialising (min(t, E)), ``m`` copies per rank
    (min(extra_experts, t))."""

    t: int
    m: int

    @property
    def everywhere(self) -> bool:
        """t <= m: the top-t experts are copied to every rank (Algorithm 1's first branch)."""
        return self.t <= self.m


def materialise_budget(overlap: int, extra_experts: int, num_experts: int) -> Budget:
    """t <- min(overlap, E), m <- min(extra_experts, t) (``extra_experts``: the memory budget, copies per rank)."""
    problems = [f"{name} ({value!r}) must be an integer >= {low}" for name, value, low in
                (("overlap", overlap, 0), ("extra_experts", extra_experts, 0), ("num_experts", num_experts, 1))
                if not (_int(value) and value >= low)]
    if problems:
        raise ValueError("invalid materialise budget: " + "; ".join(problems))
    t = min(overlap, num_experts)
    return Budget(t=t, m=min(extra_experts, t))


# ---- 3. placement ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Which ranks hold a full copy of each expert: ``copies_E[e]``, sorted (a plan's include the home rank; an
    expert nobody computes may have none); ``nodes_R``: each rank's node (as :attr:`Group.nodes`)."""

    copies_E: Tuple[Tuple[int, ...], ...]
    nodes_R: Tuple[int, ...]

    def __post_init__(self) -> None:
        ranks = len(self.nodes_R)
        for e, copies in enumerate(self.copies_E):
            if list(copies) != sorted(set(copies)) or not all(_int(r) and 0 <= r < ranks for r in copies):
                raise ValueError(f"copies_E[{e}] ({list(copies)}) must be distinct sorted ranks in [0, {ranks})")

    @property
    def num_ranks(self) -> int:
        return len(self.nodes_R)

    def experts_on(self, rank: int) -> Tuple[int, ...]:
        """The experts ``rank`` holds a copy of, in expert order (the rows of its spAG output)."""
        return tuple(e for e, copies in enumerate(self.copies_E) if rank in copies)


def rank_nodes(num_ranks: int, ranks_per_node: int) -> Tuple[int, ...]:
    """Each rank's node in a group of ``num_ranks`` consecutive ranks (the layout's node rule)."""
    layout = ParallelLayout(world=num_ranks, ranks_per_node=ranks_per_node)
    return tuple(layout.node_of(r) for r in range(num_ranks))


def stock_homes(num_experts: int, num_ranks: int) -> Tuple[int, ...]:
    """Expert parallelism's owners: expert e on rank e // (E / R) (experts of a rank contiguous)."""
    if not (_positive_int(num_experts) and _positive_int(num_ranks)) or num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts!r}) must be a positive multiple of num_ranks ({num_ranks!r})")
    return tuple(e // (num_experts // num_ranks) for e in range(num_experts))


def assign_slots(load_E: Sequence[float], slots: int, caps_E: Sequence[int]) -> Tuple[int, ...]:
    """Extra copies per expert for ``slots`` slots, by load: each slot goes to the expert whose routes per copy
    (load / (1 + extra)) are highest and that is below its cap (ties: the lower expert). Stops when the slots or
    the caps run out. Minimises the largest per-copy load among allocations within the caps."""
    if len(caps_E) != len(load_E) or any(c < 0 for c in caps_E) or any(f < 0 for f in load_E) or slots < 0:
        raise ValueError(f"assign_slots: load_E ({list(load_E)}) and caps_E ({list(caps_E)}) must be E numbers >= 0 "
                         f"each, slots ({slots}) >= 0")
    extra = [0] * len(load_E)
    for _ in range(slots):
        open_E = [e for e in range(len(load_E)) if extra[e] < caps_E[e]]
        if not open_E:
            break
        best = max(open_E, key=lambda e: (load_E[e] / (1 + extra[e]), -e))
        extra[best] += 1
    return tuple(extra)


def place_copies(copies: Sequence[int], count: int, free_R: Sequence[int],
                 nodes_R: Sequence[int]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Up to ``count`` new ranks for one expert held on ``copies``, node-first: each goes to a node holding
    the fewest copies of it (then the node with the most free slots, then the lower node), on that node's rank
    with the most free slots (then the lower rank). ``free_R``: slots left per rank. A copy with no rank left
    to hold it is not placed. Returns (the new ranks, sorted; the slots left per rank after them)."""
    if len(free_R) != len(nodes_R) or any(n < 0 for n in free_R) or count < 0:
        raise ValueError(f"place_copies: free_R ({list(free_R)}) must be {len(nodes_R)} counts >= 0 and count "
                         f"({count}) >= 0")
    held, added, free_R = set(copies), [], list(free_R)
    for _ in range(count):
        open_R = [r for r in range(len(nodes_R)) if r not in held and free_R[r] > 0]
        if not open_R:
            break
        per_node = {}
        for r in held:
            per_node[nodes_R[r]] = per_node.get(nodes_R[r], 0) + 1
        node_free = {}
        for r in open_R:
            node_free[nodes_R[r]] = node_free.get(nodes_R[r], 0) + free_R[r]
        node = min(node_free, key=lambda n: (per_node.get(n, 0), -node_free[n], n))
        rank = min((r for r in open_R if nodes_R[r] == node), key=lambda r: (-free_R[r], r))
        held.add(rank)
        added.append(rank)
        free_R[rank] -= 1
    return tuple(sorted(added)), tuple(free_R)


def top_experts(load_E: Sequence[float], t: int) -> Tuple[int, ...]:
    """The ``t`` experts with the highest load, highest first (ties: the lower expert)."""
    return tuple(sorted(range(len(load_E)), key=lambda e: (-load_E[e], e))[:t])


def plan_placement(load_E: Sequence[float], homes_E: Sequence[int], nodes_R: Sequence[int],
                   budget: Budget) -> Placement:
    """Algorithm 1: the home placement plus the copies of the top-t experts (see the module docstring)."""
    ranks = len(nodes_R)
    if len(homes_E) != len(load_E) or not all(_int(h) and 0 <= h < ranks for h in homes_E):
        raise ValueError(f"homes_E ({list(homes_E)}) must be one rank in [0, {ranks}) per expert "
                         f"({len(load_E)} loads)")
    copies_E = [{h} for h in homes_E]
    top = top_experts(load_E, budget.t)
    if budget.everywhere:
        for e in top:
            copies_E[e] = set(range(ranks))
    else:
        free_R: Tuple[int, ...] = (budget.m,) * ranks
        extra = assign_slots([load_E[e] for e in top], ranks * budget.m, [ranks - 1] * len(top))
        for e, n in zip(top, extra):
            added, free_R = place_copies(sorted(copies_E[e]), n, free_R, nodes_R)
            copies_E[e].update(added)
    return Placement(copies_E=tuple(tuple(sorted(c)) for c in copies_E), nodes_R=tuple(nodes_R))


# ---- 4. dispatch -----------------------------------------------------------------------------------------

def split_routes(routes: int, source: int, copies: Sequence[int],
                 nodes_R: Sequence[int]) -> Tuple[Tuple[int, int], ...]:
    """(rank, routes) for each copy that gets some of ``routes`` routes from ``source`` to one expert held on
    ``copies``: all to ``source``'s own copy; else evenly over the copies on its node; else evenly over all.
    ``routes % n`` copies get one more, starting at copy ``source % n`` (so sources spread the remainders)."""
    if routes < 0 or (routes and not copies):
        raise ValueError(f"routes ({routes}) must be >= 0, and copies ({list(copies)}) not empty when routes > 0")
    if not routes:
        return ()
    if source in copies:
        chosen = [source]
    else:
        chosen = [r for r in copies if nodes_R[r] == nodes_R[source]] or list(copies)
    n = len(chosen)
    base, rest = divmod(routes, n)
    shares = [base + (1 if (i - source) % n < rest else 0) for i in range(n)]
    return tuple((r, k) for r, k in zip(chosen, shares) if k)


def dispatch_counts(routes_E: Sequence[int], source: int, placement: Placement) -> Tuple[Tuple[int, ...], ...]:
    """send_ER[e][r]: of ``source``'s routes per expert, how many go to expert e's copy on rank r."""
    if len(routes_E) != len(placement.copies_E):
        raise ValueError(f"routes_E has {len(routes_E)} experts, the placement {len(placement.copies_E)}")
    out = []
    for routes, copies in zip(routes_E, placement.copies_E):
        row = [0] * placement.num_ranks
        for r, k in split_routes(int(routes), source, copies, placement.nodes_R):
            row[r] = k
        out.append(tuple(row))
    return tuple(out)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value) -> bool:
    return _int(value) and value >= 1


def _counts_ok(row: Sequence[int], num: int) -> bool:
    return len(row) == num and all(_int(n) and n >= 0 for n in row)
