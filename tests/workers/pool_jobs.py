"""Pool jobs for tests/test_reliability.py's checks of the test pool itself (moe_plugins/tools/pool.py)."""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist


def unsendable() -> Dict[str, object]:
    """A result pickle refuses: a lock (before the pool sent plain pickle bytes, torch's non-leaf tensor that
    requires grad was one; it now goes by value, as a leaf)."""
    import threading
    return {"x": torch.ones(2), "lock": threading.Lock()}


def tensors(n: int) -> Dict[int, torch.Tensor]:
    return {i: torch.full((64,), float(dist.get_rank() * 1000 + i)) for i in range(n)}


def open_fds() -> int:
    import os
    return len(os.listdir("/proc/self/fd"))


def rank() -> int:
    return dist.get_rank()


def dies_on_rank_1() -> int:
    """Rank 1's process ends at once, without a word to the pool (as a segmentation fault or the OOM killer would
    end it); rank 0 then waits in a collective with it."""
    import os
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()
    return 0
