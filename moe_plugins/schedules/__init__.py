"""Registry of MoE schedules, keyed by the name users write in their config (``schedule``)."""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Type

from moe_plugins.core.costmodel import CostProfile
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.parm.cost import DEFAULT_COSTS_SOURCE
from moe_plugins.core.plugin_config import PROFILED_SCHEDULES
from moe_plugins.core.schedule import Dispatched, LayerParams, Schedule, chunk_bounds, run_schedule
from moe_plugins.core.baseline import BaselineSchedule
from moe_plugins.core.baseline_tp import BaselineTPSchedule
from moe_plugins.parm.schedules import PARM_SCHEDULES, parm_auto_for
from moe_plugins.parm.tune import ParmTuneSchedule

SCHEDULES: Dict[str, Type[Schedule]] = {cls.name: cls for cls in (BaselineSchedule, BaselineTPSchedule,
                                                                   *PARM_SCHEDULES, ParmTuneSchedule)}


def schedule_problems(name: str, layout: ParallelLayout) -> List[str]:
    if name not in SCHEDULES:
        return [f"schedule ({name!r}) is unknown; allowed: {', '.join(sorted(SCHEDULES))}"]
    return SCHEDULES[name].layout_problems(layout)


def host_schedule_class(name: str, profile: Optional[CostProfile], element_bytes: int, mp: int,
                        log: logging.Logger) -> Type[Schedule]:
    """The class a host runs for schedule ``name``: ``parm-auto`` / ``parm-tune`` decide from the profile's
    alpha-beta terms (the documented defaults, said on the host's ``log``, without one); every other schedule
    is its registered class."""
    if name not in PROFILED_SCHEDULES:
        return SCHEDULES[name]
    if profile is None:
        log.info("moe_plugins: %s has no cached profile for this layout; it uses %s", name, DEFAULT_COSTS_SOURCE)
    return parm_auto_for(profile, element_bytes, mp, base=SCHEDULES[name])


__all__ = ["SCHEDULES", "Dispatched", "LayerParams", "Schedule", "chunk_bounds", "host_schedule_class",
           "run_schedule", "schedule_problems"]
