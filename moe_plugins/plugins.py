"""The catalogue: the core's baseline schedules plus every paper package's registrations, frozen.

This module is the one place that knows which papers exist; it sits between the papers and their users
(patches, recipes, tools), as checked by the import contract in ``.importlinter``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional

from moe_plugins import hecate, lancet, lina, parm, pipemoe
from moe_plugins.core.baseline import BaselineSchedule
from moe_plugins.core.baseline_tp import BaselineTPSchedule
from moe_plugins.core.registry import Registry

PAPERS = (parm, pipemoe, lina, hecate, lancet)


def build_registry(extra: Optional[Callable[[Registry], None]] = None) -> Registry:
    """A fresh registry with everything registered, plus what ``extra`` adds (tests, experiments), frozen."""
    registry = Registry()
    for cls in (BaselineSchedule, BaselineTPSchedule):
        registry.add_schedule(cls, paper="core")
    for paper in PAPERS:
        paper.register(registry)
    if extra is not None:
        extra(registry)
    return registry.freeze()


@lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The registry hosts and tools use: built once, frozen, so never changed after."""
    return build_registry()
