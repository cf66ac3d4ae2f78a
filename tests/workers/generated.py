"""Pool job for tests/test_generated.py: many generated verify specs in one job (process start-up is the
expensive part, so one job runs a whole batch)."""

from __future__ import annotations

import traceback
from typing import Any, Dict, List

import torch.distributed as dist

from moe_plugins.tools.verify import VerifySpec, run_rank


def verify_batch(specs: List[VerifySpec]) -> List[Dict[str, Any]]:
    """Verify ``specs`` in order. Per spec run: {"report": compare's report} (None off rank 0), or
    {"error": the traceback, "rank": this rank} for a spec that raised. The batch stops at the first error: this rank's
    collectives may then be out of step with the others', so the caller restarts the pool and re-submits
    the specs after the shortest rank's list."""
    outcomes: List[Dict[str, Any]] = []
    for spec in specs:
        try:
            outcomes.append({"report": run_rank(spec)})
        except Exception:  # reported per spec, with the spec's reproduce command, by the test
            outcomes.append({"error": traceback.format_exc(), "rank": dist.get_rank()})
            break
    return outcomes
