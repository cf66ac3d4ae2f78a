"""Executors: how a layer runs the five steps of its schedule, apart from what the schedule computes.

:class:`Sequential` runs steps 2-4 over ``degree`` capacity chunks one after another on the caller's thread
(:func:`moe_plugins.core.schedule.run_schedule`). PipeMoE's :class:`moe_plugins.pipemoe.runner.Pipelined`
overlaps them on a communication engine's pipeline lane; build either with
:func:`moe_plugins.pipemoe.runner.build_executor`. Executors are built by the caller and given to layers,
which never build process groups themselves.

Shapes: S tokens, M model dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Tuple

import torch

from moe_plugins.core.schedule import Dispatched, LayerParams, Schedule, run_schedule


class Executor(ABC):
    """Runs a schedule on a layer's tokens: ``run(schedule, x_SM, params) -> (y_SM, dispatched)``."""

    degree: Any = 1          # the pipeline degree it runs: an int, or a per-call policy (PipeMoE's AutoDegree)

    @abstractmethod
    def run(self, schedule: Schedule, x_SM: torch.Tensor, params: LayerParams) -> Tuple[torch.Tensor, Dispatched]:
        ...

    def close(self) -> None:
        """Let go of what the executor holds (not its engine: whoever built the engine closes it)."""


class Sequential(Executor):
    """Steps 2-4 over ``degree`` chunks, one after another, on this thread (the schedule's own loop)."""

    def __init__(self, degree: int = 1):
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
            raise ValueError(f"degree ({degree!r}) must be a positive integer")
        self.degree = degree

    def run(self, schedule: Schedule, x_SM: torch.Tensor, params: LayerParams) -> Tuple[torch.Tensor, Dispatched]:
        return run_schedule(schedule, x_SM, params, self.degree)

    def __repr__(self) -> str:
        return f"Sequential(degree={self.degree})"
