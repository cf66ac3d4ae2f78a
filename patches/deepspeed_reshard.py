"""Resume a DeepSpeed MoE checkpoint at another world / expert-parallel size, or refuse it clearly.

What DeepSpeed (0.19.8) does itself when the sizes change, found by experiment (tests/test_ckpt_reshard.py):

* Expert *weights* reshard: one file per (layer, global expert), ``layer_{L}_expert_{g}_mp_rank_00_model_states.pt``,
  and ``load_checkpoint`` reads the files of the experts this EP rank now owns.
* ZeRO stage 0: each EP rank's whole optimizer state (dense and its local experts) is one file,
  ``expp_rank_{r}_mp_rank_00_optim_states.pt``. A new EP rank reads the file with its own rank number, whose
  expert group has another length, and torch refuses it ("loaded state dict contains a parameter group that
  doesn't match the size of optimizer's group") after the weights were already loaded. At the same EP and
  another world it loads correctly (the file of an EP rank holds all it needs).
* ZeRO stage 1/2: the optimizer state is partitioned over DP (``zero_pp_rank_{dp}_...``); at another DP size
  ``load_checkpoint`` raises ZeRORuntimeException ("Automatic adjustment of ZeRO's optimizer state partitioning
  with a new world size is not currently supported"). ``elastic_checkpoint`` does not get past that check and
  ``load_universal_checkpoint`` skips the per-expert files (it needs a ds_to_universal conversion).

:func:`load_checkpoint` does what ``engine.load_checkpoint`` does when the layout is unchanged; at another
size it reshards ZeRO-0 fp32 optimizer state per global expert (weights through DeepSpeed, Adam moments and
step counts mapped by this module), and refuses everything else before anything is loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.deepspeed_experts\.)(?P<local>\d+)\.(?P<suffix>.+)$")
MODEL_STATES = "mp_rank_{mp:02d}_model_states.pt"
EXPERT_OPTIM = "expp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt"


@dataclass(frozen=True)
class Layout:
    """Sizes a checkpoint was saved with, or an engine runs with. ``ep`` is None when the files do not say."""
    world: int
    dp: int
    ep: Optional[int]
    zero_stage: int
    num_experts: Tuple[int, ...]
    half: bool                       # fp16 or bf16 (the optimizer then keeps fp32 master copies of its own)

    def describe(self) -> str:
        ep = "?" if self.ep is None else self.ep
        return f"world {self.world} (DP {self.dp}, EP {ep}, ZeRO stage {self.zero_stage})"


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be an integer >= 1")


def expert_owner(global_id: int, num_experts: int, ep: int) -> Tuple[int, int]:
    """(EP rank, local index) of global expert ``global_id`` when ``num_experts`` experts are split over ``ep``
    ranks in contiguous blocks (DeepSpeed's placement: global = ep_rank * E_local + local)."""
    _positive("num_experts", num_experts)
    _positive("ep", ep)
    if num_experts % ep:
        raise ValueError(f"ep ({ep}) must divide num_experts ({num_experts})")
    if not isinstance(global_id, int) or not 0 <= global_id < num_experts:
        raise ValueError(f"global_id ({global_id!r}) must be in [0, {num_experts})")
    return divmod(global_id, num_experts // ep)


def global_expert_id(ep_rank: int, local: int, num_experts: int, ep: int) -> int:
    """The inverse of :func:`expert_owner`."""
    _positive("num_experts", num_experts)
    _positive("ep", ep)
    if num_experts % ep:
        raise ValueError(f"ep ({ep}) must divide num_experts ({num_experts})")
    per_rank = num_experts // ep
    if not isinstance(ep_rank, int) or not 0 <= ep_rank < ep:
        raise ValueError(f"ep_rank ({ep_rank!r}) must be in [0, {ep})")
    if not isinstance(local, int) or not 0 <= local < per_rank:
        raise ValueError(f"local ({local!r}) must be in [0, {per_rank})")
    return ep_rank * per_rank + local


def expert_param_order(names: Sequence[str], local_experts: Mapping[str, int]) -> List[str]:
    """The names, in optimizer order, of an expert parameter group whose MoE layers hold ``local_experts[prefix]``
    local experts, built from ``names`` (one such group at any count; the parameters of local expert 0 of each
    layer give the template). DeepSpeed's grouping keeps ``model.parameters()`` order: layer by layer, in each
    layer expert 0, 1, ... and each expert's parameters in module order."""
    prefixes: List[str] = []
    suffixes: Dict[str, List[str]] = {}
    for name in names:
        m = EXPERT_PARAM.match(name)
        if m is None:
            raise ValueError(f"parameter {name!r} in an expert group is not an expert parameter "
                             "(…deepspeed_experts.<local>.<name>)")
        if m["prefix"] not in suffixes:
            prefixes.append(m["prefix"])
            suffixes[m["prefix"]] = []
        if m["local"] == "0":
            suffixes[m["prefix"]].append(m["suffix"])
    missing = [p for p in prefixes if p not in local_experts]
    if missing:
        raise ValueError(f"local_experts has no count for the MoE layer(s) {missing}")
    for prefix in prefixes:
        _positive(f"local_experts[{prefix!r}]", local_experts[prefix])
    return [f"{p}{j}.{s}" for p in prefixes for j in range(local_experts[p]) for s in suffixes[p]]


def ep_from_expert_names(names: Sequence[str], num_experts: int) -> Optional[int]:
    """EP size implied by the local expert ids in a list of parameter names (None: no expert parameter)."""
    locals_seen = {int(m["local"]) for m in map(EXPERT_PARAM.match, names) if m}
    if not locals_seen:
        return None
    per_rank = max(locals_seen) + 1
    if num_experts % per_rank:
        raise ValueError(f"{per_rank} local experts do not divide num_experts ({num_experts})")
    return num_experts // per_rank


def check_resume(saved: Layout, now: Layout, where: str = "the checkpoint") -> None:
    """Raise ValueError, naming both layouts, when ``saved`` cannot be loaded at ``now`` without loading wrong
    optimizer state. Same DP and EP: DeepSpeed's own load. Else only ZeRO stage 0 in fp32 reshards."""
    head = f"cannot resume {where}, saved at {saved.describe()}, at {now.describe()}: "
    if saved.num_experts != now.num_experts:
        raise ValueError(head + f"experts per MoE layer differ (saved {list(saved.num_experts)}, "
                                f"model {list(now.num_experts)})")
    if saved.zero_stage != now.zero_stage and 0 in (saved.zero_stage, now.zero_stage):
        raise ValueError(head + "ZeRO stage 0 keeps the optimizer state per EP rank, ZeRO stages 1/2 per DP rank: "
                                f"resume with ZeRO stage {saved.zero_stage}")
    if (saved.dp, saved.ep) == (now.dp, now.ep) or (saved.zero_stage == now.zero_stage == 0 and saved.ep == now.ep):
        return
    if saved.zero_stage != 0 or now.zero_stage != 0:
        raise ValueError(head + f"ZeRO stage {max(saved.zero_stage, now.zero_stage)} partitions the optimizer "
                                "state over data parallelism and DeepSpeed cannot repartition it to another "
                                "DP/EP size (elastic_checkpoint does not apply, load_universal_checkpoint "
                                "does not cover the per-expert files); resume at "
                                f"world {saved.world} with EP {saved.ep}, or save with ZeRO stage 0 to change size")
    if saved.half or now.half:
        raise ValueError(head + "only fp32 optimizer state reshards (fp16/bf16 keep fp32 master copies "
                                "in another format); resume at the saved sizes")
    if saved.ep is None:
        raise ValueError(head + "the checkpoint has no expp_rank_*_optim_states.pt files to read EP from")


def _half(ds_config: Mapping[str, Any]) -> bool:
    return any(bool((ds_config.get(k) or {}).get("enabled")) for k in ("fp16", "bf16", "bfloat16"))


def read_saved_layout(load_dir: str, tag: str, mp_rank: int = 0) -> Layout:
    """The layout a DeepSpeed checkpoint tag was saved with, from its files (no process group needed)."""
    folder = Path(load_dir) / tag
    path = folder / MODEL_STATES.format(mp=mp_rank)
    if not path.is_file():
        raise ValueError(f"checkpoint tag {tag!r} in {load_dir} has no {path.name}")
    states = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    ds_config = states.get("ds_config") or {}
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    num_experts = tuple(int(e) for e in states.get("num_experts") or ())
    dp, mp = int(states["dp_world_size"]), int(states.get("mp_world_size", 1))
    if stage == 0:
        ep: Optional[int] = len(list(folder.glob(EXPERT_OPTIM.format(r="*", mp=mp_rank)))) or None
    else:
        names = [n for group in states.get("param_shapes") or () for n in group]
        ep = ep_from_expert_names(names, max(num_experts)) if num_experts else None
    return Layout(world=dp * mp, dp=dp, ep=ep, zero_stage=stage, num_experts=num_experts,
                  half=_half(ds_config))


def moe_layers(module: torch.nn.Module) -> Dict[str, Any]:
    """name -> deepspeed.moe.layer.MoE of every MoE layer in ``module``."""
    from deepspeed.moe.layer import MoE
    return {name: m for name, m in module.named_modules() if isinstance(m, MoE)}


def current_layout(engine: Any) -> Layout:
    layers = moe_layers(engine.module)
    eps = {m.ep_size for m in layers.values()}
    if len(eps) > 1:
        raise ValueError(f"MoE layers with different ep_size ({sorted(eps)}) are not supported by the reshard tool")
    ep = getattr(engine, "moe_plugins_checkpoint_ep", None)     # Lina's packing at ZeRO 0: files at the stock EP
    return Layout(world=engine.world_size, dp=engine.seq_dp_world_size, ep=ep or (eps.pop() if eps else None),
                  zero_stage=engine.zero_optimization_stage(),
                  num_experts=tuple(m.num_experts for m in layers.values()),
                  half=engine.fp16_enabled() or engine.bfloat16_enabled())


def latest_tag(load_dir: str) -> str:
    latest = Path(load_dir) / "latest"
    if not latest.is_file():
        raise ValueError(f"no tag given and {latest} does not exist")
    return latest.read_text().strip()


def load_checkpoint(engine: Any, load_dir: str, tag: Optional[str] = None) -> Tuple[Any, Dict[str, Any]]:
    """``engine.load_checkpoint(load_dir, tag)`` that also works at another EP size (ZeRO 0, fp32) and refuses,
    before loading anything, what would not load correctly. Returns DeepSpeed's (path, client_state)."""
    tag = tag or latest_tag(load_dir)
    saved, now = read_saved_layout(load_dir, tag, engine.checkpoint_mp_rank), current_layout(engine)
    check_resume(saved, now, where=f"checkpoint {Path(load_dir) / tag}")
    if saved.ep == now.ep:
        return engine.load_checkpoint(load_dir, tag=tag)
    path, client = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=False)
    load_expert_optimizer_state(engine, load_dir, tag, saved)
    return path, client


def load_expert_optimizer_state(engine: Any, load_dir: str, tag: str, saved: Layout) -> None:
    """Give every parameter of a ZeRO-0 fp32 engine the optimizer state the checkpoint holds for it: dense
    parameters from EP rank 0's file (all EP ranks hold the same dense state), expert parameters from the file
    of the EP rank that owned their global expert at the saved size, by name. Hyperparameters come from the
    saved groups (a scheduled learning rate included)."""
    from deepspeed.utils import groups
    optimizer = engine.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer ({type(optimizer).__name__}) is not a torch optimizer: only ZeRO stage 0 "
                         "fp32 optimizer state reshards")
    folder, mp = Path(load_dir) / tag, engine.checkpoint_mp_rank
    files: Dict[int, Dict[str, Any]] = {}

    def saved_groups(ep_rank: int) -> List[Dict[str, Any]]:
        if ep_rank not in files:
            files[ep_rank] = torch.load(folder / EXPERT_OPTIM.format(r=ep_rank, mp=mp), map_location="cpu",
                                        weights_only=False)["optimizer"]
        return files[ep_rank]["param_groups"]

    names = {id(p): n for n, p in engine.module.named_parameters()}
    layers = {f"{name}.deepspeed_moe.experts.deepspeed_experts.": m for name, m in moe_layers(engine.module).items()}
    target = optimizer.state_dict()
    if len(target["param_groups"]) != len(saved_groups(0)):
        raise ValueError(f"optimizer has {len(target['param_groups'])} parameter groups, the checkpoint "
                         f"{len(saved_groups(0))}")
    state: Dict[int, Any] = {}
    for gi, (group, slot) in enumerate(zip(optimizer.param_groups, target["param_groups"])):
        group_names = [names[id(p)] for p in group["params"]]
        if bool(group.get("moe")) != bool(saved_groups(0)[gi].get("moe")):
            raise ValueError(f"optimizer group {gi} ({group.get('name')!r}) is an expert group on one side only")
        sources, expected = (_expert_sources(group_names, layers, saved, groups) if group.get("moe")
                             else ([(0, k) for k in range(len(group_names))], len(group_names)))
        for k, (ep_rank, pos) in enumerate(sources):
            src_group = saved_groups(ep_rank)[gi]
            if len(src_group["params"]) != expected:
                raise ValueError(f"optimizer group {gi} ({group.get('name')!r}) should have {expected} parameters "
                                 f"in expp_rank_{ep_rank}'s file, it has {len(src_group['params'])}")
            src = files[ep_rank]["state"].get(src_group["params"][pos])
            if src is not None:
                state[slot["params"][k]] = src
        slot.update({k: v for k, v in saved_groups(0)[gi].items() if k not in ("params", "name", "moe")})
    target["state"] = state
    optimizer.load_state_dict(target)


def _expert_sources(group_names: Sequence[str], layers: Mapping[str, Any], saved: Layout,
                    groups: Any) -> Tuple[List[Tuple[int, int]], int]:
    """For each parameter of a live expert group: (saved EP rank, position in that rank's saved group); and
    the length of the saved group."""
    assert saved.ep is not None
    now_local = {p: m.num_local_experts for p, m in layers.items()}
    old_local = {p: m.num_experts // saved.ep for p, m in layers.items()}
    if expert_param_order(group_names, now_local) != list(group_names):
        raise ValueError("the expert optimizer group is not in DeepSpeed's layer/expert/parameter order")
    old_order = {name: i for i, name in enumerate(expert_param_order(group_names, old_local))}
    out = []
    for name in group_names:
        m = EXPERT_PARAM.match(name)
        layer = layers[m["prefix"]]
        ep_rank = groups._get_expert_parallel_rank(layer.expert_group_name)
        g = global_expert_id(ep_rank, int(m["local"]), layer.num_experts, layer.ep_size)
        old_rank, old_local_id = expert_owner(g, layer.num_experts, saved.ep)
        out.append((old_rank, old_order[f"{m['prefix']}{old_local_id}.{m['suffix']}"]))
    return out, len(old_order)
