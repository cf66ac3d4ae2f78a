"""Shared fixtures. ``world`` gives a reused pool of gloo ranks: ``world(4).run(fn, *args)`` runs the
module-level function ``fn`` on 4 ranks and returns the per-rank results in rank order.

The pool lives for one test module: hosts create process groups they never destroy (DeepSpeed makes new ones
for every engine), and each gloo group keeps threads, so fresh workers per module keep the suite fast. They are
forked from a server that imported the heavy packages once (PRELOAD), not spawned afresh."""

from __future__ import annotations

import pytest

from moe_plugins.tools.pool import WorkerPool


# imported once by the pools' fork server (a module missing from the venv is skipped): each module's workers
# are forked with them loaded instead of importing them again (about 2-5 s of CPU each on this 2-core machine)
PRELOAD = ("torch", "torch.distributed", "deepspeed", "moe_plugins.patches.deepspeed", "megatron.core",
           "transformers", "moe_plugins.patches.megatron")


@pytest.fixture(scope="module")
def world():
    pools = {}

    def get(size: int) -> WorkerPool:
        if size not in pools:
            pools[size] = WorkerPool(size, start_method="forkserver", preload=PRELOAD)
        return pools[size]

    yield get
    for pool in pools.values():
        pool.close()
