"""parm-auto and parm-tune with the ragged exchange: the same choice among S1, S2 (with SAA or not) and
DeepSpeed's flow (baseline-tp), each candidate run by its ragged form (:mod:`moe_plugins.parm.ragged`,
:mod:`moe_plugins.parm.saa_ragged`, :class:`moe_plugins.core.baseline_tp.RaggedBaselineTPSchedule`). Pipeline
degree 1 (the ragged S2 does not cut chunks). The choice is priced with the padded model
(Algorithm 1's volumes at the observed C_l); with drops and balanced load the ragged rows are about what it
prices.

:func:`ragged_form` derives the ragged class from a parm-auto / parm-tune class (a measured profile's included:
``ParmAutoSchedule.with_costs``), so that a host's costed class keeps its costs; :func:`padded_form` goes back.
"""

from __future__ import annotations

from typing import List, Optional, Type

import torch

from moe_plugins.core.baseline_tp import RaggedBaselineTPSchedule
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, Schedule
from moe_plugins.parm.ragged import RaggedParmS1Schedule, RaggedParmS2Schedule
from moe_plugins.parm.saa_ragged import RaggedParmS2SAASchedule
from moe_plugins.parm.steps import _ParmSchedule


class _RaggedParmSteps(_ParmSchedule):
    """Below parm-auto / parm-tune in the MRO: their S1 and S2 preparation and the shared steps, run by the
    ragged S1 / S2 (with SAA or not) of this call (DeepSpeed's flow is their ``_tp``, the ragged baseline-tp:
    ``tp_class``)."""

    def __init__(self, config, groups, rec, *args, **kwargs):
        super().__init__(config, groups, rec, *args, **kwargs)
        self._s1 = RaggedParmS1Schedule(config, groups, rec)
        self._s2 = RaggedParmS2Schedule(config, groups, rec)
        self._s2saa = RaggedParmS2SAASchedule(config, groups, rec)
        self._run: Optional[Schedule] = None

    def _prepare_tokens(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        self._run = self._s1
        return self._s1.prepare(x_SM, params)

    def _prepare_capacity(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        self._run = self._s2saa if self._state.saa else self._s2          # the call's S2 form
        return self._run.prepare(x_SM, params)

    def _running(self) -> Schedule:
        if self._state.tp:           # parm-auto's call state: DeepSpeed's flow (parm-auto routes its other steps)
            return self._tp
        if self._run is None:
            raise ValueError(f"schedule {self.name!r} with the ragged exchange: a step before prepare")
        return self._run

    def exchange(self, d: torch.Tensor) -> Exchange:
        return (self._run or self._s1).exchange(d)

    def chunks(self, dispatched: Dispatched, degree: int) -> List[torch.Tensor]:
        return self._running().chunks(dispatched, degree)

    def join(self, outs: List[torch.Tensor], dispatched: Dispatched) -> torch.Tensor:
        return self._running().join(outs, dispatched)

    def exchange_in(self, d: torch.Tensor) -> torch.Tensor:
        return self._running().exchange_in(d)

    def expert(self, e: torch.Tensor, params: LayerParams) -> torch.Tensor:
        return self._running().expert(e, params)

    def exchange_out(self, o: torch.Tensor) -> torch.Tensor:
        return self._running().exchange_out(o)

    def finish(self, r: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        run, self._run = self._running(), None
        return run.finish(r, dispatched)


def ragged_form(cls: Type[Schedule]) -> Type[Schedule]:
    """``cls`` (parm-auto, parm-tune, or a costed subclass) choosing among the ragged candidates."""
    return type(cls.__name__, (cls, _RaggedParmSteps),
                {"exchange_mode": "ragged", "ragged_chunks": False, "tp_class": RaggedBaselineTPSchedule,
                 "padded_form": cls, "__module__": __name__})


def padded_form(cls: Type[Schedule]) -> Optional[Type[Schedule]]:
    """The padded class a :func:`ragged_form` was made from (None for any other class)."""
    return getattr(cls, "padded_form", None)
