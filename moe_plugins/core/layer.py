"""The host-independent MoE layer: a gate, this rank's expert shard, and a schedule.

Shapes: B batch, L sequence, M model dim, E experts (E_l local), H FFN hidden (H_s per ESP shard).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional, Type, Union

import torch
from torch import nn

from moe_plugins.core.baseline import BaselineSchedule
from moe_plugins.core.comm import Recorder
from moe_plugins.core.config import MoEConfig, moe_config_problems
from moe_plugins.core.engine import CommEngine
from moe_plugins.core.executor import Executor, Sequential
from moe_plugins.core.experts import ExpertWeights, shard_weights, sharded_experts
from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.ledger import CommLedger
from moe_plugins.core.router import route_token_block, route_tokens
from moe_plugins.core.registry import Registry
from moe_plugins.core.schedule import LayerParams, Schedule, exchange_problems

ScheduleLike = Union[str, Type[Schedule]]     # a registered name, or a registered schedule's configured subclass
Degree = Any          # an int >= 1, or a paper's per-call degree policy carried by the executor


def resolve_schedule(schedule: ScheduleLike, registry: Optional[Registry]) -> Type[Schedule]:
    """A schedule class as is; a name through ``registry`` (moe_plugins.plugins.default_registry() has every
    paper's schedules; the core knows none by name itself)."""
    if isinstance(schedule, str) and registry is None:
        raise ValueError(f"schedule ({schedule!r}) is a name: pass registry= (e.g. "
                         "moe_plugins.plugins.default_registry()) or the schedule class")
    if registry is None:
        if not (isinstance(schedule, type) and issubclass(schedule, Schedule)):
            raise ValueError(f"schedule ({schedule!r}) must be a Schedule subclass or a registered name")
        return schedule
    return registry.schedule_class(schedule)


@dataclass(frozen=True)
class MoEOutput:
    y: torch.Tensor              # same shape as the input
    aux_loss: torch.Tensor       # this rank's load-balancing loss (GShard/Switch)
    exp_counts_E: torch.Tensor   # routes per expert before dropping, this rank's tokens
    dropped: torch.Tensor        # routes dropped by capacity, this rank's tokens (0-dim; int() it to read)


def check_layer_args(config: MoEConfig, groups: MoEProcessGroups, schedule: ScheduleLike,
                     pipeline_degree: Degree, executor: Optional[Executor] = None,
                     registry: Optional[Registry] = None) -> None:
    """Raise one ValueError listing every problem, before anything is built."""
    problems = moe_config_problems(config, groups.layout)
    try:
        cls = resolve_schedule(schedule, registry)
        problems += cls.layout_problems(groups.layout)
        problems += exchange_problems(cls, cls.exchange_mode, getattr(executor, "degree", pipeline_degree))
    except ValueError as exc:
        problems.append(str(exc))
    fixed_ok = isinstance(pipeline_degree, int) and not isinstance(pipeline_degree, bool) and pipeline_degree >= 1
    if not fixed_ok and executor is None:
        problems.append(f"pipeline_degree ({pipeline_degree!r}) must be a positive integer, or come with the "
                        "executor that carries it")
    elif executor is None and pipeline_degree != 1:
        problems.append(f"pipeline_degree ({pipeline_degree!r}) needs executor= (the layer builds no process "
                        "groups): build_executor(pipeline_degree, profile, build_engine(groups, pipeline=True)) "
                        "from moe_plugins.pipemoe.runner and moe_plugins.core.engine")
    elif executor is not None and pipeline_degree not in (1, executor.degree):
        problems.append(f"pipeline_degree ({pipeline_degree!r}) differs from the executor's degree "
                        f"({executor.degree!r}); pass one of them")
    if problems:
        raise ValueError("invalid MoE layer: " + "; ".join(problems))


class MoELayer(nn.Module):
    """Gate (replicated) + expert shard (sharded over EP and ESP), run by a named schedule.

    ``executor`` runs the schedule (default :class:`Sequential`; PipeMoE's ``Pipelined`` when the pipeline
    degree is not 1); ``engine`` issues its collectives (default: the executor's, else an inline one). Both
    are built by the caller: the layer builds no process groups."""

    def __init__(self, config: MoEConfig, groups: MoEProcessGroups, *, schedule: ScheduleLike = BaselineSchedule,
                 pipeline_degree: Degree = 1, ledger: Optional[CommLedger] = None, name: str = "moe",
                 dtype: torch.dtype = torch.float32, executor: Optional[Executor] = None,
                 engine: Optional[CommEngine] = None, registry: Optional[Registry] = None):
        super().__init__()
        check_layer_args(config, groups, schedule, pipeline_degree, executor, registry)
        self.executor = executor if executor is not None else Sequential()
        self.config, self.groups, self.pipeline_degree, self.name = config, groups, self.executor.degree, name
        self.ledger = ledger
        cls = resolve_schedule(schedule, registry)
        self.rec = Recorder(ledger, name, engine if engine is not None else getattr(self.executor, "engine", None),
                            schedule=cls.name)
        self.schedule = cls(config, groups, self.rec)
        e_l, h_s, m = config.num_experts // groups.ep.size, config.ffn // groups.esp.size, config.hidden
        self.wg_EM = nn.Parameter(torch.zeros(config.num_experts, m, dtype=dtype))
        self.w1_EMH = nn.Parameter(torch.zeros(e_l, m, h_s, dtype=dtype))
        self.b1_EH = nn.Parameter(torch.zeros(e_l, h_s, dtype=dtype))
        self.w2_EHM = nn.Parameter(torch.zeros(e_l, h_s, m, dtype=dtype))
        self.b2_EM = nn.Parameter(torch.zeros(e_l, m, dtype=dtype))
        for p in (self.w1_EMH, self.b1_EH, self.w2_EHM, self.b2_EM):
            p.allreduce = False          # expert params: reduced over expert-DP, not DP (DeepSpeed's marker)

    @property
    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.w1_EMH, self.b1_EH, self.w2_EHM, self.b2_EM)

    def prefetch(self) -> None:
        """Start the schedule's work that may run before this layer's call (Hecate's early gather): call it
        at the start of the block that holds the layer, so that the work before the layer hides it."""
        self.schedule.prefetch(self.expert_weights)

    @torch.no_grad()
    def load_full(self, wg_EM: torch.Tensor, full: ExpertWeights) -> None:
        """Copy this rank's shard out of full (unsharded) weights."""
        c = self.groups.layout.coords(self.groups.global_rank)
        shard = shard_weights(full, c["ep"], self.groups.ep.size, c["esp"], self.groups.esp.size)
        self.wg_EM.copy_(wg_EM)
        for p, t in zip((self.w1_EMH, self.b1_EH, self.w2_EHM, self.b2_EM),
                        (shard.w1_EMH, shard.b1_EH, shard.w2_EHM, shard.b2_EM)):
            p.copy_(t)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        x_SM = x.reshape(-1, x.shape[-1])
        if x_SM.shape[0] == 0:
            raise ValueError("MoE layer input has no tokens")
        params = LayerParams(
            router=partial(route_tokens, wg_EM=self.wg_EM, config=self.config, groups=self.groups, rec=self.rec),
            experts=partial(sharded_experts, weights=self.expert_weights, activation=self.config.activation,
                            esp=self.groups.esp, rec=self.rec),
            expert_weights=self.expert_weights,
            block_router=partial(route_token_block, wg_EM=self.wg_EM, config=self.config, groups=self.groups,
                                 rec=self.rec))
        y_SM, d = self.executor.run(self.schedule, x_SM, params)
        return MoEOutput(y=y_SM.reshape(x.shape), aux_loss=d.aux_loss, exp_counts_E=d.exp_counts_E,
                         dropped=d.dropped)
