"""Collective helpers of the bench ranks (one gloo group): a value's maximum over the ranks, and how long a piece
of work took on the slowest rank. Every rank calls them at the same point (collective)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist


def max_over_ranks(value: float) -> float:
    """The largest ``value`` of all ranks (an all-reduce of one float64)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def slowest_seconds(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took on the slowest rank, timed from a barrier."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return max_over_ranks(time.perf_counter() - t0)
