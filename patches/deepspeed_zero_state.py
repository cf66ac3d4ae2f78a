"""DeepSpeed's ZeRO 1/2 optimizer state carried whole across a move of expert parameters: rebuilt around a regroup
of the expert modules (Lina's packing during training, and unpacked around a checkpoint;
patches/deepspeed_lina_packing.py), or written back after experts moved between ranks in place (Hecate's
re-sharding with expert-DP > 1: :class:`GatheredState`, patches/deepspeed_hecate_reshard.py).

ZeRO 1/2 flatten each optimizer group's parameters into one buffer and keep the fp32 master copy and the
optimizer state (Adam's moments) as flat partitions over the group's DP ranks (expert-DP for the experts). A
change in the number of experts per rank changes those buffers, so the optimizer is rebuilt, carrying every
parameter's values whole:

1. :func:`snapshot` (collective: each MoE group's expert-DP ranks, every rank in the same order): every expert
   parameter's full fp32 master value and optimizer state tensors, through DeepSpeed's
   ``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state``, and the scalar state (Adam's ``step``,
   the same in every group). The dense groups keep their parameters and DP group, hence their partitions: this
   rank's flat fp32 partition and state are kept as they are (no gather) and copied into the new ones.
2. :func:`release`: the old optimizer's gradient hooks removed (its ``destroy``), the torch optimizer's groups
   back to the model's parameters, its state emptied. The caller then regroups the modules; the expert
   parameters' snapshot entries move with them.
3. :func:`restore` on the optimizer the engine builds anew: its state made like the old one's, then filled from
   the snapshot with ``safe_set_full_fp32_param`` and ``safe_set_full_optimizer_state``.

The same holds in bf16 (ZeRO's partitions are then the bf16 model's fp32 masters), and :func:`snapshot` /
:func:`write_back` (so :class:`GatheredState`) read DeepSpeed's ``BF16_Optimizer`` (bf16 with fp32 gradient
accumulation at ZeRO 1: flat fp32 partitions over DP under other names, :func:`layout`) too, and so in fp16. A
rebuild hands the old optimizer's loss scale to the new one (:func:`loss_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch

FP32 = "fp32"


@dataclass
class Snapshot:
    """Per parameter (by ``id``), its full fp32 value (``"fp32"``) and optimizer state tensors by key."""

    values: Dict[int, Dict[str, torch.Tensor]] = field(default_factory=dict)
    keys: List[str] = field(default_factory=list)        # the optimizer state tensors (Adam: exp_avg, exp_avg_sq)
    scalars: Dict[str, Any] = field(default_factory=dict)
    partitions: Dict[int, Dict[str, torch.Tensor]] = field(default_factory=dict)   # dense group -> its flat ones


# Where DeepSpeed's optimizers keep their loss scale (fp16): ZeRO 1/2 a loss scaler object, FP16_UnfusedOptimizer a
# LossScaleConfig; both the custom scale an engine may set. A rebuilt optimizer takes the old one's.
LOSS_SCALE = ("loss_scaler", "dynamic_loss_scale", "loss_scale_config", "custom_loss_scaler", "external_loss_scale")


def loss_scale(opt: Any) -> Dict[str, Any]:
    """The loss scale state ``opt`` holds (:data:`LOSS_SCALE`), to hand to the optimizer rebuilt in its place
    (``setattr`` each): fp16's dynamic scale goes on as it was (a fresh one would start over at the initial
    scale and skip other steps)."""
    return {name: getattr(opt, name) for name in LOSS_SCALE if hasattr(opt, name)}


def layout(zero: Any) -> Tuple[List[List[torch.nn.Parameter]], List[torch.Tensor], List[bool]]:
    """(the 16-bit (or fp32) parameter groups, their flat fp32 master partitions, whether each group is an MoE
    one) of a ZeRO 1/2 optimizer or of DeepSpeed's ``BF16_Optimizer`` (bf16 with fp32 gradient accumulation at
    ZeRO 1): the same layout under other names."""
    if hasattr(zero, "single_partition_of_fp32_groups"):
        return zero.bit16_groups, zero.single_partition_of_fp32_groups, [zero.is_moe_group(g) for g in
                                                                         zero.optimizer.param_groups]
    from deepspeed.moe.utils import is_moe_param_group
    return zero.bf16_groups, zero.fp32_groups_flat_partition, [is_moe_param_group(g) for g in
                                                                zero.optimizer.param_groups]


def snapshot(zero: Any) -> Snapshot:
    """Every expert parameter of ``zero``'s MoE groups whole, the dense groups' partitions as they are (module
    docstring, 1). Collective."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = Snapshot()
    groups, flats, moe = layout(zero)
    first = zero.optimizer.state.get(flats[0], {})
    out.keys = sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0)
    out.scalars = {k: v for k, v in first.items() if k not in out.keys}
    if out.keys:
        _link_state(zero)
    for i, params in enumerate(groups):
        if not moe[i]:
            flat = flats[i]
            state = zero.optimizer.state.get(flat, {})
            out.partitions[i] = {FP32: flat, **{key: state[key] for key in out.keys}}
            continue
        for p in params:
            entry = {FP32: safe_get_full_fp32_param(p)}
            for key in out.keys:
                entry[key] = safe_get_full_optimizer_state(p, key)
            out.values[id(p)] = entry
    return out


def release(zero: Any) -> Any:
    """``zero`` taken off the model (module docstring, 2); returns its torch optimizer, ready to be rebuilt on."""
    basic = zero.optimizer
    zero.destroy()
    for group, params in zip(basic.param_groups, zero.bit16_groups):
        group["params"] = list(params)
    basic.state.clear()
    return basic


def restore(zero: Any, snap: Snapshot) -> None:
    """The new ``zero``'s master values and optimizer state from ``snap`` (module docstring, 3); every parameter
    of its groups must have an entry."""
    problems = [f"group {i}: partition {tuple(zero.single_partition_of_fp32_groups[i].shape)}, saved "
                f"{tuple(saved[FP32].shape)}" for i, saved in snap.partitions.items()
                if zero.single_partition_of_fp32_groups[i].shape != saved[FP32].shape]
    problems += [f"no saved master value for a parameter of shape {tuple(p.shape)}" for i, params in
                 enumerate(zero.bit16_groups) if i not in snap.partitions for p in params if id(p) not in snap.values]
    if problems:
        raise ValueError("moe_plugins.lina.packing: the rebuilt ZeRO optimizer does not match: " + "; ".join(problems))
    if snap.keys:
        for flat in zero.single_partition_of_fp32_groups:
            zero.optimizer.state[flat] = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in snap.scalars.items()},
                                          **{k: torch.zeros_like(flat) for k in snap.keys}}
        _link_state(zero)
    for i, saved in snap.partitions.items():
        flat = zero.single_partition_of_fp32_groups[i]
        flat.data.copy_(saved[FP32])
        for key in snap.keys:
            zero.optimizer.state[flat][key].copy_(saved[key])
    write_back(zero, snap)


def write_back(zero: Any, snap: Snapshot) -> None:
    """Every MoE group parameter's fragment of its master value and optimizer state from ``snap`` (this rank's
    slices of the whole tensors; no collective)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    for i, params in enumerate(layout(zero)[0]):
        if i in snap.partitions:
            continue
        for p in params:
            entry = snap.values[id(p)]
            safe_set_full_fp32_param(p, entry[FP32])
            for key in snap.keys:
                safe_set_full_optimizer_state(p, entry[key], key)


class GatheredState:
    """A move's ``extra`` (moe_plugins.hecate.rehome) for ZeRO 1/2 expert groups partitioned over expert-DP > 1:
    at its first call, every expert parameter's master value and moments gathered whole (:func:`snapshot`,
    collective: every rank moves the same layers in the same order), moved in place with the experts; ``done()``
    writes this rank's fragments back (:func:`write_back`)."""

    def __init__(self, zero: Any):
        self.zero, self.snap = zero, None

    def __call__(self, param: torch.nn.Parameter) -> List[torch.Tensor]:
        if self.snap is None:
            self.snap = snapshot(self.zero)
        entry = self.snap.values[id(param)]
        return [entry[FP32]] + [entry[key] for key in self.snap.keys]

    def done(self) -> None:
        if self.snap is not None:
            snap, self.snap = self.snap, None
            write_back(self.zero, snap)


def _link_state(zero: Any) -> None:
    """Point every parameter's fragment mapping at its group's optimizer state now (DeepSpeed links them once,
    after its first step, and a checkpoint load re-links the parameters without it)."""
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state
    groups, flats, _ = layout(zero)
    for params, flat in zip(groups, flats):
        lazy_init_hp_params_optimizer_state(params, flat, zero.optimizer.state)
    zero._hp_optimizer_states_linked = True


def unfused(opt: Any) -> bool:
    """Whether ``opt`` is DeepSpeed's ``FP16_UnfusedOptimizer`` (fp16/bf16 at ZeRO 0): per-parameter fp32 masters in
    ``fp32_groups``, parallel to its ``fp16_groups``."""
    return isinstance(getattr(opt, "fp32_groups", None), list) and hasattr(opt, "fp16_groups")


def unfused_masters(opt: Any) -> Dict[int, torch.Tensor]:
    """``FP16_UnfusedOptimizer`` ``opt``'s fp32 master of each model parameter, by parameter id."""
    return {id(p): main for low, high in zip(opt.fp16_groups, opt.fp32_groups) for p, main in zip(low, high)}


def unfused_release(opt: Any) -> Tuple[Any, Dict[int, Dict[str, torch.Tensor]], Dict[str, Any]]:
    """DeepSpeed's ``FP16_UnfusedOptimizer`` ``opt`` (fp16/bf16 at ZeRO 0: ``fp16_groups`` of model parameters and
    parallel ``fp32_groups`` of fp32 masters, which its torch optimizer steps and keys Adam's state by) taken off
    the model, as :func:`release` does for ZeRO: returns its torch optimizer with the model's parameters back in
    its groups and its state emptied, every parameter's master and moments whole by parameter id (``FP32`` and
    the state keys: Lina's packing carries the expert ones through the regroup), and the scalar state (Adam's
    ``step``)."""
    basic = opt.optimizer
    first = next((s for s in basic.state.values() if s), {})
    keys = sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0)
    carried = {}
    for key, main in unfused_masters(opt).items():
        state = basic.state.get(main, {})
        carried[key] = {FP32: main.detach().clone(), **{k: state[k].clone() for k in keys if k in state}}
    for group, low in zip(basic.param_groups, opt.fp16_groups):
        group["params"] = list(low)
    basic.state.clear()
    return basic, carried, {k: v for k, v in first.items() if k not in keys}


def unfused_restore(opt: Any, carried: Dict[int, Dict[str, torch.Tensor]], scalars: Dict[str, Any]) -> None:
    """The ``FP16_UnfusedOptimizer`` the engine built anew on the regrouped parameters: each master and its state
    from ``carried`` (keyed by the parameters now; every one must have an entry)."""
    missing = [tuple(p.shape) for low in opt.fp16_groups for p in low if id(p) not in carried]
    if missing:
        raise ValueError(f"moe_plugins.lina.packing: no carried master for parameters of shapes {missing}")
    with torch.no_grad():
        for low, high in zip(opt.fp16_groups, opt.fp32_groups):
            for p, main in zip(low, high):
                saved = dict(carried.pop(id(p)))
                main.copy_(saved.pop(FP32))
                if saved:
                    opt.optimizer.state[main] = {**{k: v.clone() if torch.is_tensor(v) else v
                                                    for k, v in scalars.items()},
                                                 **{k: v.clone() for k, v in saved.items()}}
