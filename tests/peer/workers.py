# Ported from DeepSpeed (https://github.com/deepspeedai/DeepSpeed): tests/unit/v1/moe/test_moe.py,
# tests/unit/v1/moe/test_moe_tp.py and the models/data of tests/unit/simple_model.py.
# Copyright (c) Microsoft Corporation. SPDX-License-Identifier: Apache-2.0 (the original test logic).
# Changed for this port: DeepSpeed's per-test process spawning (unit.common.DistributedTest) is replaced by this
# repo's gloo pool (tests/conftest.py ``world``); fp32 instead of fp16, torch Adam instead of fused/CUDA Adam;
# every job runs stock or with the moe_plugins DeepSpeed adapter on, and returns what the test compares.
"""Pool jobs for tests/peer/test_ds_moe*.py: DeepSpeed's own MoE unit tests, each run stock (``mode="stock"``) or
with the plugin enabled through ``moe_plugins.enable(ds_config)`` (the other keys of :data:`SECTIONS`).

A job that the plugin refuses at ``deepspeed.initialize`` returns ``{"refused": message}`` (the refusal is raised
on every rank before any group is built, so the pool stays usable)."""

from __future__ import annotations

import gc
from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugins.core.ledger import CommLedger
from moe_plugins.tools.verify_deepspeed import deepspeed_groups, gloo_compat, init_deepspeed_comm

DS_TESTS = "tests/unit/v1/moe"
DS_REV = "70211f41"      # the DeepSpeed revision the tests were read from (installed DeepSpeed: 0.19.8)

# mode -> the ds_config "moe_plugins" section (None: stock DeepSpeed, the plugin not enabled)
SECTIONS: Dict[str, Optional[Dict[str, Any]]] = {
    "stock": None,
    "baseline": {"schedule": "baseline", "pipeline_degree": 1},
    "baseline-r2": {"schedule": "baseline", "pipeline_degree": 2},
    "parm-s2": {"schedule": "parm-s2", "pipeline_degree": 1},
}

REFUSAL = "moe_plugins cannot run DeepSpeed MoE layer"
SEED = 11


# ---- DeepSpeed's test models and data (tests/unit/simple_model.py), fp32 on CPU ------------------------

class SimpleMoEModel(nn.Module):
    """simple_model.SimpleMoEModel: two top-1 MoE layers (sharing one expert template) around dense layers."""

    def __init__(self, hidden_dim: int, num_experts: int = 4, ep_size: int = 1, use_residual: bool = False,
                 use_rts: bool = True):
        from deepspeed.moe.layer import MoE
        super().__init__()
        self.linear1 = nn.Linear(hidden_dim, hidden_dim)
        expert = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.Linear(hidden_dim, hidden_dim))
        self.moe_1 = MoE(hidden_size=hidden_dim, expert=expert, ep_size=ep_size, use_residual=use_residual,
                         num_experts=num_experts, k=1, use_rts=use_rts)
        self.linear2 = nn.Linear(hidden_dim, hidden_dim)
        self.moe_2 = MoE(hidden_size=hidden_dim, expert=expert, ep_size=ep_size, use_residual=use_residual,
                         num_experts=num_experts, k=1, use_rts=use_rts)
        self.linear3 = nn.Linear(hidden_dim, hidden_dim)
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        hidden_dim = self.linear1(x)
        output, _, _ = self.moe_1(hidden_dim)
        output = self.linear2(output)
        output, _, _ = self.moe_2(output)
        output = self.linear3(output)
        hidden_dim = hidden_dim + output
        return self.cross_entropy_loss(hidden_dim.mean(1), y)


class SimplePRMoEModel(nn.Module):
    """simple_model.SimplePRMoEModel: two MoE layers of Linear experts, the second with twice the experts."""

    def __init__(self, hidden_dim: int, num_experts: int = 2, ep_size: int = 1, use_residual: bool = False):
        from deepspeed.moe.layer import MoE
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)
        self.linear2 = MoE(hidden_size=hidden_dim, expert=nn.Linear(hidden_dim, hidden_dim), ep_size=ep_size,
                           use_residual=use_residual, num_experts=num_experts, k=1)
        self.linear3 = MoE(hidden_size=hidden_dim, expert=nn.Linear(hidden_dim, hidden_dim), ep_size=ep_size,
                           use_residual=use_residual, num_experts=int(2 * num_experts), k=1)
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        hidden_dim = self.linear(x)
        output, _, _ = self.linear2(hidden_dim)
        output, _, _ = self.linear3(output)
        hidden_dim = hidden_dim + output
        return self.cross_entropy_loss(hidden_dim.mean(1), y)


def sequence_dataloader(batch_size: int, total_samples: int, hidden_dim: int, seed: int, seq_len: int = 32):
    """simple_model.sequence_dataloader, fp32, drawn from a generator (each rank its own data, as there)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(total_samples, seq_len, hidden_dim, generator=gen)
    label = torch.randint(0, hidden_dim, (total_samples,), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, label), batch_size=batch_size)


# ---- harness -------------------------------------------------------------------------------------------

@contextmanager
def host(mode: str, ledger: Optional[CommLedger] = None) -> Iterator[Any]:
    """DeepSpeed's comm on the pool's gloo group, a fresh expert-group registry (DistributedTest gives each test
    a fresh process), and the plugin enabled for ``mode`` (its ds_config section); yields the plugin handle."""
    import moe_plugins
    init_deepspeed_comm()
    with ExitStack() as stack:
        stack.enter_context(deepspeed_groups(None))
        section = SECTIONS[mode]
        yield (stack.enter_context(moe_plugins.enable({"moe_plugins": section}, ledger=ledger))
               if section is not None else None)


def with_section(config: Dict[str, Any], mode: str) -> Dict[str, Any]:
    section = SECTIONS[mode]
    return dict(config, moe_plugins=section) if section is not None else dict(config)


def initialize(config: Dict[str, Any], mode: str, model: nn.Module, **kwargs):
    """``deepspeed.initialize``; a plugin refusal comes back as ``{"refused": message}``."""
    import deepspeed
    try:
        engine, optimizer, _, _ = deepspeed.initialize(config=with_section(config, mode), model=model, **kwargs)
    except ValueError as exc:
        if SECTIONS[mode] is not None and REFUSAL in str(exc):
            return None, {"refused": str(exc)}
        raise
    return (engine, optimizer), None


def swaps(plugin) -> List[Dict[str, Any]]:
    return [] if plugin is None else [dict(s) for s in plugin.swaps]


def train(engine, loader, collect: bool = False) -> List[float]:
    losses = []
    for batch in loader:
        loss = engine(batch[0], batch[1])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if collect:
            gc.collect()      # DeepSpeed's TestMoE: "Must do this or we get a memory leak in this test"
    return losses


def train_to_end(engine, total_samples: int, hidden_dim: int, plugin) -> Dict[str, Any]:
    """DeepSpeed's tests' training loop on their sequence data, then the engine destroyed: losses and swaps."""
    loader = sequence_dataloader(engine.train_micro_batch_size_per_gpu(), total_samples, hidden_dim,
                                 SEED + dist.get_rank())
    losses = train(engine, loader)
    engine.destroy()
    return {"losses": losses, "swaps": swaps(plugin)}


# ---- test_moe.py::TestSimpleMoE ------------------------------------------------------------------------

def simple_moe(mode: str, zero_stage: int, total_samples: int) -> Dict[str, Any]:
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "torch_adam": True}},
              "zero_optimization": {"stage": zero_stage}}
    hidden_dim = 16
    with host(mode) as plugin:
        torch.manual_seed(SEED)
        model = SimpleMoEModel(hidden_dim=hidden_dim, ep_size=1)
        made, refused = initialize(config, mode, model)
        if refused:
            return refused
        return train_to_end(made[0], total_samples, hidden_dim, plugin)


# ---- test_moe.py::TestMoE (the strict average_tensor check) --------------------------------------------

def moe_ep(mode: str, ep_size: int, zero_stage: int, use_residual: bool, total_samples: int) -> Dict[str, Any]:
    from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1, "zero_optimization": {"stage": zero_stage}}
    hidden_dim = 16
    with host(mode) as plugin:
        torch.manual_seed(SEED)
        model = SimpleMoEModel(hidden_dim, ep_size=ep_size, use_residual=use_residual)
        param_group = {"params": [p for p in model.parameters()], "name": "random-unique-name"}
        params = split_params_into_different_moe_groups_for_optimizer(param_group)
        made, refused = initialize(config, mode, model, optimizer=torch.optim.AdamW(params=params),
                                   dist_init_required=False)
        if refused:
            return refused
        engine, optimizer = made
        loader = sequence_dataloader(engine.train_micro_batch_size_per_gpu(), total_samples, hidden_dim,
                                     SEED + dist.get_rank())
        checked = {"calls": 0, "slices": 0, "moe_buckets": 0}

        def strict_average_tensor(tensor, communication_data_type: torch.dtype):
            # DeepSpeed's check: every slice reduced in one call belongs to parameters of one process group
            curr_size, pg_offsets = 0, []
            ipg_bucket = optimizer.ipg_buckets[communication_data_type]
            checked["calls"] += 1
            checked["moe_buckets"] += int(bool(ipg_bucket.has_moe_params))
            for i, param_idx, param_id in ipg_bucket.params:
                param = optimizer.bit16_groups[i][param_idx]
                process_group = optimizer.dp_process_group
                if ipg_bucket.has_moe_params:
                    process_group = optimizer.expert_dp_process_group[param.group_name] if is_moe_param(
                        param) else optimizer.dp_process_group
                partition_ids = optimizer.param_to_partition_ids[i][param_id]
                partition_offsets = sorted(optimizer.grad_start_offset[i][pid][param_id] for pid in partition_ids)
                for idx, offset in enumerate(partition_offsets):
                    numel = (param.numel() - offset if idx == len(partition_offsets) - 1
                             else partition_offsets[idx + 1] - offset)
                    pg_offsets.append((curr_size, process_group))
                    curr_size += numel

            def strict_narrow(dim, start, length):
                lo, hi = 0, len(pg_offsets) - 1
                while lo < hi:
                    mi = lo + (hi - lo) // 2
                    if pg_offsets[mi][0] >= start:
                        hi = mi
                    else:
                        lo = mi + 1
                curr_slice, reduce_process_group = lo, pg_offsets[lo][1]
                while curr_slice < len(pg_offsets) and start + length > pg_offsets[curr_slice][0]:
                    assert reduce_process_group == pg_offsets[curr_slice][1], \
                        "reduce process_group does not match the parameter's process_group"
                    curr_slice += 1
                checked["slices"] += 1
                return orig_narrow(dim, start, length)

            orig_narrow, tensor.narrow = tensor.narrow, strict_narrow
            type(optimizer).average_tensor(optimizer, tensor, communication_data_type)
            tensor.narrow = orig_narrow

        if "average_tensor" in dir(optimizer):
            optimizer.average_tensor = strict_average_tensor
        losses = train(engine, loader, collect=True)
        engine.destroy()
        return {"losses": losses, "strict": checked, "swaps": swaps(plugin)}


# ---- test_moe.py::TestPRMoE ----------------------------------------------------------------------------

def prmoe(mode: str, ep_size: int, use_residual: bool, total_samples: int) -> Dict[str, Any]:
    config = {"train_batch_size": 8, "steps_per_print": 1}
    hidden_dim = 16
    with host(mode) as plugin:
        torch.manual_seed(SEED)
        model = SimplePRMoEModel(hidden_dim, ep_size=ep_size, use_residual=use_residual)
        made, refused = initialize(config, mode, model, optimizer=torch.optim.AdamW(params=model.parameters()),
                                   dist_init_required=False)
        if refused:
            return refused
        return train_to_end(made[0], total_samples, hidden_dim, plugin)


# ---- test_moe.py::TestMoESingleton::test_all_to_all ----------------------------------------------------

def all_to_all_count(mode: str, ep_size: int) -> Dict[str, Any]:
    """DeepSpeed's test counts ``sharded_moe._AllToAll.apply`` calls (replaced by the identity). With the plugin on,
    the same replacement is installed and counted too, and the plugin's own exchanges are read from its ledger."""
    import deepspeed.moe.sharded_moe as sharded_moe
    from deepspeed.moe.layer import MoE
    from moe_plugins.core.patcher import Patch, Patcher
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1}
    hidden_dim = 8
    ledger = CommLedger()
    with host(mode, ledger) as plugin:
        torch.manual_seed(SEED)
        expert = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.Linear(hidden_dim, hidden_dim))
        model = MoE(hidden_size=hidden_dim, expert=expert, num_experts=2, ep_size=ep_size, k=1, min_capacity=0)
        made, refused = initialize(config, mode, model, optimizer=torch.optim.AdamW(params=model.parameters()),
                                   dist_init_required=False)
        if refused:
            return refused
        engine, _ = made
        calls: List[Any] = []

        def counted_all_to_all(group, input):
            calls.append((group, tuple(input.shape)))
            return input

        ledger.clear()
        with Patcher([Patch(sharded_moe._AllToAll, "apply", counted_all_to_all)]):
            x = torch.randn(1, 4, hidden_dim, requires_grad=True)
            output, l_aux, _ = engine(x)
            after_forward = len(calls)
            ledger_forward = [r.op for r in ledger.records if r.phase == "forward"]
            engine.backward(output.float().sum() + l_aux.float())
            after_backward = len(calls)
        result = {"after_forward": after_forward, "after_backward": after_backward,
                  "ledger_forward": ledger_forward,
                  "ledger_backward": [r.op for r in ledger.records if r.phase == "backward"],
                  "x_grad": x.grad is not None,
                  "param_grad": any(p.grad is not None for p in engine.module.parameters()),
                  "swaps": swaps(plugin)}
        engine.destroy()
        return result


# ---- test_moe.py::TestMoESingleton::test_capacity, and the dropless-capacity collectives ---------------

def identity_gate(num_experts: int, k: int, **kw):
    """A TopKGate whose logits are its input (wg = I): the plugin's router then sees the test's logits."""
    from deepspeed.moe.sharded_moe import TopKGate
    gate = TopKGate(num_experts, num_experts, k=k, **kw)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.eye(num_experts))
    return gate


def capacity_collectives(mode: str, gate_name: str, ep_world_size: int) -> Dict[str, Any]:
    """Counts ``deepspeed.comm.all_reduce`` calls (``sharded_moe.dist`` is that module) made while one dropless
    gating call runs on 8 tokens x 4 experts: stock calls DeepSpeed's gating function; with the plugin on, the
    plugin's router (``deepspeed_layer.gate_router``, the fast gate where it applies) on a TopKGate whose logits
    are the same 8 x 4 values."""
    import deepspeed.comm as ds_dist
    import deepspeed.moe.sharded_moe as sharded_moe
    from moe_plugins.core.patcher import Patch, Patcher
    init_deepspeed_comm()
    if ep_world_size == 1:
        ep_group = None
        for rank in range(ds_dist.get_world_size()):
            group = ds_dist.new_group([rank])
            if rank == ds_dist.get_rank():
                ep_group = group
    else:
        ep_group = ds_dist.new_group(list(range(ds_dist.get_world_size())))
    calls: List[Any] = []
    original_all_reduce = sharded_moe.dist.all_reduce

    def counted_all_reduce(tensor, op=ds_dist.ReduceOp.SUM, group=None, **kwargs):
        calls.append((op, group))
        return original_all_reduce(tensor, op=op, group=group, **kwargs)

    k, capacity_args = {"top1": (1, (1, 0)), "top2": (2, (1, 0)), "topk": (3, (3, 1, 0))}[gate_name]
    if SECTIONS[mode] is not None:      # built before the draws: its init must not shift the gate's random draws
        gate = identity_gate(4, k, capacity_factor=1.0, min_capacity=0, drop_tokens=False, ep_group=ep_group)
    torch.manual_seed(SEED + dist.get_rank())
    logits = torch.randn(8, 4)
    with Patcher([Patch(sharded_moe.dist, "all_reduce", counted_all_reduce)]):
        if SECTIONS[mode] is None:
            gate_fn = {"top1": sharded_moe.top1gating, "top2": sharded_moe.top2gating,
                       "topk": sharded_moe.topkgating}[gate_name]
            out = gate_fn(logits, *capacity_args, drop_tokens=False, ep_group=ep_group)
            capacity = int(out[2].shape[-1])
        else:
            from moe_plugins.patches.deepspeed_layer import gate_router
            capacity = int(gate_router(gate, None, logits).capacity)
    max_ops = [op == ds_dist.ReduceOp.MAX for op, _ in calls]
    return {"calls": len(calls), "max": max_ops, "group_is_ep": [g is ep_group for _, g in calls],
            "capacity": capacity}


def gate_collectives_without_ep_group(mode: str) -> Dict[str, Any]:
    """TestMoESingleton::test_no_ep_group: top-2, dropless, ep_group None must make no collective (DeepSpeed's
    ``get_world_size`` and ``all_reduce`` raise). Stock: ``top2gating``; plugin: its router on a TopKGate."""
    import deepspeed.moe.sharded_moe as sharded_moe
    from moe_plugins.core.patcher import Patch, Patcher

    def fail_collective(*args, **kwargs):
        raise AssertionError("ep_group=None should not enter expert-parallel collective code")

    logits = torch.randn(8, 4)
    with Patcher([Patch(sharded_moe.dist, "get_world_size", fail_collective),
                  Patch(sharded_moe.dist, "all_reduce", fail_collective)]):
        if SECTIONS[mode] is None:
            out = sharded_moe.top2gating(logits, 1, 0, drop_tokens=False, ep_group=None,
                                         top2_2nd_expert_sampling=False)
            return {"capacity": int(out[2].shape[-1]), "routed": int(out[2].sum())}
        from moe_plugins.patches.deepspeed_layer import gate_router
        gate = identity_gate(4, 2, capacity_factor=1.0, min_capacity=0, drop_tokens=False,
                             top2_2nd_expert_sampling=False)
        routing = gate_router(gate, None, logits)
        return {"capacity": int(routing.capacity), "routed": int((routing.slot_SK >= 0).sum())}


# ---- test_moe.py::TestExpertWeightGradWithZero ---------------------------------------------------------

def expert_grad_with_zero(mode: str, zero_stage: int) -> Dict[str, Any]:
    import random

    import deepspeed
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.1, "torch_adam": True}},
              "zero_optimization": {"stage": zero_stage}}
    hidden_dim, total_samples = 4, 2
    rank = dist.get_rank()

    def state_dict_ep2(state_dict):
        """convert state_dict from EP=1 to EP=2 (this rank's expert becomes local expert 0)"""
        out = {}
        dst, src = "deepspeed_moe.experts.deepspeed_experts.0", f"deepspeed_moe.experts.deepspeed_experts.{rank}"
        for moe_layer in ("moe_1", "moe_2"):
            for mlp in (0, 1):
                for what in ("weight", "bias"):
                    out[f"{moe_layer}.{dst}.{mlp}.{what}"] = state_dict[f"{moe_layer}.{src}.{mlp}.{what}"].clone()
        out.update({k: v.clone() for k, v in state_dict.items() if "deepspeed_moe.experts.deepspeed_experts" not in k})
        return out

    def expert_grads(engine, expert_id):
        out = []
        for layer in (engine.module.moe_1, engine.module.moe_2):
            expert = layer.deepspeed_moe.experts.deepspeed_experts[expert_id]
            for p in (expert[0].weight, expert[0].bias, expert[1].weight, expert[1].bias):
                out.append(deepspeed.utils.safe_get_full_grad(p).detach().clone())
        return out

    with host(mode) as plugin:
        random.seed(SEED)
        torch.manual_seed(SEED)
        model_ep1 = SimpleMoEModel(hidden_dim=hidden_dim, num_experts=2, ep_size=1, use_rts=False)
        model_ep2 = SimpleMoEModel(hidden_dim=hidden_dim, num_experts=2, ep_size=2, use_rts=False)
        model_ep2.load_state_dict(state_dict_ep2(model_ep1.state_dict()))
        made1, refused = initialize(config, mode, model_ep1)
        if refused:
            return refused
        made2, refused = initialize(config, mode, model_ep2)
        if refused:
            return refused
        (engine1, _), (engine2, _) = made1, made2
        loader = sequence_dataloader(engine1.train_micro_batch_size_per_gpu(), total_samples, hidden_dim,
                                     SEED + rank)
        grads_ep1: List[torch.Tensor] = []
        grads_ep2: List[torch.Tensor] = []
        losses = []
        for batch in loader:
            loss1, loss2 = engine1(batch[0], batch[1]), engine2(batch[0], batch[1])
            engine1.backward(loss1)
            engine2.backward(loss2)
            grads_ep1.extend(expert_grads(engine1, rank))
            grads_ep2.extend(expert_grads(engine2, 0))
            engine1.step()
            engine2.step()
            losses.append((float(loss1), float(loss2)))
        engine1.destroy()
        engine2.destroy()
        return {"grads_ep1": grads_ep1, "grads_ep2": grads_ep2, "losses": losses, "swaps": swaps(plugin)}


# ---- test_moe_tp.py::TestMOETensorParallel -------------------------------------------------------------

class MPU:
    """test_moe_tp.MPU: contiguous tensor-parallel blocks, strided data-parallel groups."""

    def __init__(self, tp_world_size: int):
        import deepspeed.comm as ds_dist
        self.rank, self.world_size, self.tp_world_size = ds_dist.get_rank(), ds_dist.get_world_size(), tp_world_size
        for i in range(0, self.world_size, tp_world_size):
            ranks = range(i, i + tp_world_size)
            group = ds_dist.new_group(ranks)
            if self.rank in ranks:
                self.tp_group = group
        for i in range(0, tp_world_size):
            ranks = range(i, self.world_size, tp_world_size)
            group = ds_dist.new_group(ranks)
            if self.rank in ranks:
                self.dp_group = group

    def get_model_parallel_rank(self):
        return self.rank % self.tp_world_size

    def get_model_parallel_world_size(self):
        return self.tp_world_size

    def get_data_parallel_rank(self):
        return self.rank // self.tp_world_size

    def get_data_parallel_world_size(self):
        return self.world_size // self.tp_world_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_model_parallel_group(self):
        return self.tp_group


def moe_tp(mode: str, ep_size: int, tp_size: int, enable_expert_tp: bool, use_residual: bool) -> Dict[str, Any]:
    """DeepSpeed's checks after ``deepspeed.initialize`` under an mpu, plus (added here) one forward and backward
    on the same tokens in every tensor-parallel rank, returned for comparison with stock."""
    import deepspeed
    from deepspeed.moe.layer import MoE
    config = {"train_batch_size": 8, "steps_per_print": 1}
    hidden_dim = 16
    with host(mode) as plugin, gloo_compat():       # gloo_compat: stock expert-TP token gather on gloo
        world_size = deepspeed.comm.get_world_size()
        torch.manual_seed(SEED)
        expert = nn.Sequential(nn.Linear(hidden_dim, 4 * hidden_dim // tp_size), nn.ReLU(),
                               nn.Linear(4 * hidden_dim // tp_size, hidden_dim))
        model = MoE(hidden_size=hidden_dim, expert=expert, num_experts=world_size, ep_size=ep_size,
                    use_residual=use_residual, enable_expert_tensor_parallelism=enable_expert_tp)
        made, refused = initialize(config, mode, model, optimizer=torch.optim.AdamW(params=model.parameters()),
                                   dist_init_required=False, mpu=MPU(tp_size))
        if refused:
            return refused
        engine, _ = made
        result = {"num_local_experts": engine.num_local_experts,
                  "expert_mp_world_size": deepspeed.utils.groups._get_expert_model_parallel_world_size(),
                  "swaps": swaps(plugin)}
        # added: the layer's forward/backward (tokens identical across each tensor-parallel group, as under TP)
        gen = torch.Generator().manual_seed(SEED + dist.get_rank() // tp_size)
        x = torch.randn(2, 8, hidden_dim, generator=gen, requires_grad=True)
        torch.manual_seed(SEED + 1)
        output, l_aux, _ = engine(x)
        engine.backward((output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum() + l_aux)
        result.update(output=output.detach(), x_grad=x.grad.detach(), l_aux=float(l_aux))
        engine.destroy()
        return result


# ---- test_moe.py::TestTopkGate::test -------------------------------------------------------------------

def topkgating_drop_policies() -> Dict[str, bool]:
    """DeepSpeed's fixed logits (scaled by rank + 1) and its expected dispatch entries (token, expert, slot) for
    top-k gating with drop_policy 'probs' and 'position', and dropless; True where the mask matches."""
    from deepspeed.moe.sharded_moe import topkgating
    init_deepspeed_comm()
    scale = dist.get_rank() + 1

    def equal(logits, cap, sparse_truth, res):
        truth = torch.zeros(*logits.shape, cap)
        i, j, k = torch.tensor(sparse_truth).t()
        truth[i, j, k] = 1
        return bool(torch.equal(truth, res))

    # s=4 e=4 topk=2 cap=2
    logits = torch.tensor([[0.11, 0.2, 0.1, 0.3], [0.3, 0.4, 0.11, 0.1], [0.11, 0.1, 0.6, 0.5],
                           [0.1, 0.11, 0.7, 0.8]]) * scale
    out = {"probs_k2": equal(logits, 2, [[0, 1, 0], [1, 0, 0], [1, 1, 1], [2, 2, 0], [2, 3, 0], [3, 2, 1], [3, 3, 1]],
                             topkgating(logits, 2, 1, min_capacity=1, drop_policy="probs")[2]),
           "position_k2": equal(logits, 2, [[0, 1, 0], [0, 3, 0], [1, 0, 0], [1, 1, 1], [2, 2, 0], [2, 3, 1],
                                            [3, 2, 1]],
                                topkgating(logits, 2, 1, min_capacity=1, drop_policy="position")[2])}
    # s=4 e=6 topk=3 cap=2
    logits2 = torch.tensor([[0.5858, 0.4801, 0.6269, 0.5397, 0.9722, 0.7034],
                            [0.5445, 0.6332, 0.4519, 0.6308, 0.0519, 0.6450],
                            [0.4874, 0.8110, 0.7467, 0.8474, 0.0277, 0.3068],
                            [0.8570, 0.6714, 0.5310, 0.3274, 0.4836, 0.9892]]) * scale
    out["probs_k3"] = equal(logits2, 2, [[0, 2, 0], [0, 4, 0], [1, 1, 0], [1, 3, 0], [1, 5, 0], [2, 1, 1], [2, 2, 1],
                                         [2, 3, 1], [3, 0, 0], [3, 5, 1]],
                            topkgating(logits2, 3, 1, min_capacity=1, drop_policy="probs")[2])
    out["position_k3"] = equal(logits2, 2, [[0, 2, 0], [0, 4, 0], [0, 5, 0], [1, 1, 0], [1, 3, 0], [1, 5, 1],
                                            [2, 1, 1], [2, 2, 1], [2, 3, 1], [3, 0, 0]],
                               topkgating(logits2, 3, 1, min_capacity=1, drop_policy="position")[2])
    # s=4 e=4 topk=2 drop_tokens=False
    logits3 = torch.tensor([[0.95, 0.85, 0.90, 0.80], [0.70, 0.65, 0.75, 0.60], [0.50, 0.55, 0.45, 0.40],
                            [0.35, 0.30, 0.25, 0.20]]) * scale
    out["dropless"] = equal(logits3, 4, [[0, 0, 0], [0, 2, 0], [1, 0, 1], [1, 2, 1], [2, 0, 2], [2, 1, 0], [3, 0, 3],
                                         [3, 1, 1]],
                            topkgating(logits3, 2, 1, min_capacity=1, drop_tokens=False)[2])
    return out
