"""Shared fixtures. ``world`` gives a reused pool of gloo ranks: ``world(4).run(fn, *args)`` runs the
module-level function ``fn`` on 4 ranks and returns the per-rank results in rank order."""

from __future__ import annotations

import pytest

from moe_plugins.pool import WorkerPool


@pytest.fixture(scope="session")
def world():
    pools = {}

    def get(size: int) -> WorkerPool:
        if size not in pools:
            pools[size] = WorkerPool(size)
        return pools[size]

    yield get
    for pool in pools.values():
        pool.close()
