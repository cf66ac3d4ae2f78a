"""The engine's timed records of every rank as a Chrome trace (JSON object format), which opens in Perfetto
(ui.perfetto.dev) and chrome://tracing: one process per rank, one thread per lane (main, pipeline,
background), one complete event ("ph": "X") per op, from its start to its end.

Times are ``time.perf_counter_ns()`` of each rank: one clock for the ranks of one machine (CLOCK_MONOTONIC on
Linux); ranks on other machines are only comparable within themselves. ``ts`` counts from the earliest
start of the trace, in microseconds.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Sequence, Union

from moe_plugins.core.ledger import CommRecord

LANE_TIDS = {"main": 0, "pipeline": 1, "background": 2}


def chrome_trace(records_by_rank: Sequence[Sequence[Union[CommRecord, Dict[str, Any]]]]) -> Dict[str, Any]:
    """``{"traceEvents": [...]}`` from each rank's records (index = rank; dicts as ``asdict`` gives them).
    Records without time stamps (``start_ns`` 0) are left out."""
    rows = [[r if isinstance(r, dict) else asdict(r) for r in records] for records in records_by_rank]
    timed = [r for records in rows for r in records if r.get("start_ns")]
    t0 = min((r["start_ns"] for r in timed), default=0)
    events: List[Dict[str, Any]] = []
    for rank, records in enumerate(rows):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for lane in sorted({r.get("lane", "main") for r in records}, key=lambda name: LANE_TIDS.get(name, 9)):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": LANE_TIDS.get(lane, 9),
                           "args": {"name": lane}})
        for r in records:
            if not r.get("start_ns"):
                continue
            events.append({
                "name": f"{r['op']}@{r['group']}", "cat": r.get("priority", "urgent"), "ph": "X",
                "ts": (r["start_ns"] - t0) / 1e3, "dur": max(r["end_ns"] - r["start_ns"], 0) / 1e3,
                "pid": rank, "tid": LANE_TIDS.get(r.get("lane", "main"), 9),
                "args": {"group": r["group"], "group_ranks": list(r["group_ranks"]), "phase": r["phase"],
                         "bytes": r["bytes"], "inter_node_bytes": r["inter_node_bytes"], "layer": r["layer"],
                         "priority": r.get("priority", "urgent"),
                         "queued_us": max(r["start_ns"] - r.get("issue_ns", r["start_ns"]), 0) / 1e3}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: Union[str, Path], records_by_rank: Sequence[Sequence[Any]]) -> Path:
    """Write :func:`chrome_trace` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(records_by_rank)))
    return path
