"""Zero-code activation for ``moe-plugins launch``: this directory goes first on PYTHONPATH, so that its
``sitecustomize.py`` runs at the start of every Python process of the job and calls :func:`install`.

:func:`install` costs nothing until DeepSpeed is imported: it only puts a finder on ``sys.meta_path``. Right after
``import deepspeed`` completes, it calls ``moe_plugins.enable`` with the ds_config named by ``MOE_PLUGINS_CONFIG``
(set by ``moe-plugins launch``) or by the process's own ``--deepspeed_config`` / ``--ds-config`` argument; with
neither, each engine's ds_config ``moe_plugins`` section decides. This module imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Callable, Optional, Sequence

SHIM_DIR = os.path.dirname(os.path.abspath(__file__))
CONFIG_ENV = "MOE_PLUGINS_CONFIG"
CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--ds-config", "--ds_config")


def config_path_from_argv(argv: Sequence[str]) -> Optional[str]:
    """The ds_config path of a command line (``--deepspeed_config PATH`` or ``--deepspeed_config=PATH``, and the
    ``--ds-config`` spellings); the last one wins, as argparse does. None when absent."""
    found = None
    for i, arg in enumerate(argv):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(argv):
                found = argv[i + 1]
            elif arg.startswith(flag + "="):
                found = arg[len(flag) + 1:]
    return found


class _AfterImport(importlib.abc.Loader):
    """Runs the real loader of a module, then a callback once the module is fully imported."""

    def __init__(self, inner, done: Callable[[], None]):
        self._inner, self._done = inner, done

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        self._done()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class EnableAfterDeepSpeed(importlib.abc.MetaPathFinder):
    """A one-shot finder: when ``deepspeed`` is imported, wrap its loader so that the plugin is enabled right
    after DeepSpeed finishes importing (before the user's code can build an engine)."""

    def __init__(self, config: Optional[str]):
        self.config = config

    def find_spec(self, fullname, path, target=None):
        if fullname != "deepspeed":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _AfterImport(spec.loader, self._enable)
        return spec

    def _enable(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        import moe_plugins
        moe_plugins.enable(self.config or config_path_from_argv(sys.argv[1:]))


def install(config: Optional[str] = None) -> EnableAfterDeepSpeed:
    """Enable the plugin as soon as DeepSpeed is imported (at once if it already is)."""
    hook = EnableAfterDeepSpeed(config)
    if "deepspeed" in sys.modules:
        hook._enable()
    else:
        sys.meta_path.insert(0, hook)
    return hook
