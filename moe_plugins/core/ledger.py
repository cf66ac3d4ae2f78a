"""Communication ledger: one record per collective the MoE core issues.

Volume convention (the paper's, §IV): ``numel`` is the x in AG(x), A2A(x), AR(x), RS(x):
the gathered (output) size for an all-gather, the input size for the others.
``inter_node_bytes`` counts what this rank sends to members of the group on other nodes under
the direct algorithm (each peer's share sent once; all-reduce as reduce-scatter + all-gather).

Records made by the communication engine (:mod:`moe_plugins.core.engine`) also carry its priority class, the
lane it ran on, the recording rank and three ``time.perf_counter_ns()`` stamps of that rank's clock: issued,
started, ended (:mod:`moe_plugins.core.timeline` writes them as a Chrome trace).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List


@dataclass(frozen=True)
class CommRecord:
    layer: str
    op: str            # all_gather | all_to_all | all_reduce | reduce_scatter | all_reduce_max
    group: str         # mp | ep | esp | ep_esp | ...
    group_ranks: tuple
    numel: int
    bytes: int
    inter_node_bytes: int
    phase: str         # forward | backward
    priority: str = "urgent"   # urgent | background (the engine's class)
    lane: str = "main"         # main (the issuing thread) | pipeline | background
    rank: int = -1             # global rank that ran it (-1: unknown)
    issue_ns: int = 0          # perf_counter_ns() at issue, start and end, this rank's clock (0: not timed)
    start_ns: int = 0
    end_ns: int = 0


@dataclass
class CommLedger:
    """Append-only list of records; one ledger is passed explicitly to the layers that should record."""

    records: List[CommRecord] = field(default_factory=list)
    enabled: bool = True

    def add(self, record: CommRecord) -> None:
        if self.enabled:
            self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    def for_layer(self, layer: str) -> List[CommRecord]:
        return [r for r in self.records if r.layer == layer]

    def summary(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        """Per layer, per ``phase:op@group``: count, total elements, bytes and inter-node bytes."""
        out: Dict[str, Dict[str, Dict[str, int]]] = {}
        for r in self.records:
            key = f"{r.phase}:{r.op}@{r.group}"
            row = out.setdefault(r.layer, {}).setdefault(key, {"count": 0, "numel": 0, "bytes": 0,
                                                               "inter_node_bytes": 0})
            row["count"] += 1
            row["numel"] += r.numel
            row["bytes"] += r.bytes
            row["inter_node_bytes"] += r.inter_node_bytes
        return out

    def total_inter_node_bytes(self) -> int:
        return sum(r.inter_node_bytes for r in self.records)

    def to_json(self) -> str:
        return json.dumps({"records": [asdict(r) for r in self.records], "summary": self.summary()})
