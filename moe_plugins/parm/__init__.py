"""Parm: S1/S2 schedules that pause tensor parallelism inside the MoE layer, a fused EP&ESP all-to-all,
SAA, and the automatic choice (Algorithm 1, extended). docs/parm.md explains the design.

- :mod:`.schedules`: parm-s1, parm-s2, parm-s2-saa (their shared steps: :mod:`.steps`); :mod:`.auto`: parm-auto;
  :mod:`.tune`: parm-tune; the ragged exchange's forms: :mod:`.ragged`, :mod:`.saa_ragged`, :mod:`.ragged_auto`;
- :mod:`.volumes` and :mod:`.cost`: what each schedule sends, its price, Algorithm 1; :mod:`.saa`: the overlapped all-to-all + all-gather;
- :mod:`.plan`: ``moe-plugins plan parm``; :mod:`.profile_ops`: the SAA op of ``moe-plugins profile``.
"""

from __future__ import annotations

import logging
from typing import Type


def _host_class(profile, element_bytes: int, mp: int, base: Type, log: logging.Logger) -> Type:
    from moe_plugins.parm.cost import DEFAULT_COSTS_SOURCE
    from moe_plugins.parm.auto import parm_auto_for
    if profile is None:
        log.info("moe_plugins: %s has no cached profile for this layout; it uses %s", base.name,
                 DEFAULT_COSTS_SOURCE)
    return parm_auto_for(profile, element_bytes, mp, base=base)


def _planner(subparsers) -> None:
    from moe_plugins.parm import plan          # imported when `moe-plugins plan parm` is asked for
    plan.register(subparsers)


def _saa_op(spec, groups, device, stack):
    from moe_plugins.parm import profile_ops   # imported when a profile runs
    return profile_ops.SAA_OP(spec, groups, device, stack)


def register(registry) -> None:
    """Add Parm's schedules, its planner and its profile op to ``registry``."""
    from moe_plugins.parm.auto import ParmAutoSchedule
    from moe_plugins.parm.schedules import ParmS1Schedule, ParmS2SAASchedule, ParmS2Schedule
    from moe_plugins.parm.tune import ParmTuneSchedule
    fixed = (ParmS1Schedule, ParmS2Schedule, ParmS2SAASchedule)
    for cls in fixed:
        registry.add_schedule(cls, paper="parm")
    names = tuple(cls.name for cls in fixed)
    for cls in (ParmAutoSchedule, ParmTuneSchedule):
        registry.add_schedule(cls, paper="parm", profiled=True, host_class=_host_class, candidates=names)
    registry.add_planner("parm", _planner)
    registry.add_profile_op("saa", _saa_op)
