"""Pool jobs for the core tests."""

from __future__ import annotations

from typing import List

from moe_plugins.tools.verify import VerifySpec, collect_rank, run_rank


def verify_many(specs: List[VerifySpec]):
    """Run several verify specs in one job; rank 0 returns their reports."""
    return [run_rank(spec) for spec in specs]


def collect(spec: VerifySpec):
    return collect_rank(spec)
