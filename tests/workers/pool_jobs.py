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
