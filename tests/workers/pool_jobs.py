"""Pool jobs for tests/test_reliability.py's checks of the test pool itself (moe_plugins/tools/pool.py)."""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist


def unsendable() -> Dict[str, torch.Tensor]:
    """A result torch refuses to send between processes: a non-leaf tensor that requires grad."""
    w = torch.ones(2, requires_grad=True)
    return {"x": w * 2}


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
