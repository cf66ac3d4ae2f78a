"""Checks shared by Lina's tests: the order of micro-ops against the MoE exchanges, from an engine's timeline
(records as dicts: priority, op, layer, issue_ns, start_ns, end_ns)."""


def micro_op_order(records):
    """No micro-op starts inside an MoE exchange's [issue, end]; at most one overlaps each all-to-all. Returns
    how many micro-ops waited for an exchange."""
    urgent = [r for r in records if r["priority"] == "urgent"]
    micro = [r for r in records if r["priority"] == "background"]
    waited = 0
    for b in micro:
        inside = [u["layer"] for u in urgent if u["issue_ns"] <= b["start_ns"] <= u["end_ns"]]
        assert not inside, f"micro-op started while exchange(s) of {inside} were pending or in flight"
        waited += any(b["issue_ns"] < u["end_ns"] <= b["start_ns"] for u in urgent)
    for u in (r for r in urgent if r["op"] == "all_to_all"):
        overlapping = [b for b in micro if b["start_ns"] < u["end_ns"] and b["end_ns"] > u["start_ns"]]
        assert len(overlapping) <= 1, f"{len(overlapping)} micro-ops overlap an all-to-all of {u['layer']}"
    return waited
