"""Expert packing for hosts that hold one module per local expert (DeepSpeed's ``deepspeed_experts``, Megatron's
``SequentialMLP.local_experts``): what moves with each expert parameter, and growing or shrinking the module list
(with the optimizer's parameter groups and scalar state) once the experts moved.

Pure of any host: the host adapters (``patches/deepspeed_lina_packing.py``, ``patches/megatron_lina_packing.py``)
pass their module lists, their optimizer (a torch optimizer keyed by the parameters), how to read a gradient and
how to resize a list; :func:`regroup_modules` is the move itself, for both.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.lina.regroup import move_experts

Slot = Tuple[str, List[torch.Tensor]]          # ("data" | "grad" | an optimizer state key, one tensor per expert)
Carried = Dict[int, Dict[str, torch.Tensor]]   # parameter id -> more tensors shaped like it (ZeRO's master copies)
Resize = Callable[[int, Dict[str, Dict[str, Any]]], None]     # (local experts, scalar state per parameter name)
ExpertList = Tuple[str, torch.nn.ModuleList, Resize]          # (what, in errors; the modules; how the host resizes)
CARRIED = "carried:"                           # a moved slot's prefix for the caller's carried tensors


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


def regroup_modules(lists: List[ExpertList], num_experts: int, old: MoEProcessGroups, groups: MoEProcessGroups,
                    rec: Any, optimizer: Optional[Any], *,
                    grad_of: Callable[[torch.nn.Parameter], Optional[torch.Tensor]] = lambda p: p.grad,
                    carried: Optional[Carried] = None) -> Dict[int, torch.Tensor]:
    """Move every list's experts from ``old``'s layout to ``groups``' (collective: one all-to-all per fine EP group,
    :func:`moe_plugins.lina.regroup.move_experts`): what :func:`moved_slots` finds, and the ``carried`` tensors
    (popped by parameter id, refilled keyed by the new parameters). Each list's ``resize`` runs after the move with
    the new local count and the scalar state per parameter name (:func:`scalar_state`); then the values and the
    optimizer state land on the new parameters. Returns the moved gradients by new parameter id: the host puts
    them where its gradients live (DeepSpeed's ``.grad``, Megatron's ``main_grad``)."""
    where: List[Tuple[int, str, str]] = []            # (list, parameter name inside an expert, slot)
    tensors: List[List[torch.Tensor]] = []
    scalars: List[Dict[str, Dict[str, Any]]] = []
    for index, (what, experts, _) in enumerate(lists):
        scalars.append({})
        for key, params in params_by_name(experts).items():
            for slot, found in moved_slots(key, params, optimizer, what, grad_of=grad_of):
                where.append((index, key, slot))
                tensors.append(found)
            entries = [carried.pop(id(p)) for p in params] if carried is not None else []
            for slot in sorted(entries[0]) if entries else ():
                where.append((index, key, CARRIED + slot))
                tensors.append([entry[slot] for entry in entries])
            scalars[index][key] = scalar_state(key, params, optimizer, what)
    moved = move_experts(tensors, num_experts, old, groups, rec)
    local = num_experts // groups.layout.ep
    for (_, _, resize), per_name in zip(lists, scalars):
        resize(local, per_name)
    grads: Dict[int, torch.Tensor] = {}
    for (index, key, slot), stacked in zip(where, moved):
        for i, expert in enumerate(lists[index][1]):
            param = dict(expert.named_parameters())[key]
            if slot == "data":
                param.data = stacked[i].clone()
            elif slot == "grad":
                grads[id(param)] = stacked[i]
            elif slot.startswith(CARRIED):
                carried.setdefault(id(param), {})[slot[len(CARRIED):]] = stacked[i].clone()
            else:
                optimizer.state[param][slot] = stacked[i].clone()
    return grads
