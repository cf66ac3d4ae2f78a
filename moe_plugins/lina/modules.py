"""Expert packing for hosts that hold one module per local expert (DeepSpeed's ``deepspeed_experts``, Megatron's
``SequentialMLP.local_experts``): what moves with each expert parameter, and growing or shrinking the module list
(with the optimizer's parameter groups and scalar state) once the experts moved.

Pure of any host: the host adapters (``patches/deepspeed_lina_packing.py``, ``patches/megatron_lina_packing.py``)
pass their module lists, their optimizer (a torch optimizer keyed by the parameters) and how to read a gradient.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

Slot = Tuple[str, List[torch.Tensor]]          # ("data" | "grad" | an optimizer state key, one tensor per expert)


def params_by_name(experts: Iterable[torch.nn.Module]) -> Dict[str, List[torch.nn.Parameter]]:
    """Per parameter name inside an expert module, that parameter of every local expert (in local order)."""
    experts = list(experts)
    names = [n for n, _ in experts[0].named_parameters()]
    return {n: [dict(e.named_parameters())[n] for e in experts] for n in names}


def moved_slots(key: str, params: List[torch.nn.Parameter], optimizer: Optional[Any], what: str,
                grad_of: Callable[[torch.nn.Parameter], Optional[torch.Tensor]] = lambda p: p.grad) -> List[Slot]:
    """What moves with parameter ``key`` of every local expert: its values, its gradients (``grad_of``: the host's
    gradient, e.g. Megatron's ``main_grad``) and the optimizer tensors shaped like it. ``what`` names the layer in
    errors (lockstep training gives every expert the same slots; a mix is refused)."""
    out: List[Slot] = [("data", [p.data for p in params])]
    grads = [grad_of(p) for p in params]
    if len({g is not None for g in grads}) != 1:
        raise ValueError(f"{what}: some experts' {key} have a gradient and some not; regroup at a step boundary")
    if grads[0] is not None:
        out.append(("grad", grads))
    states = [optimizer.state.get(p, {}) if optimizer is not None else {} for p in params]
    keys = sorted(k for k, v in states[0].items() if torch.is_tensor(v) and v.shape == params[0].shape)
    for k in keys:
        if any(k not in s for s in states):
            raise ValueError(f"{what}: optimizer state {k!r} of {key} is missing on some experts")
        out.append((k, [s[k] for s in states]))
    return out


def scalar_state(key: str, params: List[torch.nn.Parameter], optimizer: Optional[Any], what: str) -> Dict[str, Any]:
    """The optimizer state of ``key`` not shaped like it (Adam's ``step``), the same on every local expert: what a
    new expert module's parameter starts with."""
    if optimizer is None:
        return {}
    states = [{k: v for k, v in optimizer.state.get(p, {}).items() if not (torch.is_tensor(v) and
               v.shape == p.shape)} for p in params]
    first = states[0]
    for s in states[1:]:
        if s.keys() != first.keys() or any(not _same(s[k], first[k]) for k in s):
            raise ValueError(f"{what}: the experts' {key} differ in optimizer state {sorted(first)} (stepped "
                             "apart?); packing copies it to new experts")
    return first


def _same(a: Any, b: Any) -> bool:
    return bool(torch.equal(a, b)) if torch.is_tensor(a) and torch.is_tensor(b) else a == b


def group_of(optimizer: Any, param: torch.nn.Parameter, what: str) -> Dict[str, Any]:
    """The optimizer's parameter group holding ``param``."""
    for group in optimizer.param_groups:
        if any(q is param for q in group["params"]):
            return group
    raise ValueError(f"{what}: an expert parameter {tuple(param.shape)} is in no optimizer parameter group")


def resize_experts(experts: torch.nn.ModuleList, local: int, optimizer: Optional[Any],
                   scalars: Mapping[str, Dict[str, Any]], what: str,
                   clone: Callable[[torch.nn.Module], torch.nn.Module] = copy.deepcopy) -> Dict[str, Dict[str, Any]]:
    """``experts`` grown (``clone`` of its first module, gradients cleared) or shrunk to ``local`` modules, and the
    optimizer with them: dropped parameters leave their group and state, new ones join the group of the parameter
    they copy, starting from ``scalars[name]`` (Adam's ``step``; none before the first step). Returns the optimizer
    group of each parameter name (empty without an optimizer)."""
    template = dict(experts[0].named_parameters())
    groups = {key: group_of(optimizer, p, what) for key, p in template.items()} if optimizer is not None else {}
    while len(experts) > local:
        for p in experts[-1].parameters():
            if optimizer is not None:
                optimizer.state.pop(p, None)
                for group in optimizer.param_groups:
                    group["params"] = [q for q in group["params"] if q is not p]
        del experts[len(experts) - 1]
    while len(experts) < local:
        new = clone(experts[0])
        for key, p in new.named_parameters():
            p.grad = None
            if optimizer is not None:
                groups[key]["params"].append(p)
                if scalars.get(key):
                    optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else copy.copy(v)
                                          for k, v in scalars[key].items()}
        experts.append(new)
    return groups
