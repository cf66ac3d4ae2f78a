"""Zero-code activation for ``moe-plugins launch``: this directory goes first on PYTHONPATH, so that its
``sitecustomize.py`` runs at the start of every Python process of the job and calls :func:`install` (DeepSpeed)
or :func:`install_megatron` (Megatron-core, when ``MOE_PLUGINS_MEGATRON`` is set).

Both cost nothing until the host is imported: they only put a finder on ``sys.meta_path``.

- DeepSpeed: right after ``import deepspeed`` completes, ``moe_plugins.enable`` runs with the ds_config named by
  ``MOE_PLUGINS_CONFIG`` (set by ``moe-plugins launch``) or by the process's own ``--deepspeed_config`` /
  ``--ds-config`` argument; with neither, each engine's ds_config ``moe_plugins`` section decides.
- Megatron-core: right after ``megatron.core`` is imported, ``moe_plugins.patches.megatron.enable`` runs with the
  section ``MOE_PLUGINS_MEGATRON`` holds (JSON, validated by ``moe-plugins launch``), so Megatron's GPT layer specs
  build the plugin's MoE layer. It runs before any user code can reach the spec builders.

This module imports neither torch nor a host.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Callable, Optional, Sequence

SHIM_DIR = os.path.dirname(os.path.abspath(__file__))
CONFIG_ENV = "MOE_PLUGINS_CONFIG"
MEGATRON_ENV = "MOE_PLUGINS_MEGATRON"
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


class EnableAfterImport(importlib.abc.MetaPathFinder):
    """A one-shot finder: when ``module`` is imported, wrap its loader so that ``enable`` runs right after the
    module finishes importing (before the user's code can use it)."""

    def __init__(self, module: str, enable: Callable[[], None]):
        self.module, self._enable_fn = module, enable

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
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
        self._enable_fn()

    def arm(self) -> "EnableAfterImport":
        """At once if the module is already imported, else on its import."""
        if self.module in sys.modules:
            self._enable()
        else:
            sys.meta_path.insert(0, self)
        return self


class EnableAfterDeepSpeed(EnableAfterImport):
    """Enables the DeepSpeed adapter right after ``import deepspeed``."""

    def __init__(self, config: Optional[str]):
        super().__init__("deepspeed", self._enable_deepspeed)
        self.config = config

    def _enable_deepspeed(self) -> None:
        import moe_plugins
        moe_plugins.enable(self.config or config_path_from_argv(sys.argv[1:]))


def install(config: Optional[str] = None) -> EnableAfterDeepSpeed:
    """Enable the plugin as soon as DeepSpeed is imported (at once if it already is)."""
    hook = EnableAfterDeepSpeed(config)
    hook.arm()
    return hook


def install_megatron(section: str, *, ranks_per_node: Optional[int] = None,
                     announce: bool = False) -> EnableAfterImport:
    """Enable the Megatron-core adapter with ``section`` (the ``moe_plugins`` section as JSON, or a JSON file) as
    soon as ``megatron.core`` is imported (at once if it already is). ``announce``: print one line to stderr."""

    def enable() -> None:
        from moe_plugins.patches import megatron as adapter
        handle = adapter.enable(section, ranks_per_node=ranks_per_node)
        if announce:
            print(f"moe_plugins: Megatron-core MoE specs patched by moe-plugins launch ({handle.plugin.to_dict()})",
                  file=sys.stderr)
    return EnableAfterImport("megatron.core", enable).arm()
