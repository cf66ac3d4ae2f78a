"""Opt-in deferral of dense weight gradients (Lancet's dense dW, ``"dense_wgrad": true``).

:func:`dense_wgrad` wraps the given modules for the length of a ``with`` block (:func:`dense_patcher`: the same
wrap as a Patcher, which the DeepSpeed adapter holds while the plugin is enabled): each module's ``forward``
becomes :func:`~moe_plugins.lancet.wgrad.deferred_linear` (``nn.Linear``) or
:func:`~moe_plugins.lancet.wgrad.deferred_addmm` (transformers' ``Conv1D``, HF GPT-2's projections) on its own
weight and bias, so its dW joins the queue (tag ``"dense"`` by default). The wrap is an instance attribute set
through the core's ``Patcher`` and removed in ``finally``: afterwards the module is its original self (no
``forward`` in its ``__dict__``).

Only plain ``torch.nn.Linear`` and transformers' ``Conv1D`` modules are wrapped: a subclass may compute more than
the GEMM in its forward, and a parametrized or already wrapped module would lose what is there. Every problem is
listed at once, in one ValueError naming each module and its type, and nothing is wrapped.

:func:`model_dense_modules` finds a model's candidates: its Linear-like modules outside the given subtrees (the MoE
layers, whose experts defer on their own), less those whose weight another module shares (a tied LM head: its
gradient must reach the parameter's hooks once, summed with the embedding's, so it stays stock).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator, List, Mapping, Tuple, Union

import torch
from torch import nn

from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.lancet.wgrad import deferred_addmm, deferred_linear
from moe_plugins.lancet.wgrad_queue import WgradQueue

Modules = Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _is_conv1d_class(cls: type) -> bool:
    """transformers' ``Conv1D`` class, by its name and module: the papers' packages import no host framework."""
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


def is_conv1d(module: Any) -> bool:
    """transformers' ``Conv1D`` exactly (``torch.addmm(bias, x, weight)``, weight (in, out))."""
    return _is_conv1d_class(type(module)) and hasattr(module, "nf")


def is_linear_like(module: Any) -> bool:
    """A module computing a dense GEMM of its own weight: a ``torch.nn.Linear`` or ``Conv1D``, or a subclass of
    either (which :func:`wrap_problems` refuses)."""
    return isinstance(module, nn.Linear) or any(_is_conv1d_class(c) for c in type(module).__mro__)


def wrap_problems(name: str, module: Any) -> List[str]:
    """Why ``module`` cannot be wrapped (empty: it can)."""
    if not isinstance(module, nn.Module):
        return [f"{name} ({_type_name(module)}) is not a torch.nn.Module"]
    if type(module) is not nn.Linear and not is_conv1d(module):
        return [f"{name} ({_type_name(module)}) is not a plain torch.nn.Linear or transformers' Conv1D (a subclass "
                "or another module may compute more than the GEMM)"]
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


def _forward(module: nn.Module, queue: WgradQueue, name: str, tag: str):
    if is_conv1d(module):
        def forward_conv1d(x: torch.Tensor) -> torch.Tensor:        # transformers' Conv1D.forward, deferred
            y_NO = deferred_addmm(x.view(-1, x.size(-1)), module.weight, module.bias, queue, name=name, tag=tag)
            return y_NO.view(x.size()[:-1] + (module.nf,))
        return forward_conv1d

    def forward(x: torch.Tensor) -> torch.Tensor:
        return deferred_linear(x, module.weight, module.bias, queue, name=name, tag=tag)
    return forward


def model_dense_modules(model: nn.Module, exclude: Iterable[nn.Module]) -> Tuple[List[Tuple[str, nn.Module]],
                                                                                  List[str]]:
    """``model``'s Linear-like modules outside the subtrees of ``exclude``: (those whose weight no other module
    holds, as (name, module) pairs; the names of those whose weight is tied to another module's)."""
    skip = {id(m) for root in exclude for m in root.modules()}
    owners: dict = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    found, tied = [], []
    for name, module in model.named_modules():
        if id(module) in skip or not is_linear_like(module):
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and owners.get(id(weight), 0) > 1:
            tied.append(name)
        else:
            found.append((name, module))
    return found, tied


def dense_patcher(queue: WgradQueue, modules: Modules, *, tag: str = "dense", logger: Any = None) -> Patcher:
    """The wrap of :func:`dense_wgrad` as a core ``Patcher``, not yet applied. Refuses, before building anything,
    every module it cannot wrap (one ValueError)."""
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
    return Patcher([Patch(module, "forward", _forward(module, queue, name, tag)) for name, module in named],
                   logger=logger)


def defer_model_dense(queue: WgradQueue, model: nn.Module, exclude: Iterable[nn.Module], *, field: str,
                      logger: Any, tag: str = "dense") -> Tuple[Patcher, List[str]]:
    """A host's ``dense_wgrad``: ``model``'s dense modules outside ``exclude`` (:func:`model_dense_modules`) wrapped
    and applied at once (the Patcher returned, to restore), and their names. Tied weights stay stock (logged);
    a module it cannot wrap is refused, the ValueError prefixed with ``field``, nothing wrapped."""
    found, tied = model_dense_modules(model, exclude)
    try:
        patcher = dense_patcher(queue, found, tag=tag, logger=logger)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from exc
    patcher.apply()
    logger.info("moe_plugins: Lancet defers the weight gradients of %d dense modules%s", len(found),
                f"; tied to another module's weight, left stock: {', '.join(tied)}" if tied else "")
    return patcher, [name for name, _ in found]


@contextmanager
def dense_wgrad(queue: WgradQueue, modules: Modules, *, tag: str = "dense") -> Iterator[Patcher]:
    """Within the block, the dW (and db) of every module in ``modules`` ((name, module) pairs, or a mapping) is
    deferred to ``queue``. Refuses, before wrapping anything, every module it cannot wrap (ValueError)."""
    with dense_patcher(queue, modules, tag=tag) as patcher:
        yield patcher
