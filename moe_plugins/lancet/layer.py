"""Lancet in the core MoE layer: the experts' weight gradients deferred and run behind the layer's backward
exchanges (docs/lancet.md).

:class:`LancetMoELayer` is the core's :class:`~moe_plugins.core.layer.MoELayer` with two changes, both through
the core's generic hooks:

- its Recorder carries :class:`~moe_plugins.lancet.overlap.ExchangeOverlap` as ``while_in_flight``, so each
  backward all-to-all is issued on the engine's pipeline lane and the queue runs while it flies;
- its executor is wrapped (:class:`DeferredExperts`) so that ``LayerParams.experts`` computes the expert FFN's two
  GEMMs with :func:`~moe_plugins.lancet.wgrad.deferred_partial_ffn` (dX at once, dW queued); b2, the gate and the
  collectives are the core's.

The overlap needs an engine with a pipeline lane (``build_engine(groups, pipeline=True)``, collective); without
one the layer is exact and the queue runs at the end of backward (or at a later exchange). With PipeMoE's
``Pipelined`` executor the exchanges run on the lane thread, where the queue is not run; PipeMoE's ``_Fence`` calls
the same callback on the backward thread while each chunk's backward exchange flies.

Shapes: E_l local experts, N rows per expert, M model dim, S tokens.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, List, Tuple

import torch

from moe_plugins.core import comm
from moe_plugins.core.engine import PIPELINE
from moe_plugins.core.executor import Executor
from moe_plugins.core.experts import ExpertWeights, sharded_experts
from moe_plugins.core.groups import Group
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.schedule import Dispatched, LayerParams, Schedule
from moe_plugins.lancet.config import EXCHANGES, SCHEDULES
from moe_plugins.lancet.overlap import ExchangeOverlap
from moe_plugins.lancet.wgrad import deferred_partial_ffn
from moe_plugins.lancet.wgrad_queue import WgradQueue


def deferred_sharded_experts(x_ElNM: torch.Tensor, *, weights: ExpertWeights, activation: str, esp: Group,
                             rec: comm.Recorder, queue: WgradQueue, name: str) -> torch.Tensor:
    """The core's ``sharded_experts`` with the FFN's weight gradients deferred to ``queue`` (tag ``name``)."""
    return sharded_experts(x_ElNM, weights=weights, activation=activation, esp=esp, rec=rec,
                           ffn=partial(deferred_partial_ffn, queue=queue, name=name, tag=name))


class DeferredExperts(Executor):
    """Runs ``inner`` with ``LayerParams.experts`` replaced by :func:`deferred_sharded_experts` on the layer's
    ``LayerParams.expert_weights``."""

    def __init__(self, inner: Executor, queue: WgradQueue, *, activation: str, esp: Group, name: str):
        if not isinstance(inner, Executor):
            raise ValueError(f"inner ({type(inner).__name__}) must be an Executor")
        self.inner, self.queue, self.activation, self.esp, self.name = inner, queue, activation, esp, name
        self.degree = inner.degree

    @property
    def engine(self) -> Any:
        return getattr(self.inner, "engine", None)

    def run(self, schedule: Schedule, x_SM: torch.Tensor, params: LayerParams) -> Tuple[torch.Tensor, Dispatched]:
        if params.expert_weights is None:
            raise ValueError(f"layer {self.name!r}: Lancet defers the expert weights' gradients and needs "
                             "LayerParams.expert_weights")
        experts = partial(deferred_sharded_experts, weights=params.expert_weights, activation=self.activation,
                          esp=self.esp, rec=schedule.rec, queue=self.queue, name=self.name)
        return self.inner.run(schedule, x_SM, replace(params, experts=experts))

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"DeferredExperts({self.inner!r})"


def schedule_problems(schedule: Schedule) -> List[str]:
    """Why Lancet cannot run ``schedule`` (empty when it can): its exchanges must be the core all-to-all's."""
    problems = []
    if type(schedule).name not in SCHEDULES:
        problems.append(f"schedule ({type(schedule).name!r}) cannot run with Lancet: only "
                        f"{', '.join(map(repr, SCHEDULES))} in this version")
    if type(schedule).exchange_mode not in EXCHANGES:
        problems.append(f"exchange ({type(schedule).exchange_mode!r}) cannot run with Lancet: only the padded "
                        "exchange carries the overlap in this version")
    return problems


class LancetMoELayer(MoELayer):
    """The core layer with its experts' weight gradients deferred to ``queue`` and run while its backward
    exchanges fly (module docstring). Takes MoELayer's arguments; ``queue`` is the model's (one per model)."""

    def __init__(self, *args: Any, queue: WgradQueue, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not isinstance(queue, WgradQueue):
            raise ValueError(f"queue ({type(queue).__name__}) must be a moe_plugins.lancet.WgradQueue")
        problems = schedule_problems(self.schedule)
        if problems:
            raise ValueError(f"invalid Lancet layer {self.name!r}: " + "; ".join(problems))
        self.queue = queue
        self.rec = replace(self.rec, while_in_flight=ExchangeOverlap(queue))
        self.schedule = type(self.schedule)(self.config, self.groups, self.rec)
        self.executor = DeferredExperts(self.executor, queue, activation=self.config.activation,
                                        esp=self.groups.esp, name=f"experts.{self.name}")

    @property
    def overlaps(self) -> bool:
        """Whether its backward exchanges can overlap the queue (its engine has a pipeline lane)."""
        return self.rec.engine.has_lane(PIPELINE)
