"""No host synchronisation in a steady-state step (issue #27): on 4 gloo ranks, every host read of a tensor's
value (``.item()``, ``int()`` of a tensor, ``nonzero``, boolean-mask indexing, ...; tests/host_reads.py) in
training steps 2-5 of the core layer, per schedule and pipeline degree. On a GPU each is a synchronisation.

Zero for baseline, parm-s2 and parm-auto at r = 1 and 2 with capacity dropping. The documented exceptions
(docs/architecture.md, "Host reads"), each one read per step and inherent to the schedule:
- parm-s1: the local capacity C_l (its buffer size: the largest kept count of the rank's token block), and
  where the EP&ESP group holds other tokens, the max agreed over it;
- dropless (``drop_tokens`` off): the capacity, the largest expert count, agreed across ranks.
parm-auto reads its watched C_l on the host only on its agreement calls (every ``observe_every``).
"""

from __future__ import annotations

import pytest

from moe_plugins.tools.verify import VerifySpec
from tests.workers.host_reads import reads_per_step

STEPS = 5


def _spec(schedule: str, r: int, *, drop: bool = True) -> VerifySpec:
    mp, ep, esp = (1, 4, 1) if schedule == "baseline" else (2, 2, 2)
    return VerifySpec(world=4, ranks_per_node=2, mp=mp, ep=ep, esp=esp, k=2, tokens=16, schedule=schedule,
                      pipeline_degree=r, drop=drop)


@pytest.mark.parametrize("schedule", ["baseline", "parm-s2", "parm-auto"])
@pytest.mark.parametrize("r", [1, 2])
def test_no_host_read_in_a_steady_state_step(world, schedule, r):
    for per_step in world(4).run(reads_per_step, _spec(schedule, r), STEPS, timeout_s=300):
        assert per_step[1:] == [{}] * (STEPS - 1), per_step


def test_parm_s1_reads_only_its_local_capacity(world):
    for per_step in world(4).run(reads_per_step, _spec("parm-s1", 1), STEPS, timeout_s=300):
        for step in per_step[1:]:       # C_l, and where EP&ESP peers hold other tokens, its agreed max
            assert 1 <= sum(step.values()) <= 2, step
            assert all(("schedules.py" in w or "steps.py" in w) and "prepare" in w for w in step), step


def test_dropless_reads_only_the_agreed_capacity(world):
    for per_step in world(4).run(reads_per_step, _spec("baseline", 1, drop=False), STEPS, timeout_s=300):
        for step in per_step[1:]:
            assert sum(step.values()) == 2 and all("router.py" in w for w in step), step


def test_parm_auto_without_mp_runs_s2_and_reads_nothing(world):
    """At N_MP = 1 parm-auto once picked S1 (its buffer priced on balanced routing) and read C_l every call;
    on one H200 that was one synchronisation per step (benchmarks/results/gpu-h200.md)."""
    spec = VerifySpec(world=4, ranks_per_node=2, mp=1, ep=4, esp=1, k=2, tokens=16, schedule="parm-auto",
                      pipeline_degree=1, drop=True)
    for per_step in world(4).run(reads_per_step, spec, STEPS, timeout_s=300):
        assert per_step[1:] == [{}] * (STEPS - 1), per_step
