"""Hecate's heterogeneous sharding (hecate.txt §4.3, Algorithm 2) and the move it implies: pure functions of host
integers.

Sparse materialisation (:mod:`moe_plugins.hecate.plan`) copies the hot experts; the homes of the others still
decide where their tokens go. When the experts that no copy serves crowd one node, its inbound link carries all
their tokens. Algorithm 2 re-homes the experts every few iterations:

1. **Overlappable** experts J (per layer: the ones sparse materialisation copies, given by the caller) and the
   rest J'.
2. The layers are taken by the highest load in their J', highest first; each layer's J' experts by load,
   highest first. Each goes to the **least-loaded node**, then to the **least-loaded device** on it (ties: the
   node, then the device, with fewer free slots; then this reproduction's ties: the expert's current home, the
   lower index).
3. J fills the slots left ("arbitrarily" in the paper): each to its current home while that has a free slot,
   then to the lowest rank with one. Copies serve J's tokens, so where J lives matters little; staying moves
   nothing.
4. This reproduction's guard: a layer keeps its current homes unless the plan lowers (the busiest node's, then
   the busiest rank's) routes to J' (:func:`node_inbound`). Algorithm 2 alone re-deals a balanced layer's
   experts over the nodes, and every moved expert costs its bytes and its optimizer state on the wire.

**Slots.** The paper pools all layers' slots: S = |E^g| / |D| per device, so a device may hold more experts of
one layer and fewer of another (``pooled=True``). A host that keeps each layer's experts in that layer's own
modules (DeepSpeed's ``deepspeed_experts``: E / R per rank, one module each) can only permute a layer's
experts among its ranks: ``pooled=False`` gives every device E_l / R slots per layer, the runtime's setting
(:mod:`moe_plugins.hecate.rehome`). Loads are per layer in both: node and device loads count the layer being
placed (its exchange runs on its own).

**Move.** :func:`local_experts` is a rank's experts in its storage order (ascending id); :func:`move_counts` what
each rank sends to each other for a change of homes: whole experts, one uneven all-to-all.

Letters: L layers, E experts of a layer, R ranks (devices) of the FSSDP group.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

Homes = Tuple[int, ...]


def shard_plan(loads_LE: Sequence[Sequence[float]], overlappable_L: Sequence[Sequence[int]],
               nodes_R: Sequence[int], homes_LE: Optional[Sequence[Sequence[int]]] = None,
               pooled: bool = False) -> Tuple[Homes, ...]:
    """Algorithm 2: each layer's new home per expert (module docstring). ``homes_LE``: the current homes (ties
    keep them; default: expert parallelism's, expert e on rank e // (E / R))."""
    ranks = len(nodes_R)
    problems = _plan_problems(loads_LE, overlappable_L, ranks, pooled)
    if homes_LE is None:
        homes_LE = [tuple(e * ranks // len(load_E) for e in range(len(load_E))) for load_E in loads_LE]
    elif len(homes_LE) != len(loads_LE) or any(len(h) != len(l) or any(not 0 <= r < ranks for r in h)
                                                for h, l in zip(homes_LE, loads_LE)):
        problems.append(f"homes_LE must give each layer's experts a rank in [0, {ranks})")
    if problems:
        raise ValueError("invalid sharding inputs: " + "; ".join(problems))
    free_LR = _slots(loads_LE, ranks, pooled)
    new: List[Dict[int, int]] = [{} for _ in loads_LE]
    rest_L = [[e for e in range(len(load_E)) if e not in set(overlappable_L[l])] for l, load_E in enumerate(loads_LE)]
    layers = sorted(range(len(loads_LE)), key=lambda l: (-max((loads_LE[l][e] for e in rest_L[l]), default=0.0), l))
    for l in layers:                                   # the underloaded experts, placed by load
        load_E, free_R = loads_LE[l], free_LR[l]
        load_R = [0.0] * ranks
        for e in sorted(rest_L[l], key=lambda e: (-load_E[e], e)):
            rank = _least_loaded(load_R, free_R, nodes_R, homes_LE[l][e])
            new[l][e], load_R[rank], free_R[rank] = rank, load_R[rank] + load_E[e], free_R[rank] - 1
    for l in sorted(range(len(loads_LE))):             # the overlappable experts: stay where a slot is left
        free_R = free_LR[l]
        for e in sorted(overlappable_L[l]):
            home = homes_LE[l][e]
            rank = home if free_R[home] > 0 else min(r for r in range(ranks) if free_R[r] > 0)
            new[l][e], free_R[rank] = rank, free_R[rank] - 1
    planned = [tuple(placed[e] for e in range(len(load_E))) for placed, load_E in zip(new, loads_LE)]
    gains = [_busiest(p, l, j, nodes_R) < _busiest(h, l, j, nodes_R)
             for p, h, l, j in zip(planned, homes_LE, loads_LE, overlappable_L)]
    if pooled:        # the layers share slots: keep every layer's homes unless one gains
        return tuple(planned) if any(gains) else tuple(tuple(h) for h in homes_LE)
    return tuple(p if gain else tuple(h) for p, h, gain in zip(planned, homes_LE, gains))


def _busiest(homes_E, load_E, overlappable, nodes_R) -> Tuple[float, float]:
    """(the busiest node's, the busiest rank's) routes to the experts no copy serves under ``homes_E``."""
    node = node_inbound(homes_E, load_E, nodes_R, overlappable)
    rank = node_inbound(homes_E, load_E, tuple(range(len(nodes_R))), overlappable)
    return max(node.values()), max(rank.values())


def _plan_problems(loads_LE, overlappable_L, ranks: int, pooled: bool) -> List[str]:
    problems = []
    if ranks < 1:
        problems.append("nodes_R must name at least one rank")
    if len(overlappable_L) != len(loads_LE):
        problems.append(f"overlappable_L has {len(overlappable_L)} layers, loads_LE {len(loads_LE)}")
    for l, load_E in enumerate(loads_LE):
        if not load_E or any(not isinstance(n, (int, float)) or n < 0 for n in load_E):
            problems.append(f"loads_LE[{l}] ({list(load_E)}) must be one load >= 0 per expert")
        elif ranks >= 1 and not pooled and len(load_E) % ranks:
            problems.append(f"layer {l}'s {len(load_E)} experts must be a multiple of the {ranks} ranks (one "
                            "layer's slots per rank)")
        if l < len(overlappable_L) and any(not 0 <= e < len(load_E) for e in overlappable_L[l]):
            problems.append(f"overlappable_L[{l}] ({list(overlappable_L[l])}) must be experts in [0, {len(load_E)})")
    if pooled and ranks >= 1 and sum(len(load_E) for load_E in loads_LE) % ranks:
        problems.append(f"all layers' {sum(len(l) for l in loads_LE)} experts must be a multiple of the {ranks} ranks")
    return problems


def _slots(loads_LE, ranks: int, pooled: bool) -> List[List[int]]:
    """Free slots per layer and rank: one list per layer (pooled: the same list object, shared by all)."""
    if pooled:
        shared = [sum(len(load_E) for load_E in loads_LE) // ranks] * ranks
        return [shared for _ in loads_LE]
    return [[len(load_E) // ranks] * ranks for load_E in loads_LE]


def _least_loaded(load_R: Sequence[float], free_R: Sequence[int], nodes_R: Sequence[int], home: int) -> int:
    """Algorithm 2's lines 12-13: the least-loaded node with a free slot, then its least-loaded rank with one
    (ties: fewer free slots, then the current home, then the lower index)."""
    open_R = [r for r in range(len(free_R)) if free_R[r] > 0]
    if not open_R:
        raise ValueError("no free slot left for an expert: the slots per rank do not hold every expert")
    node_load: Dict[int, float] = {}
    node_free: Dict[int, int] = {}
    for r in range(len(free_R)):
        node_load[nodes_R[r]] = node_load.get(nodes_R[r], 0.0) + load_R[r]
        node_free[nodes_R[r]] = node_free.get(nodes_R[r], 0) + free_R[r]
    node = min({nodes_R[r] for r in open_R}, key=lambda n: (node_load[n], node_free[n], n != nodes_R[home], n))
    return min((r for r in open_R if nodes_R[r] == node), key=lambda r: (load_R[r], free_R[r], r != home, r))


def local_experts(homes_E: Sequence[int], rank: int) -> Tuple[int, ...]:
    """The experts homed on ``rank``, in its storage order (ascending id: local slot i holds the i-th)."""
    return tuple(e for e, home in enumerate(homes_E) if home == rank)


def move_counts(old_E: Sequence[int], new_E: Sequence[int], rank: int, ranks: int) -> Tuple[Tuple[int, ...], ...]:
    """``sends[s]``: the experts ``rank`` sends to member s when homes go from ``old_E`` to ``new_E`` (ascending;
    none to itself: an expert that stays is copied locally). The rows of one uneven all-to-all."""
    if len(old_E) != len(new_E):
        raise ValueError(f"old_E has {len(old_E)} experts, new_E {len(new_E)}")
    return tuple(tuple(e for e in range(len(old_E)) if old_E[e] == rank and new_E[e] == s and s != rank)
                 for s in range(ranks))


def node_inbound(homes_E: Sequence[int], load_E: Sequence[float], nodes_R: Sequence[int],
                 served_E: Sequence[int] = ()) -> Dict[int, float]:
    """Routes each node's homes receive from the experts no copy serves (all but ``served_E``): what the
    busiest node's link carries under expert parallelism for those experts (reports, tests)."""
    out: Dict[int, float] = {n: 0.0 for n in nodes_R}
    served = set(served_E)
    for e, home in enumerate(homes_E):
        if e not in served:
            out[nodes_R[home]] += load_E[e]
    return out
