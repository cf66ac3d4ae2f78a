"""One way to patch a host: a table of (target, attribute, replacement), applied atomically and put back
exactly (accelerate's ``patch_environment`` / ``init_on_device`` pattern).

- :meth:`Patcher.apply` replaces every attribute or none: if one fails, those already replaced are restored
  before the error propagates.
- :meth:`Patcher.restore` puts back the identical original objects (``getattr(target, name) is original``),
  deletes attributes the target did not own before (a class attribute that was inherited stays inherited),
  and goes on through every patch even when one fails, raising the first error at the end. The original goes
  back even when the host reassigned the attribute meanwhile (a patch is a scope: DeepSpeed writes some of the
  module globals patched here); the restore line then says so.
- Nested Patchers over the same attribute restore correctly in LIFO order, which ``with`` guarantees;
  enable/disable pairs must be disabled in reverse order too. Applying one Patcher twice is refused.
- One log line (logger ``moe_plugins``, DEBUG) per patch and per restore. As a context manager it restores in
  ``finally``.

No module-level state: every Patcher holds its own originals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Tuple

_MISSING = object()


@dataclass(frozen=True)
class Patch:
    target: Any            # a module, a class or an object
    name: str              # the attribute replaced
    replacement: Any

    def describe(self) -> str:
        owner = getattr(self.target, "__qualname__", None) or getattr(self.target, "__name__", None) \
            or type(self.target).__name__
        module = getattr(self.target, "__module__", None)
        prefix = f"{module}.{owner}" if module and module != owner and isinstance(self.target, type) else owner
        return f"{prefix}.{self.name}"


def _describe_value(value: Any) -> str:
    """A replacement as the log names it: ``module.qualname`` for functions and classes, else a short repr."""
    name = getattr(value, "__qualname__", None)
    if isinstance(name, str):
        module = getattr(value, "__module__", None)
        return f"{module}.{name}" if module else name
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)[:60]
    return f"a {type(value).__qualname__}"


def _own_value(target: Any, name: str) -> Any:
    """The attribute as the target itself holds it (not inherited), or _MISSING."""
    own = getattr(target, "__dict__", None)
    if own is not None:
        return own.get(name, _MISSING)
    return getattr(target, name, _MISSING)


def undo_all(undos: Iterable[Callable[[], None]]) -> None:
    """Call every undo in turn even when one fails; raise the first error (an Exception) after all ran."""
    first: Optional[BaseException] = None
    for undo in undos:
        try:
            undo()
        except Exception as exc:         # undo the others; raise the first at the end
            first = first or exc
    if first is not None:
        raise first


class Patcher:
    """Apply a table of patches; restore them. Use ``with Patcher(patches):`` or ``apply()`` / ``restore()``
    for an enable/disable pair. A Patcher is applied at most once at a time."""

    def __init__(self, patches: Iterable[Patch], *, logger: Optional[logging.Logger] = None):
        self.patches: Tuple[Patch, ...] = tuple(patches)
        self.log = logger or logging.getLogger("moe_plugins")
        # (patch, the target's own value before or _MISSING, the value the target then held)
        self._applied: List[Tuple[Patch, Any, Any]] = []
        seen = set()
        for p in self.patches:
            key = (id(p.target), p.name)
            if key in seen:
                raise ValueError(f"patch table names {p.describe()} twice")
            seen.add(key)

    @property
    def active(self) -> bool:
        return bool(self._applied)

    def apply(self) -> "Patcher":
        if self._applied:
            raise RuntimeError("this Patcher is applied already; restore it first")
        try:
            for p in self.patches:
                before = _own_value(p.target, p.name)
                setattr(p.target, p.name, p.replacement)
                self._applied.append((p, before, _own_value(p.target, p.name)))
                self.log.debug("moe_plugins: patched %s -> %s", p.describe(), _describe_value(p.replacement))
        except BaseException:
            self.restore()
            raise
        return self

    def restore(self) -> None:
        """Put every applied patch back, newest first; the first error (if any) is raised after all."""
        first: Optional[BaseException] = None
        while self._applied:
            p, before, patched = self._applied.pop()
            try:
                reassigned = _own_value(p.target, p.name) is not patched
                if before is _MISSING:
                    if _own_value(p.target, p.name) is not _MISSING:
                        delattr(p.target, p.name)
                else:
                    setattr(p.target, p.name, before)
                self.log.debug("moe_plugins: restored %s%s", p.describe(),
                               " (it had been reassigned while patched)" if reassigned else "")
            except BaseException as exc:           # keep restoring the others; raise the first at the end
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> "Patcher":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.restore()
