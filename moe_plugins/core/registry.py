"""The registry: what each paper package adds to the core, keyed by the names users write.

A :class:`Registry` is an explicit object (no module-level table). The core registers its baselines, each
paper package registers its schedules, planners and profile ops through its ``register(registry)``, and
``moe_plugins.plugins.default_registry()`` builds the frozen catalogue that hosts and tools use. Every
registration is logged; a duplicate name is refused (torchtitan's model registry does the same).

Nothing outside a paper's package names that paper's schedules: hosts and tools ask the registry
(``is_profiled``, ``host_schedule_class``, ``Schedule.needs_expert_partials``, ``candidates_of``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, Union

from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.schedule import Schedule

log = logging.getLogger("moe_plugins")

# host_class(profile, element_bytes, mp, base, log) -> the class a host runs (profiled schedules only)
HostClass = Callable[[Any, int, int, Type[Schedule], logging.Logger], Type[Schedule]]


@dataclass(frozen=True)
class ScheduleEntry:
    cls: Type[Schedule]
    paper: str                              # "core", "parm", ...
    profiled: bool = False                  # decides from the cost profile
    host_class: Optional[HostClass] = None  # how a host configures it from a profile (profiled ones)
    candidates: Tuple[str, ...] = ()        # the registered schedules it chooses among (bench judges against)


class Registry:
    """Schedules, planners and profile ops by name. Build, register, :meth:`freeze`, then pass it on."""

    def __init__(self) -> None:
        self._schedules: Dict[str, ScheduleEntry] = {}
        self._planners: Dict[str, Callable] = {}
        self._profile_ops: Dict[str, Any] = {}
        self._frozen = False

    # ---- registration --------------------------------------------------------------------------------
    def _check_open(self, what: str, name: str, table: Dict[str, Any]) -> None:
        if self._frozen:
            raise RuntimeError(f"registry is frozen: cannot add {what} {name!r}")
        if name in table:
            raise ValueError(f"{what} {name!r} is registered already")

    def add_schedule(self, cls: Type[Schedule], *, paper: str, profiled: bool = False,
                     host_class: Optional[HostClass] = None, candidates: Tuple[str, ...] = (),
                     name: Optional[str] = None) -> None:
        """Register ``cls`` under ``name`` (default: its own ``name``; another name registers a configured
        variant, e.g. parm-auto with given costs, for one job)."""
        name = getattr(cls, "name", None) if name is None else name
        if not (isinstance(cls, type) and issubclass(cls, Schedule) and isinstance(name, str)):
            raise ValueError(f"schedule ({cls!r}) must be a Schedule subclass with a string `name`")
        self._check_open("schedule", name, self._schedules)
        if profiled != (host_class is not None):
            raise ValueError(f"schedule {name!r}: a profiled schedule needs host_class, and only it")
        self._schedules[name] = ScheduleEntry(cls, paper, profiled, host_class, tuple(candidates))
        log.debug("moe_plugins registry: schedule %s -> %s.%s (%s)", name, cls.__module__, cls.__qualname__, paper)

    def add_planner(self, name: str, register: Callable) -> None:
        """``register(subparsers)`` adds ``moe-plugins plan <name>``'s parser (run set as its default)."""
        self._check_open("planner", name, self._planners)
        self._planners[name] = register
        log.debug("moe_plugins registry: planner %s", name)

    def add_profile_op(self, name: str, op: Any) -> None:
        """A profiler op a paper adds (see tools/profiler.py for the op protocol)."""
        self._check_open("profile op", name, self._profile_ops)
        self._profile_ops[name] = op
        log.debug("moe_plugins registry: profile op %s", name)

    def freeze(self) -> "Registry":
        self._frozen = True
        return self

    # ---- queries -------------------------------------------------------------------------------------
    def schedule_names(self) -> List[str]:
        return sorted(self._schedules)

    def _entry(self, name: str) -> ScheduleEntry:
        if name not in self._schedules:
            raise ValueError(f"schedule ({name!r}) is unknown; allowed: {', '.join(self.schedule_names())}")
        return self._schedules[name]

    def schedule_class(self, schedule: Union[str, Type[Schedule]]) -> Type[Schedule]:
        """The class behind a name; a class is taken as is when it derives from the registered class of its
        ``name`` (e.g. ``ParmAutoSchedule.with_costs(...)``)."""
        if isinstance(schedule, str):
            return self._entry(schedule).cls
        name = getattr(schedule, "name", None)
        if not (isinstance(schedule, type) and name in self._schedules
                and issubclass(schedule, self._schedules[name].cls)):
            raise ValueError(f"schedule ({schedule!r}) must be a name in {', '.join(self.schedule_names())} or "
                             "a subclass of the registered class of its name")
        return schedule

    def is_profiled(self, name: str) -> bool:
        return name in self._schedules and self._schedules[name].profiled

    def candidates_of(self, name: str) -> Tuple[str, ...]:
        """The registered schedules a deciding schedule chooses among (empty for the others)."""
        return self._schedules[name].candidates if name in self._schedules else ()

    def schedule_problems(self, name: str, layout: ParallelLayout) -> List[str]:
        if name not in self._schedules:
            return [f"schedule ({name!r}) is unknown; allowed: {', '.join(self.schedule_names())}"]
        return self._schedules[name].cls.layout_problems(layout)

    def host_schedule_class(self, name: str, profile, element_bytes: int, mp: int,
                            logger: logging.Logger) -> Type[Schedule]:
        """The class a host runs for ``name``: a profiled schedule configured from the profile (its
        documented defaults, said on the host's ``logger``, without one); every other its registered class."""
        entry = self._entry(name)
        if not entry.profiled:
            return entry.cls
        return entry.host_class(profile, element_bytes, mp, entry.cls, logger)

    def planners(self) -> Dict[str, Callable]:
        return dict(self._planners)

    def profile_ops(self) -> Dict[str, Any]:
        return dict(self._profile_ops)
