"""Shared fixtures. ``world`` gives a reused pool of gloo ranks: ``world(4).run(fn, *args)`` runs the
module-level function ``fn`` on 4 ranks and returns the per-rank results in rank order.

The pool lives for one test module: hosts create process groups they never destroy (DeepSpeed makes new ones
for every engine), and each gloo group keeps threads, so fresh workers per module keep the suite fast."""

from __future__ import annotations

import pytest

from moe_plugins.tools.pool import WorkerPool


@pytest.fixture(scope="module")
def world():
    pools = {}

    def get(size: int) -> WorkerPool:
        if size not in pools:
            pools[size] = WorkerPool(size)
        return pools[size]

    yield get
    for pool in pools.values():
        pool.close()
