"""Pool jobs for the bench tests (run on the gloo ranks of the ``world`` fixture)."""

from __future__ import annotations

from moe_plugins.tools.bench.runner import RankJob, run_plan


def run_bench_plan(job: RankJob):
    """The rank side of ``moe-plugins bench`` on loopback; rank 0 returns the raw records."""
    return run_plan(job)
