"""The registry: what each paper package adds to the core, keyed by the names users write.

A :class:`Registry` is an explicit object (no module-level table). The core registers its baselines, each
paper package registers its schedules, planners, profile ops, ``pipeline_degree`` words (degree policies)
and executors through its ``register(registry)``, and ``moe_plugins.plugins.default_registry()`` builds the
frozen catalogue that hosts and tools use. Every registration is logged; a duplicate name is refused
(torchtitan's model registry does the same).

Nothing outside a paper's package names that paper's schedules or words: hosts and tools ask the registry
(``is_profiled``, ``host_schedule_class``, ``Schedule.needs_expert_partials``, ``candidates_of``,
``degree_policies``, ``build_executor``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, Union

from moe_plugins.core.executor import Executor, Sequential
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.plugin_config import alternatives
from moe_plugins.core.schedule import Schedule

log = logging.getLogger("moe_plugins")

# host_class(profile, element_bytes, mp, base, log) -> the class a host runs (profiled schedules only)
HostClass = Callable[[Any, int, int, Type[Schedule], logging.Logger], Type[Schedule]]
# degree policy: build(profile, **options) -> the per-call degree an executor runs (e.g. PipeMoE's AutoDegree)
DegreeBuilder = Callable[..., Any]
# executor: build(degree, engine) -> Executor, degree an int > 1 or a built degree policy
ExecutorBuilder = Callable[[Any, Any], Executor]


@dataclass(frozen=True)
class ScheduleEntry:
    cls: Type[Schedule]
    paper: str                              # "core", "parm", ...
    profiled: bool = False                  # decides from the cost profile
    host_class: Optional[HostClass] = None  # how a host configures it from a profile (profiled ones)
    candidates: Tuple[str, ...] = ()        # the registered schedules it chooses among (bench judges against)


@dataclass(frozen=True)
class DegreePolicyEntry:
    build: DegreeBuilder
    paper: str
    summary: str                            # what the word picks, for messages ("the cost model's pick")


@dataclass(frozen=True)
class ExecutorEntry:
    build: ExecutorBuilder
    paper: str


def _word(value: Any) -> Optional[str]:
    """A pipeline_degree string as a word (case and spaces ignored); None for anything else."""
    return value.strip().lower() if isinstance(value, str) else None


def _derives(schedule: type, registered: Type[Schedule]) -> bool:
    """``schedule`` derives from ``registered`` or from its form for ``schedule``'s exchange (asked only then)."""
    if issubclass(schedule, registered):
        return True
    variant = registered.exchange_variant(getattr(schedule, "exchange_mode", ""))
    return variant is not None and issubclass(schedule, variant)


class Registry:
    """Schedules, planners and profile ops by name. Build, register, :meth:`freeze`, then pass it on."""

    def __init__(self) -> None:
        self._schedules: Dict[str, ScheduleEntry] = {}
        self._planners: Dict[str, Callable] = {}
        self._profile_ops: Dict[str, Any] = {}
        self._degree_policies: Dict[str, DegreePolicyEntry] = {}
        self._executors: Dict[str, ExecutorEntry] = {}
        self._sections: Dict[str, Callable[[Any, str], List[str]]] = {}
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

    def add_degree_policy(self, word: str, build: DegreeBuilder, *, paper: str, summary: str) -> None:
        """``pipeline_degree = word``: ``build(profile, **options)`` makes the per-call degree policy an
        executor runs. A degree policy decides from the cost profile (``moe-plugins profile``), so a word
        needs one (:func:`moe_plugins.core.plugin_config.degree_needs_profile`)."""
        if not (isinstance(word, str) and word and word == _word(word) and not word.isdigit()):
            raise ValueError(f"degree policy word ({word!r}) must be a lower-case word without spaces")
        self._check_open("degree policy", word, self._degree_policies)
        self._degree_policies[word] = DegreePolicyEntry(build, paper, summary)
        log.debug("moe_plugins registry: pipeline_degree %r (%s) -> %r (%s)", word, summary, build, paper)

    def add_executor(self, name: str, build: ExecutorBuilder, *, paper: str) -> None:
        """An executor that runs a pipeline degree other than 1 (PipeMoE's "pipelined"): ``build(degree,
        engine)`` with ``degree`` an int > 1 or a built degree policy, ``engine`` the caller's CommEngine."""
        self._check_open("executor", name, self._executors)
        self._executors[name] = ExecutorEntry(build, paper)
        log.debug("moe_plugins registry: executor %s -> %s (%s)", name, getattr(build, "__qualname__", build), paper)

    def add_section(self, key: str, check: Callable[[Any, str], List[str]], *, paper: str) -> None:
        """A sub-section of the ``moe_plugins`` config that a paper reads (Lina's ``"lina": {...}``):
        ``check(value, path)`` lists every problem of a value, each naming ``path.key``."""
        self._check_open("config section", key, self._sections)
        self._sections[key] = check
        log.debug("moe_plugins registry: config section %s (%s)", key, paper)

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
        ``name`` (e.g. ``ParmAutoSchedule.with_costs(...)``) or from that class's form for its exchange (a ragged
        form written beside the padded class, ``Schedule.exchange_variant``)."""
        if isinstance(schedule, str):
            return self._entry(schedule).cls
        name = getattr(schedule, "name", None)
        registered = self._schedules[name].cls if isinstance(schedule, type) and name in self._schedules else None
        if registered is None or not _derives(schedule, registered):
            raise ValueError(f"schedule ({schedule!r}) must be a name in {', '.join(self.schedule_names())} or "
                             "a subclass of the registered class of its name (or of its exchange's form)")
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

    # ---- pipeline degree and executors ---------------------------------------------------------------
    def degree_policies(self) -> Dict[str, str]:
        """The registered pipeline_degree words and what each picks, sorted (for validation and messages)."""
        return {word: self._degree_policies[word].summary for word in sorted(self._degree_policies)}

    def config_choices(self) -> Dict[str, Any]:
        """What a ``moe_plugins`` section may name, as plugin_config's keywords:
        ``PluginConfig.from_dict(section, **registry.config_choices())``."""
        return {"schedules": self.schedule_names(), "degrees": self.degree_policies(),
                "sections": dict(self._sections)}

    def degree(self, pipeline_degree: Union[int, str], profile: Any = None, **options: Any) -> Any:
        """A pipeline_degree value (an int, a digit string or a registered word, case and spaces ignored) to
        what an executor runs: the int, or the word's policy built from ``profile`` (required for a word)."""
        word = _word(pipeline_degree)
        if word in self._degree_policies:
            if profile is None:
                raise ValueError(f"pipeline_degree ({word!r}) needs a cost profile: run `moe-plugins profile` on "
                                 "this cluster, or pass an integer degree")
            return self._degree_policies[word].build(profile, **options)
        value = pipeline_degree.strip() if word is not None else pipeline_degree
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            allowed = alternatives(["a positive integer"] + [repr(w) for w in self._degree_policies])
            raise ValueError(f"pipeline_degree ({pipeline_degree!r}) must be {allowed}")
        return value

    def needs_lane(self, pipeline_degree: Union[int, str]) -> bool:
        """Whether :meth:`build_executor` runs ``pipeline_degree`` on a registered executor, whose engine then
        needs a pipeline lane (``build_engine(groups, pipeline=True)``); no profile is read."""
        return _word(pipeline_degree) in self._degree_policies or self.degree(pipeline_degree) != 1

    def executor_names(self) -> List[str]:
        return sorted(self._executors)

    def build_executor(self, pipeline_degree: Union[int, str], profile: Any, engine: Any, *,
                       executor: Optional[str] = None, **options: Any) -> Executor:
        """The executor for a pipeline_degree value: :class:`Sequential` at 1, else the registered executor
        (``executor``: its name, needed only when several are registered) on ``engine``. A word's policy is
        built from ``profile`` with ``options`` (e.g. PipeMoE's ``r_max``)."""
        degree = self.degree(pipeline_degree, profile, **options)
        if degree == 1 and executor is None:
            return Sequential()
        if executor is None and len(self._executors) == 1:
            executor = next(iter(self._executors))
        if executor not in self._executors:
            raise ValueError(f"pipeline_degree ({pipeline_degree!r}) needs an executor: executor ({executor!r}) "
                             f"must be one of {', '.join(self.executor_names()) or '(none registered)'}")
        return self._executors[executor].build(degree, engine)

    def planners(self) -> Dict[str, Callable]:
        return dict(self._planners)

    def profile_ops(self) -> Dict[str, Any]:
        return dict(self._profile_ops)
