"""``moe-plugins verify --host deepspeed``: the plugin against DeepSpeed's stock MoE layer, same process groups.

Every rank builds a ``deepspeed.moe.layer.MoE`` twice from the same weights: once stock, once with the plugin
enabled. Both run forward and backward on the same token block with the same upstream gradient, and with the same
RNG state before the forward, so the stock gate and the plugin (which keeps DeepSpeed's gate) draw the same
random numbers (RTS, jitter, top-2 sampling). Rank 0 compares outputs, input gradients, dense parameter
gradients by name, expert gradients by global expert id (each summed over its expert-DP group, as DeepSpeed
reduces it), the aux loss and the routing statistics (expert counts, capacity, dropped routes).

With ``--mp N`` an mpu with tensor parallelism N is installed (:class:`GroupsMPU`); ``--esp N`` (= mp) turns on
``enable_expert_tensor_parallelism`` with tensor-parallel experts (:class:`TensorParallelFFN`); both live in
``verify_deepspeed_host``. ``--esp N`` with
``--mp 1`` is a layout DeepSpeed cannot express: the plugin (section ``esp``) slices DeepSpeed's FFN experts
over ESP, and is compared with stock DeepSpeed at the same EP without ESP. So is ``--esp N --mp N
--no-expert-tp`` (the Parm paper's ESP = MP, for a user who turns DeepSpeed's expert tensor parallelism off
and lets the plugin slice the experts): compared with stock DeepSpeed under the same mpu without expert TP.

Shapes: S tokens, M model dim, H FFN hidden (H_t = H / N_TP per rank), E experts.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugins.core.layout import ParallelLayout, layout_problems
from moe_plugins.core.ledger import CommLedger
from moe_plugins.core.plugin_config import PluginConfig
from moe_plugins.core.schedule import exchange_problems
from moe_plugins.patches.deepspeed_host import init_deepspeed_comm
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify import AUX_COEF, DTYPES, TOLERANCE, VerifySpec, make_problem
# the scaffolding both sides run on (re-exported: the test workers and docs name them here)
from moe_plugins.tools.verify_deepspeed_host import (GroupsMPU, TensorParallelFFN, deepspeed_groups, gloo_compat,
                                                     init_experts, make_expert)

__all__ = ["DeepSpeedVerifySpec", "GroupsMPU", "TensorParallelFFN", "collect_rank", "deepspeed_capacity",
           "deepspeed_groups", "gloo_compat", "host_spec_problems", "init_deepspeed_comm", "init_experts",
           "make_expert", "report", "run_rank", "run_side"]


@dataclass(frozen=True, kw_only=True)
class DeepSpeedVerifySpec(VerifySpec):
    """VerifySpec plus the stock gate's random options (DeepSpeed's defaults are rts on, top-2 sampling on)."""

    rts: bool = False
    jitter: bool = False
    top2_sampling: bool = False
    expert_tp: bool = True      # esp = mp > 1: DeepSpeed's expert TP; False: the plugin slices plain FFN experts


def deepspeed_capacity(tokens: int, experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed 0.19's ``_capacity``: ceil(S / E * f * k), at least min_capacity (k folded into f as it does)."""
    return max(int(math.ceil(tokens / experts * (capacity_factor * k))), min_capacity)


def host_spec_problems(spec: DeepSpeedVerifySpec) -> List[str]:
    """Every reason this spec cannot be run by stock DeepSpeed and the plugin side by side."""
    problems = layout_problems(spec.world, spec.ranks_per_node, spec.mp, spec.ep, spec.esp)
    if problems:
        return problems
    if not spec.expert_tp and not (spec.mp > 1 and spec.esp == spec.mp):
        problems.append(f"expert_tp (False) only applies with esp ({spec.esp}) = mp ({spec.mp}) > 1")
    if spec.mp > 1 and spec.esp not in (1, spec.mp):
        problems.append(f"esp ({spec.esp}) must be 1 or mp ({spec.mp}) when mp > 1: esp = mp compares DeepSpeed's "
                        "expert tensor parallelism; esp > 1 with mp = 1 compares the plugin slicing DeepSpeed's "
                        "experts against stock DeepSpeed without ESP")
    registry = default_registry()
    if spec.schedule not in registry.schedule_names():
        problems.append(f"schedule ({spec.schedule!r}) is unknown; allowed: {', '.join(registry.schedule_names())}")
    elif expert_tp(spec) and registry.schedule_class(spec.schedule).needs_expert_partials:
        problems.append(f"schedule ({spec.schedule!r}) with esp ({spec.esp}) = mp: DeepSpeed's tensor-parallel "
                        "experts all-reduce inside themselves and Parm needs their partial sums (the plugin "
                        "refuses this layout; docs/parm.md, Limits)")
    else:
        problems += exchange_problems(registry.schedule_class(spec.schedule), spec.exchange, spec.pipeline_degree)
    if spec.experts % spec.ep:
        problems.append(f"experts ({spec.experts}) must be divisible by ep ({spec.ep})")
    if spec.ffn % spec.esp:
        problems.append(f"ffn ({spec.ffn}) must be divisible by esp ({spec.esp})")
    if not 1 <= spec.k <= spec.experts:
        problems.append(f"k ({spec.k}) must be between 1 and experts ({spec.experts})")
    if spec.dtype not in DTYPES:
        problems.append(f"dtype ({spec.dtype!r}) must be one of {sorted(DTYPES)}")
    if spec.tokens < max(1, spec.min_capacity):
        problems.append(f"tokens ({spec.tokens}) must be >= 1 and >= min_capacity ({spec.min_capacity}) "
                        "(DeepSpeed's top-1 gate asserts it)")
    if spec.pipeline_degree < 1:
        problems.append(f"pipeline_degree ({spec.pipeline_degree}) must be >= 1")
    if expert_tp(spec) and not spec.drop:
        problems.append(f"drop=False with esp ({spec.esp}) > 1: stock DeepSpeed 0.19.8 rounds the dropless capacity "
                        "up to the tensor-parallel degree only without expert tensor parallelism, so its "
                        "drop_tokens asserts on an odd capacity (the plugin pads; stock cannot be compared)")
    elif spec.mp > 1 and spec.esp > 1 and not spec.drop:
        problems.append(f"drop=False with esp ({spec.esp}) = mp without expert TP: the gate's dropless capacity is a "
                        "maximum over the EP group, and the plugin's EP group (strided by ESP) holds other ranks "
                        "than stock DeepSpeed's, so the padding, hence the routing statistics, differ (outputs do "
                        "not); not compared")
    if spec.mp > 1 and spec.drop and not problems:
        cap = deepspeed_capacity(spec.tokens, spec.experts, spec.k, spec.capacity_factor, spec.min_capacity)
        if cap % spec.mp:
            problems.append(f"capacity ({cap} = ceil(tokens {spec.tokens} / experts {spec.experts} * "
                            f"capacity_factor {spec.capacity_factor} * k {spec.k})) must be divisible by mp "
                            f"({spec.mp}): stock DeepSpeed's drop_tokens asserts it")
    return problems


# ---- one side of the comparison ------------------------------------------------------------------------

def expert_tp(spec: DeepSpeedVerifySpec) -> bool:
    """esp = mp > 1 and expert_tp: DeepSpeed's own expert tensor parallelism (tensor-parallel expert modules)."""
    return spec.mp > 1 and spec.esp == spec.mp and spec.expert_tp


def plugin_esp(spec: DeepSpeedVerifySpec) -> Optional[int]:
    """The section's esp for the plugin side: set only where it differs from what DeepSpeed shards by (esp > 1
    without expert TP: the plugin slices DeepSpeed's FFN experts; the stock side then runs the same EP without
    ESP)."""
    return spec.esp if spec.esp > 1 and not expert_tp(spec) else None


def build_moe(spec: DeepSpeedVerifySpec, mpu: Optional[GroupsMPU]) -> nn.Module:
    from deepspeed.moe.layer import MoE
    expert = make_expert(spec.hidden, spec.ffn, mpu, tensor_parallel=expert_tp(spec))
    moe = MoE(hidden_size=spec.hidden, expert=expert, num_experts=spec.experts, ep_size=spec.ep, k=spec.k,
              capacity_factor=spec.capacity_factor, eval_capacity_factor=spec.capacity_factor,
              min_capacity=spec.min_capacity, noisy_gate_policy="Jitter" if spec.jitter else None,
              drop_tokens=spec.drop, use_rts=spec.rts, enable_expert_tensor_parallelism=expert_tp(spec),
              top2_2nd_expert_sampling=spec.top2_sampling)
    return moe.to(DTYPES[spec.dtype])


EXPERT_PREFIX = "deepspeed_moe.experts.deepspeed_experts."


def run_side(spec: DeepSpeedVerifySpec, mpu: Optional[GroupsMPU], plugin_config: Optional[PluginConfig],
             ledger: Optional[CommLedger]) -> Dict[str, Any]:
    """Build, set up, forward and backward one MoE layer on this rank: stock when ``plugin_config`` is None.
    Expert weights come from (seed, global expert id), so both sides hold the same experts whatever their
    placement."""
    from moe_plugins.patches import deepspeed as adapter
    with ExitStack() as stack:
        groups = stack.enter_context(deepspeed_groups(mpu))
        stack.enter_context(gloo_compat())
        handle = stack.enter_context(adapter.enable(plugin_config, ledger=ledger)) if plugin_config else None
        torch.manual_seed(spec.seed)
        moe = build_moe(spec, mpu)
        moe.set_deepspeed_parallelism()
        name = moe.expert_group_name
        ep_rank = dist.get_rank(group=groups._EXPERT_PARALLEL_GROUP[name])
        init_experts(moe, spec.seed, ep_rank, mpu.tp.rank if mpu else 0, spec.mp if expert_tp(spec) else 1)
        prob = make_problem(spec)
        dp_rank = dist.get_rank() // spec.mp
        x = prob.x_DSM[dp_rank].clone().requires_grad_(True)
        own_SM = x.detach().reshape(-1, spec.hidden)
        calls: List[Dict[str, int]] = []
        moe.deepspeed_moe.gate.register_forward_hook(lambda _m, inp, out: calls.append(
            {"capacity": int(out[1]), "dropped": int((out[3] < 0).sum()), "own": bool(torch.equal(inp[0], own_SM))}))
        torch.manual_seed(spec.seed + 1)      # the gate's random draws: the same state on both sides
        y, l_aux, exp_counts = moe(x)
        ((y * prob.g_DSM[dp_rank]).sum() + AUX_COEF * l_aux).backward()
        shard = mpu.tp.rank if expert_tp(spec) else 0        # tensor-parallel experts: one shard per TP rank
        dense, experts = reduced_grads(moe, groups._EXPERT_DATA_PARALLEL_GROUP[name], ep_rank, shard)
        return {"y": y.detach(), "grad_x": x.grad, "aux": l_aux.detach(), "counts": exp_counts.detach(),
                "calls": calls, "dense_grads": dense, "expert_grads": experts, "keys": list(moe.state_dict()),
                "attrs": {n: (getattr(p, "allreduce", None), getattr(p, "group_name", None))
                          for n, p in moe.named_parameters()},
                "swaps": list(handle.swaps) if handle is not None else []}


def reduced_grads(moe: nn.Module, expert_dp_pg, ep_rank: int, shard: int):
    """Every gradient as DeepSpeed's reduction sees it. Dense parameters: this rank's, by name. Expert
    parameters (``allreduce=False``): summed over the expert-DP group the layer registered, keyed by global
    expert id and tensor-parallel shard. Only the sum is defined where schedules place an expert's tokens on its replicas differently
    (stock splits an MP group's capacity between its ranks; the baseline processes every replica at 1/N_MP;
    with a sliced ESP each member holds one H-slice of the gradient)."""
    dense, experts = {}, {}
    e_l = moe.num_local_experts
    for n, p in moe.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "allreduce", True) is not False:
            dense[n] = g
            continue
        dist.all_reduce(g, group=expert_dp_pg)
        local, rest = n[len(EXPERT_PREFIX):].split(".", 1)
        experts[f"{ep_rank * e_l + int(local)}.{rest}@{shard}"] = g
    return dense, experts


def _maxerr(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if a.shape != b.shape:
        return math.inf
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _maxerr_maps(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max((_maxerr(a.get(n), b.get(n)) for n in set(a) | set(b)), default=0.0)


def compare_sides(stock: Dict[str, Any], plugin: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's errors of the plugin against stock, and whether the routing statistics agree (the plugin's
    gate calls on this rank's own tokens against the stock layer's one call)."""
    own = [{k: c[k] for k in ("capacity", "dropped")} for c in plugin["calls"] if c["own"]]
    stock_call = {k: stock["calls"][0][k] for k in ("capacity", "dropped")} if len(stock["calls"]) == 1 else None
    return {
        "max_err_out": _maxerr(stock["y"], plugin["y"]),
        "max_err_grad_in": _maxerr(stock["grad_x"], plugin["grad_x"]),
        "max_err_grad_w": _maxerr_maps(stock["dense_grads"], plugin["dense_grads"]),
        "max_err_aux": _maxerr(stock["aux"], plugin["aux"]),
        "routing_equal": bool(torch.equal(stock["counts"], plugin["counts"])) and bool(own)
        and all(c == stock_call for c in own),
        "bitwise_equal": bool(torch.equal(stock["y"], plugin["y"])),
        "state_keys_equal": stock["keys"] == plugin["keys"],
        "attrs_equal": stock["attrs"] == plugin["attrs"],
        "capacity": stock_call["capacity"] if stock_call else None,
        "dropped": stock_call["dropped"] if stock_call else None,
    }


def collect_rank(spec: DeepSpeedVerifySpec) -> Dict[str, Any]:
    """Collective over the default group: stock then plugin on this rank; returns this rank's comparison."""
    init_deepspeed_comm()
    mpu = GroupsMPU(spec.world, spec.mp) if spec.mp > 1 else None
    ledger = CommLedger()
    stock = run_side(spec, mpu, None, None)
    plugin_cfg = PluginConfig(schedule=spec.schedule, pipeline_degree=spec.pipeline_degree, exchange=spec.exchange,
                              ranks_per_node=spec.ranks_per_node, esp=plugin_esp(spec))
    plugin = run_side(spec, mpu, plugin_cfg, ledger)
    return {"rank": dist.get_rank(), **compare_sides(stock, plugin), "swaps": plugin["swaps"],
            "expert_grads": (stock["expert_grads"], plugin["expert_grads"]), "ledger": ledger.summary()}


def run_rank(spec: DeepSpeedVerifySpec) -> Optional[Dict[str, Any]]:
    """Collective: every rank compares; rank 0 gets the report."""
    mine = collect_rank(spec)
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return report(spec, gathered) if dist.get_rank() == 0 else None


def _merge(maps: List[Dict[str, torch.Tensor]]):
    """One gradient per global expert id, and how far the ranks holding the same id disagree."""
    merged: Dict[str, torch.Tensor] = {}
    spread = 0.0
    for grads in maps:
        for n, g in grads.items():
            spread = max(spread, _maxerr(merged[n], g)) if n in merged else spread
            merged.setdefault(n, g)
    return merged, spread


def report(spec: DeepSpeedVerifySpec, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Rank 0: the largest errors over the ranks. Expert gradients are compared per global expert id, over
    every rank that holds one (each holds the sum over its expert-DP group)."""
    keys = ("max_err_out", "max_err_grad_in", "max_err_grad_w", "max_err_aux")
    err = {k: max(r[k] for r in ranks) for k in keys}
    stock_e, _ = _merge([r["expert_grads"][0] for r in ranks])
    plugin_e, spread = _merge([r["expert_grads"][1] for r in ranks])
    experts_equal_keys = set(stock_e) == set(plugin_e) and len(stock_e) > 0
    err["max_err_grad_w"] = max(err["max_err_grad_w"], _maxerr_maps(stock_e, plugin_e), spread)
    tol = TOLERANCE[spec.dtype]
    flags = {k: all(r[k] for r in ranks) for k in ("routing_equal", "bitwise_equal", "state_keys_equal", "attrs_equal")}
    flags["expert_ids_equal"] = experts_equal_keys
    ok = all(flags[k] for k in ("routing_equal", "state_keys_equal", "attrs_equal", "expert_ids_equal")) and all(
        v <= tol for v in err.values())
    layout = ParallelLayout(world=spec.world, ranks_per_node=spec.ranks_per_node, mp=spec.mp, ep=spec.ep, esp=spec.esp)
    return {"ok": ok, "host": "deepspeed", **err, "tolerance": tol, **flags,
            "dropped_routes": sum(r["dropped"] for r in ranks[::spec.mp]),
            "capacity": [r["capacity"] for r in ranks], "swaps": ranks[0]["swaps"], "spec": asdict(spec),
            "layout": layout.describe(), "ledger": ranks[0]["ledger"]}
