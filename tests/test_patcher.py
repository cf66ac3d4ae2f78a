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


def test_nested_patchers_over_one_attribute_restore_in_lifo_order():
    target = types.SimpleNamespace(a=len)
    with Patcher([Patch(target, "a", max)]):
        with Patcher([Patch(target, "a", min)]):
            assert target.a is min
        assert target.a is max
    assert target.a is len


def test_the_original_goes_back_even_when_the_host_reassigned_it():
    target = types.SimpleNamespace(a=len)
    with Patcher([Patch(target, "a", max), Patch(target, "new", 1)]):
        target.a, target.new = min, 2            # e.g. DeepSpeed writing a module global it owns
    assert target.a is len and not hasattr(target, "new")


class _Freezes:
    frozen = False

    def __setattr__(self, name, value):
        if self.frozen:
            raise AttributeError(f"{name} is frozen")
        object.__setattr__(self, name, value)


def test_a_failing_restore_still_restores_the_others_and_raises_the_first_error():
    first, freezes = types.SimpleNamespace(a=1), _Freezes()
    freezes.b = 0
    patcher = Patcher([Patch(first, "a", 2), Patch(freezes, "b", 3)]).apply()
    object.__setattr__(freezes, "frozen", True)
    with pytest.raises(AttributeError, match="b is frozen"):
        patcher.restore()                       # newest first: b fails, a is still put back
    assert first.a == 1 and not patcher.active


def test_one_log_line_per_patch_and_restore(caplog):
    target = types.SimpleNamespace(a=1)
    with caplog.at_level(logging.DEBUG, logger="moe_plugins"):
        with Patcher([Patch(Child, "own", Base.hook), Patch(target, "a", 2)]):
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"moe_plugins: patched {__name__}.Child.own -> {__name__}.Base.hook",
                     "moe_plugins: patched SimpleNamespace.a -> 2",
                     "moe_plugins: restored SimpleNamespace.a",
                     f"moe_plugins: restored {__name__}.Child.own"]
