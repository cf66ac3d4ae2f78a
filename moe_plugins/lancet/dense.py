"""Opt-in deferral of dense ``nn.Linear`` weight gradients (Lancet's dense dW, ``"dense_wgrad": true``).

:func:`dense_wgrad` wraps the given modules for the length of a ``with`` block: each module's ``forward``
becomes :func:`~moe_plugins.lancet.wgrad.deferred_linear` on its own weight and bias, so its dW joins the queue
(tag ``"dense"`` by default). The wrap is an instance attribute set through the core's ``Patcher`` and removed
in ``finally``: afterwards the module is its original self (no ``forward`` in its ``__dict__``).

Only plain ``torch.nn.Linear`` modules are wrapped: a subclass may compute more than ``F.linear`` in its
forward, and a parametrized or already wrapped module would lose what is there. Every problem is listed at
once, in one ValueError naming each module and its type, and nothing is wrapped.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator, List, Mapping, Tuple, Union

import torch
from torch import nn

from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.lancet.wgrad import deferred_linear
from moe_plugins.lancet.wgrad_queue import WgradQueue

Modules = Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def wrap_problems(name: str, module: Any) -> List[str]:
    """Why ``module`` cannot be wrapped (empty: it can)."""
    if not isinstance(module, nn.Module):
        return [f"{name} ({_type_name(module)}) is not a torch.nn.Module"]
    if type(module) is not nn.Linear:
        return [f"{name} ({_type_name(module)}) is not a plain torch.nn.Linear (a subclass or another module "
                "may compute more than F.linear)"]
    if "forward" in vars(module):
        return [f"{name} ({_type_name(module)}) has its forward replaced already (wrapped twice?)"]
    if torch.nn.utils.parametrize.is_parametrized(module):
        return [f"{name} ({_type_name(module)}) is parametrized; its weight is computed, not a parameter"]
    return []


def _named(modules: Modules) -> List[Tuple[str, Any]]:
    items = list(modules.items()) if isinstance(modules, Mapping) else list(modules)
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"modules[{i}] ({_type_name(item)}) must be a (name, module) pair, e.g. from "
                             "model.named_modules()")
        out.append(item)
    return out


def _forward(module: nn.Linear, queue: WgradQueue, name: str, tag: str):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return deferred_linear(x, module.weight, module.bias, queue, name=name, tag=tag)
    return forward


@contextmanager
def dense_wgrad(queue: WgradQueue, modules: Modules, *, tag: str = "dense") -> Iterator[Patcher]:
    """Within the block, the dW (and db) of every module in ``modules`` ((name, module) pairs, or a mapping) is
    deferred to ``queue``. Refuses, before wrapping anything, every module it cannot wrap (ValueError)."""
    if not isinstance(queue, WgradQueue):
        raise ValueError(f"queue ({_type_name(queue)}) must be a moe_plugins.lancet.WgradQueue")
    named = _named(modules)
    problems = [p for name, module in named for p in wrap_problems(name, module)]
    seen = set()
    for name, module in named:
        if id(module) in seen:
            problems.append(f"{name} ({_type_name(module)}) is listed twice")
        seen.add(id(module))
    if problems:
        raise ValueError("dense_wgrad cannot wrap: " + "; ".join(problems))
    patcher = Patcher([Patch(module, "forward", _forward(module, queue, name, tag)) for name, module in named])
    with patcher:
        yield patcher
