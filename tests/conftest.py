"""Shared fixtures. ``world`` gives a reused pool of gloo ranks: ``world(4).run(fn, *args)`` runs the
module-level function ``fn`` on 4 ranks and returns the per-rank results in rank order.

The pool lives for one test module: hosts create process groups they never destroy (DeepSpeed makes new ones
for every engine), and each gloo group keeps threads, so fresh workers per module keep the suite fast. They are
forked from a server that imported the heavy packages once (PRELOAD), not spawned afresh.

Profiles: ``make test`` (CI) runs the ``ci`` share; ``MOE_PLUGINS_TESTS=full make test`` also runs the tests
marked ``full``: end-to-end recipe runs whose path a cheaper test already covers at the pool level (each says
which), kept for a release or a change to that recipe."""

from __future__ import annotations

import os

import pytest

from moe_plugins.tools.pool import WorkerPool


# imported once by the pools' fork server (a module missing from the venv is skipped): each module's workers
# are forked with them loaded instead of importing them again (about 2-5 s of CPU each on this 2-core machine)
PRELOAD = ("torch", "torch.distributed", "deepspeed", "moe_plugins.patches.deepspeed", "megatron.core",
           "transformers", "moe_plugins.patches.megatron")

PROFILES = ("ci", "full")
PROFILE = os.environ.get("MOE_PLUGINS_TESTS", "ci")       # the module boundary: read nowhere else
if PROFILE not in PROFILES:
    raise pytest.UsageError(f"MOE_PLUGINS_TESTS ({PROFILE!r}) must be one of {', '.join(PROFILES)}")


def pytest_configure(config):
    config.addinivalue_line("markers", "full(covered_by=...): run only in the full profile (MOE_PLUGINS_TESTS=full); "
                                       "covered_by names the cheaper tests that cover its path in CI")


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("full")
        if marker is None:
            continue
        covered_by = marker.kwargs.get("covered_by")
        if not covered_by:
            raise pytest.UsageError(f"{item.nodeid}: a full-profile test must name the tests that cover it in CI "
                                    "(@pytest.mark.full(covered_by=...))")
        if PROFILE != "full":
            item.add_marker(pytest.mark.skip(reason=f"full profile only (MOE_PLUGINS_TESTS=full); in CI: {covered_by}"))


@pytest.fixture(scope="session")
def recipe_checkpoint(tmp_path_factory):
    """The DeepSpeed recipe's checkpoint of two steps on one rank (tests/infer_checks.py), trained once per session
    for the tests that only read it (the inference recipe's, ``lina-profile``'s)."""
    pytest.importorskip("deepspeed")
    from tests.infer_checks import train_checkpoint
    return train_checkpoint(tmp_path_factory.mktemp("recipe-ckpt"))


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
