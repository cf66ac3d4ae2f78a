"""The registry (core/registry.py) and the catalogue (plugins.py): pure, no process group."""

from __future__ import annotations

import logging

import pytest

from moe_plugins.core.baseline import BaselineSchedule
from moe_plugins.core.costmodel import CostProfile, LinearModel, ProfileKey
from moe_plugins.core.executor import Sequential
from moe_plugins.core.layer import resolve_schedule
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.registry import Registry
from moe_plugins.hecate.config import SECTION_RULES
from moe_plugins.lancet.config import SECTION_RULES as LANCET_RULES
from moe_plugins.lina.config import lina_problems
from moe_plugins.plugins import build_registry, default_registry


class _Other(BaselineSchedule):
    name = "other"


def _profile() -> CostProfile:
    key = ProfileKey(world=4, ranks_per_node=2, mp=1, ep=4, esp=1, backend="gloo", device="cpu")
    lin = lambda unit: LinearModel(alpha=1e-4, beta=1e-9, unit=unit)   # noqa: E731
    return CostProfile(key=key, dtype="float32", models={"gemm": lin("mac"), "all_to_all@ep": lin("byte")})


def test_catalogue_names_and_roles():
    reg = default_registry()
    assert reg is default_registry()                                  # built once
    assert reg.schedule_names() == sorted(reg.schedule_names())
    assert {"baseline", "baseline-tp", "parm-s1", "parm-s2", "parm-s2-saa", "parm-auto", "parm-tune"} <= set(
        reg.schedule_names())
    assert [n for n in reg.schedule_names() if reg.is_profiled(n)] == ["parm-auto", "parm-tune"]
    assert not reg.is_profiled("nope")
    assert set(reg.candidates_of("parm-auto")) == {"parm-s1", "parm-s2", "parm-s2-saa"}
    assert [n for n in reg.schedule_names() if reg.schedule_class(n).needs_expert_partials] == [
        "parm-auto", "parm-s1", "parm-s2", "parm-s2-saa", "parm-tune"]
    assert {"parm", "pipemoe"} <= set(reg.planners())
    assert {"saa", "chunk"} <= set(reg.profile_ops())
    assert reg.degree_policies() == {"auto": "the cost model's pick", "tune": "that pick checked by timing the layer"}
    assert reg.executor_names() == ["pipelined"]
    assert reg.config_choices() == {"schedules": reg.schedule_names(), "degrees": reg.degree_policies(),
                                    "sections": {"lina": lina_problems, "hecate": SECTION_RULES,
                                                 "lancet": LANCET_RULES}}


def test_frozen_and_duplicates_refused():
    with pytest.raises(RuntimeError, match=r"registry is frozen: cannot add schedule 'other'"):
        default_registry().add_schedule(_Other, paper="test")
    reg = Registry()
    reg.add_schedule(BaselineSchedule, paper="core")
    with pytest.raises(ValueError, match=r"schedule 'baseline' is registered already"):
        reg.add_schedule(BaselineSchedule, paper="core")
    reg.add_degree_policy("auto", lambda profile: 2, paper="test", summary="two")
    with pytest.raises(ValueError, match=r"degree policy 'auto' is registered already"):
        reg.add_degree_policy("auto", lambda profile: 3, paper="test", summary="three")
    for word in ("Auto", "4", "", " a"):
        with pytest.raises(ValueError, match=r"must be a lower-case word"):
            reg.add_degree_policy(word, lambda profile: 2, paper="test", summary="x")
    with pytest.raises(ValueError, match=r"a profiled schedule needs host_class, and only it"):
        reg.add_schedule(_Other, paper="test", profiled=True)
    with pytest.raises(ValueError, match=r"must be a Schedule subclass"):
        reg.add_schedule(int, paper="test")


def test_every_registration_is_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="moe_plugins"):
        build_registry(lambda reg: reg.add_schedule(_Other, paper="test"))
    text = caplog.text
    for part in ("schedule baseline ->", "schedule parm-auto ->", "schedule other ->", "planner parm",
                 "profile op chunk", "pipeline_degree 'tune'", "executor pipelined"):
        assert part in text, part


def test_schedule_class_by_name_or_subclass():
    reg = build_registry(lambda r: r.add_schedule(_Other, paper="test"))
    assert reg.schedule_class("other") is _Other
    configured = type("Configured", (_Other,), {})
    assert reg.schedule_class(configured) is configured              # a subclass of the registered class of its name
    with pytest.raises(ValueError,
                       match=r"schedule \('fastest'\) is unknown; allowed: baseline, baseline-tp, hecate, other"):
        reg.schedule_class("fastest")
    with pytest.raises(ValueError, match=r"must be a name in .* or a subclass of the registered class of its name"):
        reg.schedule_class(type("Stray", (BaselineSchedule,), {"name": "stray"}))
    assert "other" not in default_registry().schedule_names()        # a built registry is its own
    layout = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=2, esp=1)
    assert reg.schedule_problems("fastest", layout) == [f"schedule ('fastest') is unknown; allowed: "
                                                        f"{', '.join(reg.schedule_names())}"]
    assert reg.host_schedule_class("baseline", None, 4, 1, logging.getLogger("t")) is BaselineSchedule


def test_layer_resolves_names_only_through_a_registry():
    assert resolve_schedule(BaselineSchedule, None) is BaselineSchedule
    assert resolve_schedule("parm-s1", default_registry()).name == "parm-s1"
    with pytest.raises(ValueError, match=r"schedule \('parm-s1'\) is a name: pass registry="):
        resolve_schedule("parm-s1", None)


def test_pipeline_degree_and_executors():
    reg = default_registry()
    assert reg.degree(3) == 3 and reg.degree(" 4 ") == 4
    for bad in (0, "two", 1.5, True, "-1"):
        with pytest.raises(ValueError, match=r"must be a positive integer, 'auto' or 'tune'"):
            reg.degree(bad)
    with pytest.raises(ValueError, match=r"pipeline_degree \('auto'\) needs a cost profile"):
        reg.degree("auto")
    auto = reg.degree(" AUTO ", _profile(), r_max=4)
    assert type(auto).__name__ == "AutoDegree" and auto.r_max == 4 and set(auto.costs) == {"ep"}
    assert type(reg.degree("tune", _profile())).__name__ == "TunedDegree"
    assert not reg.needs_lane(1) and not reg.needs_lane("1") and reg.needs_lane(2) and reg.needs_lane("tune")
    assert isinstance(reg.build_executor(1, None, None), Sequential)
    with pytest.raises(ValueError, match=r"needs engine="):
        reg.build_executor(2, None, None)

    built = []
    own = Registry()
    own.add_degree_policy("half", lambda profile, **options: ("half", profile, options), paper="test", summary="x")
    with pytest.raises(ValueError, match=r"executor \(None\) must be one of \(none registered\)"):
        own.build_executor(2, None, None)
    own.add_executor("a", lambda degree, engine: built.append(("a", degree, engine)) or "A", paper="test")
    own.add_executor("b", lambda degree, engine: built.append(("b", degree, engine)) or "B", paper="test")
    with pytest.raises(ValueError, match=r"executor \(None\) must be one of a, b"):
        own.build_executor(2, None, "engine")
    assert own.build_executor("half", "profile", "engine", executor="b", k=1) == "B"
    assert built == [("b", ("half", "profile", {"k": 1}), "engine")]
    assert own.freeze().config_choices() == {"schedules": [], "degrees": {"half": "x"}, "sections": {}}
