"""Registry of MoE schedules, keyed by the name users write in their config (``schedule``)."""

from __future__ import annotations

from typing import Dict, List, Type

from ..layout import ParallelLayout
from .base import Dispatched, LayerParams, Schedule, chunk_bounds, run_schedule
from .baseline import BaselineSchedule
from .baseline_tp import BaselineTPSchedule
from .parm import PARM_SCHEDULES
from .parm_tune import ParmTuneSchedule

SCHEDULES: Dict[str, Type[Schedule]] = {cls.name: cls for cls in (BaselineSchedule, BaselineTPSchedule,
                                                                   *PARM_SCHEDULES, ParmTuneSchedule)}


def schedule_problems(name: str, layout: ParallelLayout) -> List[str]:
    if name not in SCHEDULES:
        return [f"schedule ({name!r}) is unknown; allowed: {', '.join(sorted(SCHEDULES))}"]
    return SCHEDULES[name].layout_problems(layout)


__all__ = ["SCHEDULES", "Dispatched", "LayerParams", "Schedule", "chunk_bounds", "run_schedule",
           "schedule_problems"]
