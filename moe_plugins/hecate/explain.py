"""What Hecate's plan does for one layer under one load, in plain numbers (``moe-plugins plan hecate``): which
experts Algorithm 1 copies where and why, and what that does to the bytes on the wire per training step, against
expert parallelism on the same homes. Pure: host integers in, a dict out.

Assumptions, stated in the output: only the global load is given, so each source rank is taken to send an even
share of every expert's routes (:func:`source_routes`); a step moves the dispatch's rows four times (dispatch and
combine, forward and backward); the copies cost one spAG and one spRS of whole experts (``whole_shards``: the
layer's owners hold their experts whole, as the runtime does).

Letters: E experts, R ranks of the FSSDP (EP) group, M model dim, H FFN hidden dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from moe_plugins.hecate.flow import expert_numel
from moe_plugins.hecate.plan import (Placement, dispatch_counts, materialise_budget, paying_experts, plan_placement,
                                     stock_homes, top_experts)
from moe_plugins.hecate.sparse import eq2_bytes, sparse_bytes, whole_shards

EXCHANGES_PER_STEP = 4          # dispatch and combine, forward and backward: each moves the dispatch's rows


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer's sizes: E experts of an FFN M -> H -> M with biases, ``element_bytes`` per value."""

    experts: int
    hidden: int
    ffn: int
    element_bytes: int = 4

    @property
    def expert_bytes(self) -> int:
        return expert_numel(self.hidden, self.ffn) * self.element_bytes

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.element_bytes


def source_routes(load_E: Sequence[int], ranks: int) -> Tuple[Tuple[int, ...], ...]:
    """counts_RE: each source rank's routes per expert, the global load split evenly (the first ``load % R``
    ranks one more)."""
    return tuple(tuple(n // ranks + (1 if r < n % ranks else 0) for n in load_E) for r in range(ranks))


def token_traffic(counts_RE: Sequence[Sequence[int]], placement: Placement, row_bytes: int) -> Dict[str, Any]:
    """The dispatch's rows between ranks under ``placement`` (each source's routes split over the copies,
    local first, then same node, then remote), as bytes per step (x :data:`EXCHANGES_PER_STEP`): sent per
    rank, sent to other nodes, and received per node from other nodes (the busiest node's link)."""
    ranks, nodes = placement.num_ranks, placement.nodes_R
    sent_R, remote_R = [0] * ranks, [0] * ranks
    inbound: Dict[int, int] = {n: 0 for n in nodes}
    for s in range(ranks):
        for row in dispatch_counts(counts_RE[s], s, placement):
            for r, n in enumerate(row):
                if r != s:
                    sent_R[s] += n
                    if nodes[r] != nodes[s]:
                        remote_R[s] += n
                        inbound[nodes[r]] += n
    scale = EXCHANGES_PER_STEP * row_bytes
    return {"sent_bytes_R": [n * scale for n in sent_R], "inter_node_bytes_R": [n * scale for n in remote_R],
            "node_inbound_bytes": {str(n): v * scale for n, v in sorted(inbound.items())},
            "busiest_node_inbound_bytes": max(inbound.values()) * scale}


def _why(e: int, copies: int, top: Sequence[int], budget: Any, pays: bool) -> str:
    if copies > 1:
        how = "on every rank (t <= m)" if budget.everywhere else "node-first, by routes per copy"
        cost = "" if pays else "; in bytes alone its copies cost more than they save"
        return f"copied {copies - 1}x: among the top t = {budget.t} by load, {how}{cost}"
    if e in top and budget.m == 0:
        return f"among the top t = {budget.t}, but m = 0: no rank has a slot for a copy"
    if e in top:
        return f"among the top t = {budget.t}, but the m = {budget.m} slots per rank went to hotter experts"
    return f"home only: not among the top t = {budget.t} by load" + ("" if pays else "; its copies would not pay")


def explain(load_E: Sequence[int], nodes_R: Sequence[int], shape: LayerShape, extra_experts: Any = "auto",
            overlap: Optional[int] = None, homes_E: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Algorithm 1 for ``load_E`` (routes per expert over the group) on ranks ``nodes_R`` (each rank's node):
    the budget, each expert's copies and why, and the step's bytes against expert parallelism's. ``overlap``:
    Algorithm 1's t (None: E, as the layer plans without ``prefetch``); ``extra_experts``: the memory budget m
    ("auto": E / R); ``homes_E``: the owners (None: expert parallelism's)."""
    experts, ranks = len(load_E), len(nodes_R)
    homes = tuple(stock_homes(experts, ranks) if homes_E is None else homes_E)
    m = experts // ranks if extra_experts == "auto" else int(extra_experts)
    budget = materialise_budget(experts if overlap is None else overlap, m, experts)
    placement = plan_placement(load_E, homes, nodes_R, budget)
    ep = Placement(copies_E=tuple((h,) for h in homes), nodes_R=tuple(nodes_R))
    counts = source_routes(load_E, ranks)
    before, after = token_traffic(counts, ep, shape.row_bytes), token_traffic(counts, placement, shape.row_bytes)
    shards = whole_shards(expert_numel(shape.hidden, shape.ffn), homes, ranks)
    sparse = [sparse_bytes(placement, shards, r, shape.element_bytes) for r in range(ranks)]
    # spAG sends what each rank sends; spRS sends back what it received: both directions per step
    copy_bytes_R = [b.sent + b.received for b in sparse]
    copy_inbound: Dict[str, int] = {str(n): 0 for n in sorted(set(nodes_R))}
    for r, b in enumerate(sparse):
        copy_inbound[str(nodes_R[r])] += b.received_inter_node + b.sent_inter_node     # spAG in, spRS in
    top = top_experts(load_E, budget.t)
    total = sum(load_E) or 1
    rows: List[Dict[str, Any]] = []
    for e, copies in enumerate(placement.copies_E):
        pays = 2 * load_E[e] * shape.row_bytes > ranks * shape.expert_bytes
        rows.append({"expert": e, "routes": int(load_E[e]), "share": load_E[e] / total, "home": homes[e],
                     "copies": list(copies), "pays": pays, "why": _why(e, len(copies), top, budget, pays)})
    busiest_after = max(int(after["node_inbound_bytes"][n]) + copy_inbound[n] for n in copy_inbound)
    return {
        "ranks": ranks, "nodes_R": list(nodes_R), "experts": experts,
        "expert_bytes": shape.expert_bytes, "row_bytes": shape.row_bytes,
        "budget": {"t": budget.t, "m": budget.m, "everywhere": budget.everywhere},
        "paying_experts": paying_experts(load_E, shape.row_bytes, shape.expert_bytes, ranks),
        "per_expert": rows,
        "extra_copies": sum(len(c) - 1 for c in placement.copies_E),
        "expert_parallelism": {"token_bytes_per_step": sum(before["sent_bytes_R"]),
                               "inter_node_bytes_per_step": sum(before["inter_node_bytes_R"]),
                               "busiest_node_inbound_bytes": before["busiest_node_inbound_bytes"],
                               "node_inbound_bytes": before["node_inbound_bytes"]},
        "hecate": {"token_bytes_per_step": sum(after["sent_bytes_R"]),
                   "inter_node_bytes_per_step": sum(after["inter_node_bytes_R"]),
                   "copy_bytes_per_step": sum(b.sent for b in sparse) * 2,
                   "copy_inter_node_bytes_per_step": sum(b.sent_inter_node for b in sparse) * 2,
                   "copy_bytes_R": copy_bytes_R,
                   "eq2_bytes": eq2_bytes([len(c) for c in placement.copies_E], shape.expert_bytes),
                   "busiest_node_inbound_bytes": busiest_after,
                   "node_inbound_bytes": {n: int(after["node_inbound_bytes"][n]) + copy_inbound[n]
                                          for n in copy_inbound}},
        "assumptions": ["each source rank sends an even share of every expert's routes (only the global load is "
                        "given)", f"a step moves the dispatch's rows {EXCHANGES_PER_STEP} times (dispatch and "
                        "combine, forward and backward)", "copies cost one spAG and one spRS of whole experts"],
    }
