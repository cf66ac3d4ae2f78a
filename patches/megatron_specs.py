"""Megatron-core's MoE layer specs in both styles the adapter runs on (pure helpers; no patching).

- **ModuleSpec** (megatron-core 0.16.1, 0.17): ``ModuleSpec(module=MoELayer, params={...}, submodules=
  MoESubmodules(...), metainfo={...})``, built by ``spec_utils.build_module(spec, config=..., ...)``.
- **functools.partial** (from 0.18; checked on 0.19.2): ``partial(MoELayer, submodules=MoESubmodules(...))``;
  ``TransformerLayer`` calls it as ``spec(config=..., pg_collection=..., is_mtp_layer=..., name=...)``.

The adapter reads and rewrites a spec through these helpers only, so the spec provider, the flag path and the
tools see one interface whichever style the installed Megatron builds. The style is read from the spec object
itself (a ``functools.partial`` or not); :func:`spec_style` says which one a version is expected to build.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

MODULE_SPEC, PARTIAL = "ModuleSpec", "functools.partial"
PARTIAL_FROM = (0, 18)                            # the first minor version whose layer specs are partials
TESTED_VERSIONS = ("0.16.1", "0.19.2")


def version_tuple(version: str) -> Tuple[int, ...]:
    """``"0.19.2"`` -> (0, 19, 2); stops at the first part that is not a number (``"0.20.0rc1"`` -> (0, 20))."""
    parts = []
    for part in version.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def spec_style(version: str) -> str:
    """The style megatron-core ``version`` builds its layer specs in."""
    return PARTIAL if version_tuple(version)[:2] >= PARTIAL_FROM else MODULE_SPEC


def is_partial_spec(spec: Any) -> bool:
    return isinstance(spec, functools.partial)


def _check_spec(spec: Any) -> None:
    if is_partial_spec(spec):
        if spec.args:
            raise ValueError(f"MoE layer spec {spec!r} has positional arguments {spec.args!r}; allowed: keywords only")
        return
    if not all(hasattr(spec, a) for a in ("module", "params", "submodules")):
        raise ValueError(f"MoE layer spec {spec!r} is a {type(spec).__name__}; allowed: a ModuleSpec "
                         f"(megatron-core < 0.18) or a functools.partial (>= 0.18)")


def spec_layer_class(spec: Any) -> Any:
    """The layer class a spec builds (``MoELayer`` for Megatron's own)."""
    _check_spec(spec)
    return spec.func if is_partial_spec(spec) else spec.module


def spec_submodules(spec: Any) -> Any:
    """The spec's ``MoESubmodules`` (router, experts, shared experts)."""
    _check_spec(spec)
    return spec.keywords.get("submodules") if is_partial_spec(spec) else spec.submodules


def spec_params(spec: Any) -> Dict[str, Any]:
    """The keyword arguments the spec adds to the layer's constructor, ``submodules`` excluded."""
    _check_spec(spec)
    if is_partial_spec(spec):
        return {k: v for k, v in spec.keywords.items() if k != "submodules"}
    return dict(spec.params)


def with_layer_class(spec: Any, layer_class: type, params: Mapping[str, Any]) -> Any:
    """A spec of the same style building ``layer_class`` with the same submodules (and, for a ModuleSpec, the same
    metainfo), its params being the stock ones updated with ``params``."""
    merged = dict(spec_params(spec), **params)
    if is_partial_spec(spec):
        return functools.partial(layer_class, submodules=spec_submodules(spec), **merged)
    return type(spec)(module=layer_class, params=merged, submodules=spec.submodules, metainfo=dict(spec.metainfo))


def build_layer(spec: Any, config: Any, **kwargs: Any) -> Any:
    """Build the layer a spec describes, as Megatron would: ``build_module`` for a ModuleSpec, a call for a
    partial. ``kwargs`` go to the constructor (``layer_number``, ``pg_collection``, ...)."""
    _check_spec(spec)
    if is_partial_spec(spec):
        return spec(config=config, **kwargs)
    from megatron.core.transformer.spec_utils import build_module
    return build_module(spec, config=config, **kwargs)


def call_accepting(fn: Callable, **kwargs: Any) -> Any:
    """``fn(**kwargs)`` without the keywords ``fn`` does not take whose value is falsy (an option a later Megatron
    dropped, left at its default); a truthy one it does not take is an error naming it."""
    names = inspect.signature(fn).parameters
    dropped = {k: v for k, v in kwargs.items() if k not in names}
    set_ = {k: v for k, v in dropped.items() if v}
    if set_:
        field, value = next(iter(set_.items()))
        raise ValueError(f"{field} ({value!r}) is not an argument of this Megatron's {fn.__qualname__}; allowed: "
                         f"{', '.join(n for n in names if n != 'self')}")
    return fn(**{k: v for k, v in kwargs.items() if k in names})


def stock_moe_spec(module: Any, *, use_te: Optional[bool], num_experts: Optional[int],
                   moe_grouped_gemm: Optional[bool], moe_use_legacy_grouped_gemm: Optional[bool]) -> Any:
    """``module.get_moe_module_spec`` (Megatron's ``moe_module_specs``) with the arguments this version takes
    (0.18 dropped ``moe_use_legacy_grouped_gemm``)."""
    return call_accepting(module.get_moe_module_spec, use_te=use_te, num_experts=num_experts,
                          moe_grouped_gemm=moe_grouped_gemm, moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm)


__all__ = ["MODULE_SPEC", "PARTIAL", "PARTIAL_FROM", "TESTED_VERSIONS", "build_layer", "call_accepting",
           "is_partial_spec", "spec_layer_class", "spec_params", "spec_style", "spec_submodules",
           "stock_moe_spec", "version_tuple", "with_layer_class"]
