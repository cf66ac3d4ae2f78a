"""The DeepSpeed scaffolding ``moe-plugins verify --host deepspeed`` runs both sides on: a small real mpu
(:class:`GroupsMPU`), tensor-parallel experts (:class:`TensorParallelFFN`) with weights drawn per global expert,
and scopes over DeepSpeed's process state (its group registry and ``groups.mpu``; a gloo-compatible token
all-gather) that put back what was there on exit.

Shapes: M model dim, H FFN hidden (H_t = H / N_TP per rank).
"""

from __future__ import annotations

import importlib
import math
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_plugins.core import comm
from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import Group
from moe_plugins.core.layout import dp_groups, mp_groups
from moe_plugins.core.patcher import Patch, Patcher


# ---- a small real mpu and a tensor-parallel expert -----------------------------------------------------

class GroupsMPU:
    """A Megatron-style mpu over real gloo/NCCL groups: what DeepSpeed calls on ``groups.mpu`` (tensor and data
    parallel groups, ranks and sizes). Collective to build: every rank builds every group."""

    def __init__(self, world: int, tp: int):
        rank = dist.get_rank()
        self.tp = self._build("mp", mp_groups(world, tp), rank)
        self.dp = self._build("dp", dp_groups(world, tp), rank)

    @staticmethod
    def _build(kind: str, all_ranks, rank: int) -> Group:
        mine = None
        for ranks in all_ranks:
            pg = dist.new_group(list(ranks))   # real even for size 1: DeepSpeed asks it for ranks
            if rank in ranks:
                mine = Group(kind=kind, ranks=tuple(ranks), pg=pg, rank=ranks.index(rank), remote_peers=0)
        return mine

    def __deepcopy__(self, memo) -> "GroupsMPU":
        return self   # a handle on process groups: DeepSpeed's Experts deep-copies modules that hold it

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp.size

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp.rank

    def get_tensor_model_parallel_group(self):
        return self.tp.pg

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tp.ranks[0]

    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp.size

    def get_data_parallel_rank(self) -> int:
        return self.dp.rank

    def get_data_parallel_group(self):
        return self.dp.pg

    def get_data_parallel_group_ranks(self) -> List[int]:
        return list(self.dp.ranks)


class TensorParallelFFN(nn.Module):
    """An expert sharded along H over the mpu's tensor-parallel group (Megatron's column- then row-parallel
    linear): y = AllReduce(act(x @ w1_t^T + b1_t) @ w2_t^T) + b2, with the input gradient all-reduced."""

    def __init__(self, hidden: int, ffn: int, mpu: GroupsMPU, activation=F.gelu):
        super().__init__()
        if ffn % mpu.tp.size:
            raise ValueError(f"ffn ({ffn}) must be divisible by the tensor-parallel size ({mpu.tp.size})")
        self.mpu, self.activation = mpu, activation
        self.fc1 = nn.Linear(hidden, ffn // mpu.tp.size)
        self.fc2 = nn.Linear(ffn // mpu.tp.size, hidden, bias=False)
        self.b2 = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rec = Recorder(None, "tp-expert")
        x = comm.copy_to(x, self.mpu.tp, rec)
        y = comm.all_reduce(self.fc2(self.activation(self.fc1(x))), self.mpu.tp, rec)
        return y + self.b2


def make_expert(hidden: int, ffn: int, mpu: Optional[GroupsMPU], tensor_parallel: bool) -> nn.Module:
    if tensor_parallel:
        return TensorParallelFFN(hidden, ffn, mpu)
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


@torch.no_grad()
def init_experts(moe: nn.Module, seed: int, ep_rank: int, tp_rank: int, tp: int) -> None:
    """Give every global expert its own weights (DeepSpeed deep-copies one expert E_l times), drawn from
    (seed, global expert id) at full size and sliced for this tensor-parallel rank, so that every layout
    holds the same full experts."""
    local = moe.deepspeed_moe.experts.deepspeed_experts
    for j, expert in enumerate(local):
        gen = torch.Generator().manual_seed(seed * 1000003 + ep_rank * len(local) + j)
        for p in expert.parameters():
            dim = _tp_dim(expert, p)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= tp
            fan_in = shape[-1] if len(shape) > 1 else shape[0]
            full = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(fan_in)
            p.copy_(full if dim is None else full.chunk(tp, dim)[tp_rank])


def _tp_dim(expert: nn.Module, p: torch.Tensor) -> Optional[int]:
    """The dimension along which a TensorParallelFFN parameter is sharded (None: replicated)."""
    if not isinstance(expert, TensorParallelFFN):
        return None
    if p is expert.fc1.weight or p is expert.fc1.bias:
        return 0
    return 1 if p is expert.fc2.weight else None


# ---- DeepSpeed process state ---------------------------------------------------------------------------

@contextmanager
def gloo_compat() -> Iterator[None]:
    """Let stock DeepSpeed's tensor-parallel MoE path run on gloo. ``moe.mappings._gather_tokens`` passes an
    (E, c, M) input with a flat output to ``deepspeed.comm.all_gather_into_tensor``; NCCL accepts that, gloo
    (torch 2.13) raises "invalid tensor size". Flattening the input is the same collective. Patched only inside
    this context; the plugin's own collectives never need it."""
    ds_comm = importlib.import_module("deepspeed.comm")
    original = ds_comm.all_gather_into_tensor

    def all_gather_into_tensor(output_tensor, tensor, *args, **kwargs):
        if output_tensor.dim() == 1 and tensor.dim() > 1:
            tensor = tensor.contiguous().reshape(-1)
        return original(output_tensor, tensor, *args, **kwargs)

    with Patcher([Patch(ds_comm, "all_gather_into_tensor", all_gather_into_tensor)]):
        yield


@contextmanager
def deepspeed_groups(mpu: Optional[GroupsMPU]) -> Iterator[Any]:
    """DeepSpeed's group state for one model: ``groups.mpu`` set, an empty expert registry; what was there
    before is put back on exit (a pool worker runs many jobs)."""
    groups = importlib.import_module("deepspeed.utils.groups")
    names = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
             "_EXPERT_DATA_PARALLEL_GROUP_RANKS")
    # fresh, empty registries for this model; DeepSpeed's own dicts (and their contents) are put back on exit
    patches = [Patch(groups, n, {}) for n in names]
    with Patcher(patches + [Patch(groups, "mpu", mpu), Patch(groups, "expert_tensor_parallel_world_size", 1)]):
        yield groups
