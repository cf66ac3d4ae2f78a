"""core/patcher.Patcher: atomic apply, exact restore, inherited and missing attributes, logs."""

from __future__ import annotations

import logging
import types

import pytest

from moe_plugins.core.patcher import Patch, Patcher


class Base:
    def hook(self):
        return "base"


class Child(Base):
    def own(self):
        return "own"


def test_restores_the_identical_objects_and_inherited_attributes():
    own, module = Child.__dict__["own"], types.SimpleNamespace(fn=len)
    with Patcher([Patch(Child, "own", lambda self: "x"), Patch(Child, "hook", lambda self: "y"),
                  Patch(module, "fn", max)]):
        assert Child().own() == "x" and Child().hook() == "y" and module.fn is max
    assert Child.__dict__["own"] is own and module.fn is len
    assert "hook" not in Child.__dict__ and Child().hook() == "base"      # inherited again, not copied down


def test_attribute_that_did_not_exist_is_deleted_on_restore():
    target = types.SimpleNamespace()
    with Patcher([Patch(target, "new", 1)]):
        assert target.new == 1
    assert not hasattr(target, "new")


class _Refuses:
    def __setattr__(self, name, value):
        if name == "locked":
            raise AttributeError("locked")
        object.__setattr__(self, name, value)


def test_apply_is_atomic():
    first, refuses = types.SimpleNamespace(a=1), _Refuses()
    patcher = Patcher([Patch(first, "a", 2), Patch(refuses, "locked", 3)])
    with pytest.raises(AttributeError, match="locked"):
        patcher.apply()
    assert first.a == 1 and not patcher.active


def test_refuses_double_apply_and_duplicate_entries():
    target = types.SimpleNamespace(a=1)
    patcher = Patcher([Patch(target, "a", 2)]).apply()
    with pytest.raises(RuntimeError, match="applied already"):
        patcher.apply()
    patcher.restore()
    assert target.a == 1
    with pytest.raises(ValueError, match="twice"):
        Patcher([Patch(target, "a", 2), Patch(target, "a", 3)])


def test_one_log_line_per_patch_and_restore(caplog):
    target = types.SimpleNamespace(a=1)
    with caplog.at_level(logging.DEBUG, logger="moe_plugins"):
        with Patcher([Patch(Child, "own", None), Patch(target, "a", 2)]):
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count(f"moe_plugins: patched {__name__}.Child.own") == 1
    assert sum(m.startswith("moe_plugins: restored") for m in lines) == 2
