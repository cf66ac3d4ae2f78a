"""What Megatron-core's optimizers step in place of an expert parameter, moved with the expert: the fp32 master of
its mixed-precision optimizer (``Float16OptimizerWithFloat16Params``: bf16/fp16 parameters, each with
``param.main_param``, an fp32 copy that the torch optimizer holds and keys Adam's state by), or, under the
distributed optimizer, this rank's piece of it (patches/megatron_pieces.py).

Hecate's re-sharding (patches/megatron_hecate_reshard.py) moves experts between ranks in place: :class:`Masters`
gives the views that move with each parameter. Lina's packing (patches/megatron_lina_packing.py) also grows or
shrinks the expert module lists: before the move, :func:`carried_masters` gives each expert parameter's master and
the master's Adam tensors as ``carried`` entries of :func:`moe_plugins.lina.modules.regroup_modules`, which moves
them with the expert and refills them keyed by the parameters that hold each expert after the move.
:func:`replace_masters` then puts them in the optimizer: a kept parameter's master takes the moved values in place;
a new parameter (a cloned expert) gets a new master, joining the optimizer's group of the parameter it was cloned
from in Megatron's three parallel lists (``float16_groups``, ``fp32_from_float16_groups`` and the torch optimizer's
``param_groups``), with Adam's scalar ``step``; a dropped parameter's master leaves them with its state. Megatron's
own ``_copy_model_grads_to_main_grads`` / ``_copy_main_params_to_model_params`` then pair them as before.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from moe_plugins.patches.megatron_pieces import GatheredPieces, Piece

MAIN = "main"                        # the carried slot holding the master's values


def _tensor_state(state: Dict[str, Any], like: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The optimizer state tensors shaped like ``like`` (Adam's moments), by key in sorted order."""
    return {k: state[k] for k in sorted(state, key=str)
            if torch.is_tensor(state[k]) and state[k].shape == like.shape}


def stepped(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """What Megatron's non-distributed optimizer steps in ``param``'s place: its fp32 master (bf16/fp16), else None
    (``FP32Optimizer``: the parameter)."""
    return getattr(param, "main_param", None)


class Masters:
    """Hecate's ``extra`` (moe_plugins.hecate.rehome): what moves with an expert parameter beyond what
    ``slot_tensors`` finds on the parameter itself (its values, ``grad``, state keyed by it). A parameter with a
    :class:`~moe_plugins.patches.megatron_pieces.Piece` in ``pieces`` (the distributed optimizer's): its
    ``main_grad``, its whole master and moments, gathered from the pieces and written back by :meth:`done`
    (:class:`~moe_plugins.patches.megatron_pieces.GatheredPieces`). Else the master ``optimizer`` steps in its
    place (:func:`stepped`), with that master's gradient and Adam moments, and the parameter's ``main_grad``
    (DDP's buffer); nothing for an fp32 parameter under ``FP32Optimizer``. Each storage once (a master's gradient
    may be ``main_grad`` itself)."""

    def __init__(self, optimizer: Optional[torch.optim.Optimizer], pieces: Optional[Dict[int, Piece]] = None):
        self.optimizer, self.pieces = optimizer, pieces or {}
        self.gathered = GatheredPieces(self.pieces)

    def __call__(self, param: torch.nn.Parameter) -> List[torch.Tensor]:
        if id(param) in self.pieces:
            return self.gathered(param)
        main = stepped(param)
        if main is None:
            return []
        state = self.optimizer.state.get(main, {}) if self.optimizer is not None else {}
        found = [t for t in (getattr(param, "main_grad", None), main.grad, main.data) if t is not None]
        found += list(_tensor_state(state, main).values())
        seen = {t.data_ptr() for t in (param.data, param.grad) if t is not None}
        out = []
        for t in found:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out.append(t)
        return out

    def done(self) -> None:
        self.gathered.done()


def carried_masters(params: Sequence[torch.nn.Parameter],
                    optimizer: torch.optim.Optimizer) -> Dict[int, Dict[str, torch.Tensor]]:
    """Per parameter id: its master's values and the master's optimizer tensors shaped like it (Adam's moments)."""
    out = {}
    for p in params:
        main = p.main_param
        out[id(p)] = {MAIN: main.data, **_tensor_state(optimizer.state.get(main, {}), main)}
    return out


def _where(mixed: Any, param: torch.nn.Parameter) -> tuple:
    for g, params in enumerate(mixed.float16_groups):
        for i, q in enumerate(params):
            if q is param:
                return g, i
    raise ValueError(f"an expert parameter {tuple(param.shape)} is in none of Megatron's float16 optimizer groups")


def replace_masters(mixed: Any, before: Sequence[torch.nn.Parameter], after: Sequence[torch.nn.Parameter],
                    templates: Sequence[torch.nn.Parameter], carried: Dict[int, Dict[str, torch.Tensor]]) -> None:
    """Megatron's mixed-precision optimizer ``mixed`` after a regroup (module docstring): ``before`` / ``after``
    the expert parameters before and after it, ``templates[i]`` the parameter ``after[i]`` is a clone of when it
    is new (unread for a kept one), ``carried`` the moved masters keyed by the ``after`` parameters' ids."""
    from megatron.core import tensor_parallel
    torch_opt = mixed.optimizer
    kept = {id(p) for p in after}
    scalars: Dict[int, Dict[str, Any]] = {}
    for p in before:
        g, _ = _where(mixed, p)
        main = p.main_param
        scalars.setdefault(g, {k: v for k, v in torch_opt.state.get(main, {}).items()
                               if not (torch.is_tensor(v) and v.shape == main.shape)})
    for p in [p for p in before if id(p) not in kept]:          # dropped: out of the three lists and the state
        g, i = _where(mixed, p)
        main = mixed.fp32_from_float16_groups[g][i]
        del mixed.float16_groups[g][i], mixed.fp32_from_float16_groups[g][i]
        torch_opt.param_groups[g]["params"] = [q for q in torch_opt.param_groups[g]["params"] if q is not main]
        torch_opt.state.pop(main, None)
    olds = {id(p) for p in before}
    for p, template in zip(after, templates):
        moved = carried.pop(id(p))
        if id(p) in olds:
            main = p.main_param
            main.data.copy_(moved.pop(MAIN))
        else:                                                   # a new expert: a new master in the template's group
            g, _ = _where(mixed, template)
            main = moved.pop(MAIN).clone()
            tensor_parallel.copy_tensor_model_parallel_attributes(main, p)
            p.main_param = main
            mixed.float16_groups[g].append(p)
            mixed.fp32_from_float16_groups[g].append(main)
            torch_opt.param_groups[g]["params"].append(main)
            torch_opt.state[main] = {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars[g].items()}
        state = torch_opt.state.setdefault(main, {})
        for k, v in moved.items():
            state[k] = v.clone()


def share_flags(params: List[torch.nn.Parameter]) -> None:
    """Each master's ``shared`` as its parameter's (Megatron's gradient norm counts a master only when not
    shared, and the packed copies of an expert are marked shared on all but one EP member)."""
    for p in params:
        main = getattr(p, "main_param", None)
        if main is not None:
            main.shared = getattr(p, "shared", False)


__all__ = ["MAIN", "Masters", "carried_masters", "replace_masters", "share_flags", "stepped"]
