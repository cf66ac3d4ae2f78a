"""Inter-node bytes of one forward+backward, three ways:

- :class:`LedgerMeter`: the project's own layers record every collective in a ``CommLedger``
  (``inter_node_bytes``: what this rank sends to group members on other nodes, direct algorithm);
- :class:`CollectiveCounter`: the stock layers have no ledger, so their calls into torch.distributed are
  counted with the same convention. It wraps, only while active, the collectives those layers reach:
  ``torch.distributed.{all_to_all_single, all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
  all_gather, reduce_scatter}``, plus the aliases bound at import time by Megatron
  (``tensor_parallel.mappings.dist_all_gather_func`` / ``dist_reduce_scatter_func``) and by DeepSpeed's
  comm backend (``cdb.all_gather_function`` / ``reduce_scatter_function``). Originals are restored in
  ``finally``. It also times each ``all_to_all_single`` call (``a2a_intervals``: the stock layers' exchanges block
  the thread that computes, so their whole time is exposed; :mod:`.lancet_exposure`);
- :func:`nic_tx_bytes`: what actually left this node's NIC (headers, acks and gloo's own algorithms
  included), read from ``/sys/class/net/<nic>/statistics/tx_bytes`` inside the node's namespace.

The link lower bound uses the first two (the model's bytes); the third is reported beside it as a check.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.core.ledger import CommLedger


class LedgerMeter:
    """Inter-node bytes from a layer's ledger; recording is on only between start() and stop()."""

    source = "ledger"

    def __init__(self, ledger: CommLedger):
        self.ledger = ledger
        ledger.enabled = False

    def start(self) -> None:
        self.ledger.clear()
        self.ledger.enabled = True

    def stop(self) -> int:
        self.ledger.enabled = False
        return self.ledger.total_inter_node_bytes()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class CollectiveCounter:
    """Counts this rank's inter-node bytes of torch.distributed collectives, with the ledger's convention."""

    layout: ParallelLayout
    rank: int
    inter_node_bytes: int = 0
    calls: int = 0
    a2a_intervals: List[Tuple[int, int]] = field(default_factory=list)   # perf_counter_ns of each all_to_all_single
    _patcher: Optional[Patcher] = None

    source = "counter"

    # -- per-op rules (the ledger's: each peer's share once; all-reduce = reduce-scatter + all-gather) ----

    def _peers(self, group: Optional[dist.ProcessGroup]) -> Tuple[List[int], List[bool]]:
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        node = self.layout.node_of(self.rank)
        return ranks, [self.layout.node_of(r) != node for r in ranks]

    def _add(self, nbytes: float) -> None:
        self.inter_node_bytes += int(round(nbytes))
        self.calls += 1

    def _all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        ranks, remote = self._peers(group)
        rows = input.shape[0] if input.dim() else 1
        per_row = _nbytes(input) / max(rows, 1)
        splits = list(input_split_sizes) if input_split_sizes is not None else [rows / len(ranks)] * len(ranks)
        self._add(sum(s * per_row for s, far in zip(splits, remote) if far))

    def _all_reduce(self, tensor, op=None, group=None, **kw):
        ranks, remote = self._peers(group)
        self._add(2 * sum(remote) * _nbytes(tensor) / len(ranks))

    def _all_gather_into_tensor(self, output_tensor, input_tensor, group=None, **kw):
        _, remote = self._peers(group)
        self._add(sum(remote) * _nbytes(input_tensor))

    def _reduce_scatter_tensor(self, output, input, op=None, group=None, **kw):
        ranks, remote = self._peers(group)
        self._add(sum(remote) * _nbytes(input) / len(ranks))

    def _all_gather(self, tensor_list, tensor, group=None, **kw):
        _, remote = self._peers(group)
        self._add(sum(remote) * _nbytes(tensor))

    def _reduce_scatter(self, output, input_list, op=None, group=None, **kw):
        _, remote = self._peers(group)
        self._add(sum(_nbytes(t) for t, far in zip(input_list, remote) if far))

    # -- patching ---------------------------------------------------------------------------------------

    def _wrap(self, original: Callable, rule: Callable) -> Callable:
        if rule == self._all_to_all_single:
            def timed(*args, **kwargs):
                rule(*args, **kwargs)
                start = time.perf_counter_ns()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.a2a_intervals.append((start, time.perf_counter_ns()))
            return timed

        def counted(*args, **kwargs):
            rule(*args, **kwargs)
            return original(*args, **kwargs)
        return counted

    def _targets(self) -> List[Tuple[Any, str, Callable]]:
        targets = [(dist, name, getattr(self, "_" + name)) for name in
                   ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                    "all_gather", "reduce_scatter")]
        mappings = sys.modules.get("megatron.core.tensor_parallel.mappings")
        if mappings is not None:
            targets += [(mappings, "dist_all_gather_func", self._all_gather_into_tensor),
                        (mappings, "dist_reduce_scatter_func", self._reduce_scatter_tensor)]
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        cdb = getattr(ds_comm, "cdb", None) if ds_comm is not None else None
        if cdb is not None:
            for name, rule in (("all_gather_function", self._all_gather_into_tensor),
                               ("reduce_scatter_function", self._reduce_scatter_tensor)):
                if getattr(cdb, name, None) is not None:
                    targets.append((cdb, name, rule))
        return targets

    def start(self) -> None:
        self.inter_node_bytes, self.calls = 0, 0
        self.a2a_intervals = []
        if self._patcher is not None:
            raise RuntimeError("CollectiveCounter is already active")
        self._patcher = Patcher([Patch(obj, name, self._wrap(getattr(obj, name), rule))
                                 for obj, name, rule in self._targets()]).apply()

    def _restore(self) -> None:
        patcher, self._patcher = self._patcher, None
        if patcher is not None:
            patcher.restore()

    def stop(self) -> int:
        self._restore()
        return self.inter_node_bytes


def nic_tx_bytes(ifname: Optional[str]) -> Optional[int]:
    """Bytes this namespace's NIC has sent so far; None without an emulated cluster."""
    if not ifname:
        return None
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def node_egress(per_rank: Sequence[int], layout: ParallelLayout) -> List[int]:
    """Sum each node's ranks' inter-node bytes (what leaves the node's NIC in the model)."""
    out = [0] * layout.num_nodes
    for rank, b in enumerate(per_rank):
        out[layout.node_of(rank)] += int(b)
    return out
