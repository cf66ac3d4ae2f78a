"""The stock DeepSpeed layer as a benchmark row: ``deepspeed.moe.layer.MoE`` from the pinned DeepSpeed, run
as is (no plugin).

Made comparable with the project's layer: the same E, k, f, min_capacity, M, H, tokens and EP; the same
weights (gate and experts copied in); deterministic gating (``use_rts=False``, no second-expert
sampling, no noise), which is the semantics of ``moe_plugins.core.gating``.

Process groups: DeepSpeed would build its EP group itself (``set_deepspeed_parallelism``) in a module-level
dict keyed by ``ep_size``; the bench hands the layer the EP group of the case through DeepSpeed's own
``MOELayer._set_ep_group`` instead. The ranks are the same (contiguous blocks of EP ranks), and cases with
different layouts cannot clash in DeepSpeed's dict.

Tensor parallelism (MP > 1): DeepSpeed reads it from ``deepspeed.utils.groups.mpu`` (set by
``deepspeed.initialize(mpu=...)`` in a Megatron-DeepSpeed job) and its expert-TP degree from
``groups.expert_tensor_parallel_world_size``. The row sets both for the duration of each step, from the
case's groups, and restores them; on gloo it also views DeepSpeed's flat all-gather buffer the way gloo
requires (:func:`_gloo_all_gather`, same bytes). With ESP > 1 DeepSpeed expects the user's expert module to be tensor
parallel; :class:`TensorParallelExpert` is that module (column-parallel fc1, row-parallel fc2).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.patches.deepspeed_host import init_deepspeed_comm
from moe_plugins.core import comm
from moe_plugins.core.comm import Recorder
from moe_plugins.core.experts import ffn_shard, local_experts
from moe_plugins.core.groups import Group
from moe_plugins.tools.bench.matrix import RowSpec
from moe_plugins.tools.bench.case import CaseData, Row
from moe_plugins.tools.bench.traffic import CollectiveCounter


class _Mpu:
    """DeepSpeed's ``mpu`` protocol (the subset its MoE code calls), answered from the case's MP group."""

    def __init__(self, mp: Group, dp: Group):
        self._mp, self._dp = mp, dp

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._mp.size

    def get_tensor_model_parallel_rank(self) -> int:
        return self._mp.rank

    def get_tensor_model_parallel_group(self):
        return self._mp.pg

    def get_data_parallel_world_size(self) -> int:
        return self._dp.size

    def get_data_parallel_rank(self) -> int:
        return self._dp.rank

    def get_data_parallel_group(self):
        return self._dp.pg


def _gloo_all_gather(original):
    """DeepSpeed's ``_gather_tokens`` hands a flat output buffer to ``all_gather_into_tensor`` (NCCL accepts
    it); gloo checks each output chunk against the input's shape. Same buffer, viewed as [world*d0, ...]."""
    def gather(output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.dim() == 1 and input_tensor.dim() > 1:
            output_tensor = output_tensor.view((-1,) + tuple(input_tensor.shape[1:]))
        return original(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)
    return gather


@contextlib.contextmanager
def tensor_parallel_scope(mpu, expert_tp: int) -> Iterator[None]:
    """For one step: set DeepSpeed's TP globals (``groups.mpu``, ``expert_tensor_parallel_world_size``) and,
    with MP > 1, make its token all-gather gloo-compatible; restore everything on exit."""
    from deepspeed.comm import comm as ds_comm
    from deepspeed.utils import groups
    patches = [Patch(groups, "mpu", mpu), Patch(groups, "expert_tensor_parallel_world_size", expert_tp)]
    if mpu is not None:
        patches.append(Patch(ds_comm.cdb, "all_gather_function", _gloo_all_gather(ds_comm.cdb.all_gather_function)))
    with Patcher(patches):
        yield


class TensorParallelExpert(nn.Module):
    """One expert's shard along H, Megatron style: identity/all-reduce around a column-parallel fc1 and a
    row-parallel fc2 over the ESP group. This is the user-supplied expert DeepSpeed's expert tensor
    parallelism expects."""

    def __init__(self, hidden: int, ffn_shard_size: int, esp: Group):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_shard_size)
        self.fc2 = nn.Linear(ffn_shard_size, hidden, bias=False)
        self.b2 = nn.Parameter(torch.zeros(hidden))
        self.esp, self.rec = esp, Recorder(None, "deepspeed-expert")

    def __deepcopy__(self, memo) -> "TensorParallelExpert":
        # DeepSpeed's Experts deep-copies the expert per local expert; the process group is shared, not copied
        twin = TensorParallelExpert(self.fc1.in_features, self.fc1.out_features, self.esp)
        twin.load_state_dict(self.state_dict())
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = comm.copy_to(x, self.esp, self.rec)
        return comm.all_reduce(self.fc2(F.gelu(self.fc1(x))), self.esp, self.rec) + self.b2


def _expert_module(data: CaseData) -> nn.Module:
    case, esp = data.case, data.groups.esp
    if esp.size == 1:
        return nn.Sequential(nn.Linear(case.hidden, case.ffn), nn.GELU(), nn.Linear(case.ffn, case.hidden))
    return TensorParallelExpert(case.hidden, case.ffn // esp.size, esp)


@torch.no_grad()
def _load(moe: nn.Module, data: CaseData) -> None:
    """Copy the case's gate and this rank's expert shard into DeepSpeed's modules."""
    g, case = data.groups, data.case
    coords = g.layout.coords(g.global_rank)
    moe.deepspeed_moe.gate.wg.weight.copy_(data.wg_EM)
    experts = range(case.experts)[local_experts(coords["ep"], case.experts, g.ep.size)]
    h = ffn_shard(coords["esp"], case.ffn, g.esp.size)
    for module, e in zip(moe.deepspeed_moe.experts.deepspeed_experts, experts):
        fc1, fc2 = (module.fc1, module.fc2) if g.esp.size > 1 else (module[0], module[2])
        fc1.weight.copy_(data.full.w1_EMH[e][:, h].t())
        fc1.bias.copy_(data.full.b1_EH[e][h])
        fc2.weight.copy_(data.full.w2_EHM[e][h, :].t())
        (module.b2 if g.esp.size > 1 else fc2.bias).copy_(data.full.b2_EM[e])


def deepspeed_layout_problems(data: CaseData) -> list:
    g = data.groups
    if g.esp.size not in (1, g.mp.size):
        return [f"esp ({g.esp.size}) must be 1 or equal to mp ({g.mp.size}): DeepSpeed shards experts over "
                f"the tensor-parallel group"]
    return []


def stock_moe(data: CaseData) -> nn.Module:
    """DeepSpeed's MoE layer for the case, as the ``deepspeed`` row runs it: deterministic gating, the case's gate
    and this rank's expert shard copied in, in the case's dtype. Its EP group is not set yet (the stock row
    hands it the case's; the adapter row lets the adapter build and register its own)."""
    problems = deepspeed_layout_problems(data)
    if problems:
        raise ValueError("deepspeed row: " + "; ".join(problems))
    init_deepspeed_comm()
    from deepspeed.moe.layer import MoE
    case, g = data.case, data.groups
    moe = MoE(hidden_size=case.hidden, expert=_expert_module(data), num_experts=case.experts, ep_size=g.ep.size,
              k=case.k, capacity_factor=case.capacity_factor, eval_capacity_factor=case.capacity_factor,
              min_capacity=case.min_capacity, drop_tokens=case.drop_tokens, use_rts=False,
              enable_expert_tensor_parallelism=g.esp.size > 1, top2_2nd_expert_sampling=False)
    _load(moe, data)
    return moe.to(data.dtype)


def case_mpu(data: CaseData):
    """DeepSpeed's ``mpu`` for the case (None without tensor parallelism)."""
    g = data.groups
    return _Mpu(g.mp, g.dp) if g.mp.size > 1 else None


def moe_forward(moe: nn.Module, x_SM: torch.Tensor):
    """``deepspeed.moe.layer.MoE`` called as a model calls it: (output, aux loss)."""
    y_SM, aux, _ = moe(x_SM)
    return y_SM, aux


def build_deepspeed_row(spec: RowSpec, data: CaseData) -> Row:
    g = data.groups
    moe = stock_moe(data)
    moe.deepspeed_moe._set_ep_group(g.ep.pg)
    mpu = case_mpu(data)
    return Row(label=spec.label, kind="stock", module=moe, forward=partial(moe_forward, moe),
               meter=CollectiveCounter(layout=g.layout, rank=g.global_rank),
               scope=lambda: tensor_parallel_scope(mpu, g.esp.size))
