"""The DeepSpeed adapter's pure half: DeepSpeed's MoE layer read into the core's terms (its gate's routing, by the
exact fast gate where it applies, its expert modules, the facts a plugin section is checked against), every
problem found at once, and the swapped layer's forward. Nothing here patches anything (patches/deepspeed.py does).

Shapes: S tokens, M model dim, E experts (E_l local), K routes per token, C capacity, P = N_EP sources.
"""


from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, List, Optional, Set, Tuple

import torch

from moe_plugins.core import comm
from moe_plugins.core.comm import Recorder
from moe_plugins.core.config import MoEConfig, moe_config_problems
from moe_plugins.core.experts import ExpertWeights, ffn_shard, partial_ffn
from moe_plugins.core.fastgate import top1_routing, top2_routing, uniform_sample
from moe_plugins.core.gating import Routing
from moe_plugins.core.groups import Group, MoEProcessGroups
from moe_plugins.core.layout import ParallelLayout, layout_problems
from moe_plugins.core.plugin_config import SECTION, PluginConfig
from moe_plugins.core.schedule import LayerParams, Schedule, exchange_problems, run_schedule
from moe_plugins.plugins import default_registry

logger = logging.getLogger("moe_plugins.deepspeed")


# ---- pure translation of DeepSpeed's objects into the core's -------------------------------------------

def routing_from_gate(gate_out: Tuple[Any, ...]) -> Routing:
    """DeepSpeed's sparse gate output ``(l_aux, C, E, indices_KS, locations_KS, gates_KS, exp_counts_E)``
    (``TopKGate.forward(x, used_token, sparse_routes=True)``; a dropped route has index -1) as a Routing."""
    l_aux, cap, _num_experts, indices_KS, locations_KS, gates_KS, exp_counts_E = gate_out
    kept_KS = indices_KS >= 0
    expert_SK = indices_KS.clamp(min=0).long().t()
    slot_SK = torch.where(kept_KS, locations_KS.long(), torch.full_like(locations_KS, -1, dtype=torch.long)).t()
    return Routing(expert_SK=expert_SK, slot_SK=slot_SK, weight_SK=gates_KS.t(), capacity=int(cap),
                   aux_loss=l_aux, exp_counts_E=exp_counts_E)


def gate_router(gate: torch.nn.Module, used_token: Optional[torch.Tensor], x_SM: torch.Tensor,
                fast: bool = True, noted: Optional[Set[str]] = None) -> Routing:
    """The core's router contract met by DeepSpeed's TopKGate (its RNG draws, capacity and dropless all-reduce
    over the EP group included): its own ``wg`` and the exact fast gate (core/fastgate.py) where that reproduces
    the gate's settings, else the gate itself, logged once per reason in ``noted`` (the layer's set; None:
    every time)."""
    if fast:
        reason = fast_gate_refusal(gate, used_token)
        if reason is None:
            return fast_gate(gate, used_token, x_SM)
        if noted is None or reason not in noted:
            logger.info("moe_plugins: DeepSpeed's own gate function routes this layer (%s)", reason)
            if noted is not None:
                noted.add(reason)
    return routing_from_gate(gate(x_SM, used_token, True, False))


def fast_gate_refusal(gate: torch.nn.Module, used_token: Optional[torch.Tensor]) -> Optional[str]:
    """Why the fast gate cannot stand in for this ``TopKGate.forward`` call (None when it can). Checked before
    any random draw, so a fallback draws exactly what DeepSpeed draws."""
    sm = importlib.import_module("deepspeed.moe.sharded_moe")
    if not isinstance(gate, sm.TopKGate) or type(gate).forward is not sm.TopKGate.forward:
        return f"the gate ({type(gate).__name__}) runs its own forward"
    if gate.k not in (1, 2):
        return f"k ({gate.k}) > 2 uses topkgating, which the fast gate does not reproduce"
    hooks = [getattr(torch.nn.modules.module, n, {}) for n in ("_global_forward_hooks", "_global_forward_pre_hooks")]
    if gate._forward_hooks or gate._forward_pre_hooks or any(hooks):
        return "the gate module has forward hooks (ZeRO-3 parameter gathering, user hooks)"
    if used_token is not None and gate.k == 1:          # top-2 ignores used_token, as TopKGate.forward does
        if used_token.dtype.is_floating_point or used_token.dtype.is_complex:
            return f"used_token is {used_token.dtype}, not a bool or integer mask"
        # a bool mask is 0/1 by type; an integer one is checked by value (one host read per call: pass bool)
        if used_token.dtype != torch.bool and bool(((used_token != 0) & (used_token != 1)).any()):
            return "used_token holds values other than 0 and 1"
    return None


def fast_gate(gate: torch.nn.Module, used_token: Optional[torch.Tensor], x_SM: torch.Tensor) -> Routing:
    """``TopKGate.forward(x_SM, used_token, sparse_routes=True)`` as a Routing, bit for bit (fast_gate_refusal
    None): the same fp32 logits from ``wg`` (jitter included), the same draws from DeepSpeed's samplers."""
    sm = importlib.import_module("deepspeed.moe.sharded_moe")
    if gate.wall_clock_breakdown:
        gate.timers(sm.TOPK_GATE_TIMER).start()
    x_fp32 = x_SM.float()
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        x_fp32 = sm.multiplicative_jitter(x_fp32, device=x_SM.device)
    logits_SE = torch.nn.functional.linear(x_fp32, weight=gate.wg.weight.float(), bias=None)
    factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
    dropless = partial(ds_dropless_capacity, gate.ep_group)
    if gate.k == 1:
        routing = top1_routing(logits_SE, factor, gate.min_capacity, used_token_S=used_token,
                               noisy_gate_policy=gate.noisy_gate_policy if gate.training else None,
                               drop_tokens=gate.drop_tokens, use_rts=gate.use_rts, dropless_capacity=dropless,
                               gumbel=sm.gumbel_rsample, uniform=partial(_rts_uniform, sm))
    else:
        routing = top2_routing(logits_SE, factor, gate.min_capacity, drop_tokens=gate.drop_tokens,
                               top2_2nd_expert_sampling=gate.top2_2nd_expert_sampling, dropless_capacity=dropless,
                               gumbel=sm.gumbel_rsample)
    if gate.wall_clock_breakdown:
        gate.timers(sm.TOPK_GATE_TIMER).stop()
        gate.gate_time = gate.timers(sm.TOPK_GATE_TIMER).elapsed(reset=False)
    return routing


def _rts_uniform(sm: Any, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Random token selection's U[0, 1) draw: DeepSpeed's cached sampler for the device where it made one."""
    cached = sm.exp_selection_uniform_map.get(device)
    return cached(shape) if cached is not None else uniform_sample(shape, device)


def ds_dropless_capacity(ep_group: Any, new_cap: torch.Tensor) -> torch.Tensor:
    """What DeepSpeed's gate does with the largest local count when it drops no token: all-reduce MAX over the
    EP group (deepspeed.comm, when the group spans ranks), then, without expert tensor parallelism, round up to a
    multiple of the mpu's tensor-parallel degree."""
    ds_dist = importlib.import_module("deepspeed.comm")
    ds_groups = importlib.import_module("deepspeed.utils.groups")
    if importlib.import_module("deepspeed.comm.pg_utils").is_parallel(ep_group):
        ds_dist.all_reduce(new_cap, op=ds_dist.ReduceOp.MAX, group=ep_group)
    if ds_groups._get_expert_model_parallel_world_size() == 1:
        bwc = importlib.import_module("deepspeed.utils.bwc")
        tp = 1 if ds_groups.mpu is None else bwc.bwc_tensor_model_parallel_world_size(mpu=ds_groups.mpu)
        new_cap = torch.ceil(new_cap / tp).mul(tp).to(new_cap.dtype)
    return new_cap


class GateReplay:
    """DeepSpeed's gate, called once per token block of one forward, every call from the same RNG state.

    A schedule may gate several blocks (the baseline gates its ESP group's blocks). Each call starts from the
    state the first call saw, so a block is routed with the random numbers (RTS, jitter, top-2 sampling) the
    stock layer would draw for it, and the generator ends where one stock gate call leaves it. ``fast``: route
    with the exact fast gate where it applies (``gate_router``)."""

    def __init__(self, gate: torch.nn.Module, used_token: Optional[torch.Tensor], fast: bool = True,
                 noted: Optional[Set[str]] = None):
        self.gate, self.used_token, self.fast, self.state, self.noted = gate, used_token, fast, None, noted

    def __call__(self, x_SM: torch.Tensor) -> Routing:
        rng = torch if x_SM.device.type == "cpu" else getattr(torch, x_SM.device.type)
        args = () if x_SM.device.type == "cpu" else (x_SM.device,)
        if self.state is None:
            self.state = rng.get_rng_state(*args)
        else:
            rng.set_rng_state(self.state, *args)
        return gate_router(self.gate, self.used_token, x_SM, self.fast, self.noted)


def host_experts(experts: torch.nn.Module, ep: int, x_ElRM: torch.Tensor) -> torch.Tensor:
    """The core's experts contract met by DeepSpeed's ``Experts`` module. Rows arrive per local expert,
    source-major (R = P * C); DeepSpeed's experts take (P, E_l, C, M), so they see the shapes they see in
    stock DeepSpeed. Their own tensor parallelism (the ESP reduction) happens inside the user's modules."""
    e_l, rows, model_dim = x_ElRM.shape
    x_PElCM = x_ElRM.reshape(e_l, ep, rows // ep, model_dim).transpose(0, 1).contiguous()
    y_PElCM = experts(x_PElCM)
    return y_PElCM.transpose(0, 1).reshape(e_l, rows, model_dim)


_FFN_ACTIVATIONS = {torch.nn.GELU: "gelu", torch.nn.ReLU: "relu", torch.nn.SiLU: "silu"}


def ffn_activation(expert: torch.nn.Module, hidden: int) -> Optional[str]:
    """The activation's name when ``expert`` is ``nn.Sequential(nn.Linear(M, H), GELU|ReLU|SiLU, nn.Linear(H, M))``,
    the form the plugin can slice along H itself (esp > 1 without DeepSpeed's expert tensor parallelism)."""
    if not isinstance(expert, torch.nn.Sequential) or len(expert) != 3:
        return None
    fc1, act, fc2 = expert
    if type(fc1) is not torch.nn.Linear or type(fc2) is not torch.nn.Linear:
        return None
    if fc1.in_features != hidden or fc2.out_features != hidden or fc1.out_features != fc2.in_features:
        return None
    if isinstance(act, torch.nn.GELU) and act.approximate != "none":
        return None
    return _FFN_ACTIVATIONS.get(type(act))


def _sliced_weights(experts: torch.nn.ModuleList, esp: Group) -> ExpertWeights:
    """This ESP member's H-slice of every local expert, as views of DeepSpeed's full parameters (gradients land
    in the slice), and the full b2."""
    fc1s, fc2s = [e[0] for e in experts], [e[2] for e in experts]
    h = ffn_shard(esp.rank, fc1s[0].out_features, esp.size)
    return ExpertWeights(w1_EMH=torch.stack([f.weight[h].t() for f in fc1s]),
                         b1_EH=torch.stack([_bias(f)[h] for f in fc1s]),
                         w2_EHM=torch.stack([f.weight[:, h].t() for f in fc2s]),
                         b2_EM=torch.stack([_bias(f) for f in fc2s]))


def sliced_experts(experts: torch.nn.ModuleList, esp: Group, rec: Recorder, activation: str,
                   x_ElRM: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's full FFN experts computed H-sliced over the ESP group: this member computes its slice H_s of
    every local expert from the full parameters (views, so gradients land in the slice), the partial sums are
    all-reduced, b2 is added with its gradient divided by N_ESP. The members see the same rows, so DeepSpeed's
    sum over the replicas (ESP x expert-DP, the group registered as expert-DP) is the full gradient."""
    w = _sliced_weights(experts, esp)
    x_ElRM = comm.copy_to(x_ElRM, esp, rec)
    y_ElRM = comm.all_reduce(partial_ffn(x_ElRM, w, activation), esp, rec)
    return y_ElRM + comm.grad_scale(w.b2_EM, 1.0 / esp.size).unsqueeze(1)


def sliced_expert_partials(experts: torch.nn.ModuleList, esp: Group, activation: str,
                           x_ElRM: torch.Tensor) -> torch.Tensor:
    """Parm's form of :func:`sliced_experts` (``LayerParams.partial_experts``): this member's H-slice partial of
    every local expert plus b2 / N_ESP, not reduced; Parm's local combine sums the N_ESP partials of a row, and its
    exchange sums the input gradient. Each member's b2 gets g / N_ESP and DeepSpeed's sum over the replicas (ESP
    x expert-DP) makes it g, as with :func:`sliced_experts`."""
    w = _sliced_weights(experts, esp)
    return partial_ffn(x_ElRM, w, activation) + (w.b2_EM / esp.size).unsqueeze(1)


def _bias(linear: torch.nn.Linear) -> torch.Tensor:
    return linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)


def replica_groups(layout: ParallelLayout) -> List[Tuple[int, ...]]:
    """The ranks that hold the same local experts (the same EP index): the ESP group times the expert-DP group."""
    return [tuple(r for r in range(layout.world) if layout.coords(r)["ep"] == e) for e in range(layout.ep)]


def expert_ffn_width(expert: torch.nn.Module, hidden: int, esp_sharded: int) -> int:
    """H of one expert, read from its first 2-D weight that takes M inputs (nn.Linear stores (H, M)), times the
    tensor-parallel degree the expert is already sharded by. Raises when no such weight exists."""
    for p in expert.parameters():
        if p.dim() == 2 and p.shape[1] == hidden:
            return int(p.shape[0]) * esp_sharded
    raise ValueError(f"cannot read the expert FFN width H: no 2-D weight of the expert takes M={hidden} inputs")


def common_value(values: List[Optional[str]]) -> Optional[str]:
    return values[0] if values and all(v == values[0] for v in values) else None


@dataclass(frozen=True)
class HostLayerFacts:
    """What the adapter reads from one DeepSpeed MoE layer and the host's mpu, once, at setup."""

    name: str
    hidden: int
    num_experts: int
    ep: int
    k: int
    capacity_factor: float
    min_capacity: int
    drop_tokens: bool
    expert_tp: bool          # enable_expert_tensor_parallelism under an mpu
    tp: int                  # mpu's tensor-parallel degree (1 without mpu)
    pp: int                  # mpu's pipeline degree
    tp_ranks: Tuple[int, ...]
    use_tutel: bool
    ffn: int
    ffn_activation: Optional[str] = None   # set when every local expert is a plain FFN the plugin can slice

    @property
    def host_esp(self) -> int:
        """The degree DeepSpeed itself shards the experts by (its expert tensor parallelism)."""
        return self.tp if self.expert_tp else 1


def layer_problems(facts: HostLayerFacts, cfg: PluginConfig, world: int, rank: int, ranks_per_node: int,
                   use_data_before_expert_parallel: bool) -> List[str]:
    """Every reason the plugin cannot run this layer, each naming the setting and its value (empty when fine)."""
    host_esp = facts.host_esp
    esp = cfg.esp if cfg.esp is not None else host_esp
    problems = []
    if use_data_before_expert_parallel:
        problems.append("ds_config use_data_before_expert_parallelism (true) is not supported: the plugin's layout "
                        "places EP inside the expert-DP blocks")
    if facts.use_tutel:
        problems.append("use_tutel (true) is not supported: the schedules replace Tutel's dispatcher")
    if facts.pp > 1:
        problems.append(f"pipeline parallel degree ({facts.pp}) must be 1: the plugin's layout has no PP axis")
    if esp != host_esp and host_esp > 1:
        problems.append(f"{SECTION}.esp ({esp}) must equal the tensor-parallel degree ({host_esp}) that "
                        "enable_expert_tensor_parallelism shards this layer's expert modules by")
    elif esp != host_esp and facts.ffn_activation is None:
        problems.append(f"{SECTION}.esp ({esp}) > 1 without DeepSpeed's expert tensor parallelism needs every "
                        "expert to be nn.Sequential(nn.Linear(M, H), nn.GELU()|nn.ReLU()|nn.SiLU(), nn.Linear(H, M)), "
                        "which the plugin slices along H; this layer's experts are not")
    registry = default_registry()
    needs_partials = cfg.schedule in registry.schedule_names() and \
        registry.schedule_class(cfg.schedule).needs_expert_partials
    if host_esp > 1 and esp == host_esp and needs_partials:
        allowed = [n for n in registry.schedule_names() if not (registry.schedule_class(n).needs_expert_partials
                                                                or registry.schedule_class(n).needs_expert_weights)]
        problems.append(f"{SECTION}.schedule ({cfg.schedule!r}) cannot run with DeepSpeed's expert tensor "
                        f"parallelism (esp {host_esp}): its local combine needs the experts' partial sums, and "
                        "enable_expert_tensor_parallelism's expert modules all-reduce inside themselves; allowed "
                        f"here: {', '.join(repr(n) for n in allowed)}; or turn enable_expert_tensor_parallelism off "
                        f"and set {SECTION}.esp to {host_esp}: the plugin then slices plain FFN experts over ESP "
                        "itself and Parm runs (docs/parm.md)")
    problems += layout_problems(world, ranks_per_node, facts.tp, facts.ep, esp)
    if problems:
        return problems
    layout = ParallelLayout(world=world, ranks_per_node=ranks_per_node, mp=facts.tp, ep=facts.ep, esp=esp)
    if facts.tp > 1 and facts.tp_ranks != layout.group_of("mp", rank):
        problems.append(f"the mpu's tensor-parallel group of rank {rank} {list(facts.tp_ranks)} must be the "
                        f"contiguous block {list(layout.group_of('mp', rank))} (Megatron's rank order)")
    problems += moe_config_problems(moe_config(facts), layout) + registry.schedule_problems(cfg.schedule, layout)
    if cfg.schedule in registry.schedule_names():
        problems += [f"{SECTION}.{p}" for p in exchange_problems(registry.schedule_class(cfg.schedule), cfg.exchange,
                                                                  cfg.pipeline_degree)]
    return problems


def moe_config(facts: HostLayerFacts) -> MoEConfig:
    return MoEConfig(hidden=facts.hidden, ffn=facts.ffn, num_experts=facts.num_experts, k=facts.k,
                     capacity_factor=facts.capacity_factor, min_capacity=facts.min_capacity,
                     drop_tokens=facts.drop_tokens, activation=facts.ffn_activation or "gelu")


# ---- one swapped layer ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class SwappedLayer:
    """A DeepSpeed MOELayer that runs a schedule: what it runs and on which groups."""

    name: str
    schedule: Schedule
    groups: MoEProcessGroups
    pipeline_degree: Any            # 1, an int > 1 or a pipemoe.AutoDegree
    lane: Any = None                # the pipemoe.runner.Pipelined executor when pipeline_degree != 1
    slice_activation: Optional[str] = None   # set: the plugin slices DeepSpeed's FFN experts over ESP
    noted: Set[str] = field(default_factory=set)   # why DeepSpeed's own gate routes it (each reason logged once)
    inference: Any = None           # lina.infer.LayerScheduler: Lina's inference schedule of eval-mode forwards
    expert_weights: Optional[Callable[[torch.nn.Module], ExpertWeights]] = None   # per call (Hecate's copies)

    def experts(self, layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.slice_activation is None:
            return partial(host_experts, layer.experts, self.groups.ep.size)
        return partial(sliced_experts, layer.experts.deepspeed_experts, self.groups.esp, self.schedule.rec,
                       self.slice_activation)

    def partial_experts(self, layer: torch.nn.Module) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """Un-reduced ESP partials for Parm's local combine, where the plugin slices the experts (else None)."""
        if self.slice_activation is None:
            return None
        return partial(sliced_expert_partials, layer.experts.deepspeed_experts, self.groups.esp,
                       self.slice_activation)

    def prefetch(self, layer: torch.nn.Module) -> None:
        """The schedule's work before the layer's gate (Hecate's early gather), from the block's pre-hook."""
        with torch.no_grad():
            self.schedule.prefetch(None if self.expert_weights is None else self.expert_weights(layer))

    def forward(self, layer: torch.nn.Module, x: torch.Tensor, used_token: Optional[torch.Tensor]) -> torch.Tensor:
        if used_token is not None and self.groups.esp.size > 1:
            raise ValueError(f"MoE layer {self.name}: used_token is not supported with esp ({self.groups.esp.size})"
                             " > 1, where a schedule may gate other ranks' token blocks")
        timed = getattr(layer, "wall_clock_breakdown", False)
        if timed:
            layer.timers("moe").start()
        x_SM = x.reshape(-1, x.shape[-1])
        if self.inference is not None and layer.training:
            self.inference.clear()                  # weights may change: replicas are moved again in eval
        params = LayerParams(router=GateReplay(layer.gate, used_token, noted=self.noted), experts=self.experts(layer),
                             partial_experts=self.partial_experts(layer),
                             expert_weights=None if self.expert_weights is None else self.expert_weights(layer))
        if self.inference is not None and not layer.training:
            y_SM, dispatched = self.inference.forward(x_SM, params.router, partial(_plain, self.schedule, params))
        elif self.pipeline_degree == 1:
            y_SM, dispatched = run_schedule(self.schedule, x_SM, params)
        else:
            from moe_plugins.pipemoe.runner import run_pipelined
            y_SM, dispatched = run_pipelined(self.schedule, x_SM, params, self.pipeline_degree, self.lane)
        layer.l_aux, layer.exp_counts = dispatched.aux_loss, dispatched.exp_counts_E
        if timed:
            layer.timers("moe").stop()
            layer.time_moe = layer.timers("moe").elapsed(reset=False)
        return y_SM.reshape(x.shape)


def _plain(schedule: Schedule, params: LayerParams, x_SM: torch.Tensor, router: Callable[..., Routing]):
    """The layer's own schedule with ``router`` (Lina's unscheduled layers record the path through it)."""
    from moe_plugins.lina.infer import timed_schedule
    return timed_schedule(schedule, x_SM, LayerParams(router=router, experts=params.experts))


@dataclass(frozen=True)
class HostGroups:
    """The project's groups of one layout, plus the process groups DeepSpeed's registry gets for EP and
    expert-DP (real groups even of size 1: DeepSpeed asks them for ranks)."""

    groups: MoEProcessGroups
    ep_pg: Any
    expert_dp_pg: Any
    expert_dp_ranks: Tuple[int, ...]
