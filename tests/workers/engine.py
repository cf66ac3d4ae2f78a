"""Pool jobs for the communication engine's tests (run on every rank of a gloo pool).

Shapes: N elements of a test tensor (flat), W ranks.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from typing import Any, Dict

import torch
import torch.distributed as dist

from moe_plugins.core.engine import BACKGROUND, PIPELINE, CommError, build_engine
from moe_plugins.core.groups import process_groups
from moe_plugins.core.layout import ParallelLayout


def _layout(world: int) -> ParallelLayout:
    return ParallelLayout(world=world, ranks_per_node=max(1, world // 2), ep=world)


def mixed_rounds(world: int, rounds: int, seed: int, max_delay_s: float) -> Dict[str, Any]:
    """``rounds`` rounds of a background all-reduce, a random per-rank delay and an urgent op: inline under a
    hold that the background op is issued in, on the pipeline lane with the background op issued while it is
    in flight, or inline after the background op. Every result checked; returns the timeline and the errors."""
    with process_groups(_layout(world)) as groups:
        engine = build_engine(groups, pipeline=True, background=True, record_timeline=True, timeout_s=60)
        try:
            errors = _mixed(engine, groups, rounds, random.Random(seed * 1000 + dist.get_rank()), max_delay_s)
        finally:
            engine.close()
        return {"timeline": [asdict(r) for r in engine.timeline], "errors": errors}


def _mixed(engine, groups, rounds: int, rng: random.Random, max_delay_s: float):
    rank, w = dist.get_rank(), groups.ep.size
    errors, background = [], []
    for i in range(rounds):
        x_N = torch.full((4 * w,), float(rank + i))

        def bg():
            background.append((i, engine.issue("all_reduce", groups.dp, x_N, priority=BACKGROUND, layer=f"b{i}",
                                               phase="backward")))
        kind = i % 3
        if kind == 0:                  # announced: the background op issued inside the hold waits for its end
            with engine.hold():
                bg()
                time.sleep(rng.random() * max_delay_s)
                y_N = engine.issue("all_to_all", groups.ep, x_N, layer=f"u{i}").wait()
        elif kind == 1:                # queued behind an urgent op in flight on the pipeline lane
            handle = engine.issue("all_to_all", groups.ep, x_N, lane=PIPELINE, layer=f"u{i}")
            bg()
            time.sleep(rng.random() * max_delay_s)
            y_N = handle.wait()
        else:                          # free to start before the urgent op is issued
            bg()
            time.sleep(rng.random() * max_delay_s)
            y_N = engine.issue("all_gather", groups.ep, x_N, layer=f"u{i}").wait()
        # all_to_all: block j came from rank j; all_gather: rank j's whole tensor at j
        per = 4 if kind < 2 else 4 * w
        want_N = torch.cat([torch.full((per,), float(j + i)) for j in range(w)])
        if not torch.equal(y_N, want_N):
            errors.append(f"round {i}: urgent result {y_N.tolist()} != {want_N.tolist()}")
    for i, handle in background:
        want = float(sum(range(w)) + w * i)
        got = handle.wait(timeout_s=60)
        if not torch.equal(got, torch.full_like(got, want)):
            errors.append(f"round {i}: background all_reduce {got.tolist()} != {want}")
    return errors


def _injected_failure() -> None:
    raise RuntimeError("injected failure on rank 0")


def failing_background(world: int, timeout_s: float) -> Dict[str, Any]:
    """Rank 0's background op raises; the others' matching all-reduce must fail by the twin groups' timeout.
    Every rank reports what ``wait()`` raised, what a later ``issue()`` raised, and how long it took."""
    with process_groups(_layout(world)) as groups:
        engine = build_engine(groups, background=True, timeout_s=timeout_s)
        start = time.monotonic()
        if dist.get_rank() == 0:
            handle = engine.submit(_injected_failure, lane=BACKGROUND)
        else:
            handle = engine.issue("all_reduce", groups.dp, torch.ones(8), priority=BACKGROUND)
        try:
            handle.wait(timeout_s=10 * timeout_s)
            waited = "returned"
        except TimeoutError as exc:    # wait() itself gave up: the engine hung
            waited = f"hung: {exc}"
        except RuntimeError as exc:    # the op's own error
            waited = f"raised {type(exc).__name__}: {exc}"
        try:
            engine.issue("all_reduce", groups.dp, torch.ones(8))
            again = "ran"
        except CommError as exc:
            again = str(exc)
        seconds = time.monotonic() - start
        engine.close()
    return {"waited": waited, "again": again, "seconds": seconds}
