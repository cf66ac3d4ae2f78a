"""parm-auto and parm-tune with the ragged exchange: the same choice among S1, S2 (with SAA or not) and
DeepSpeed's flow (baseline-tp), each candidate run by its ragged form (:mod:`moe_plugins.parm.ragged`,
:mod:`moe_plugins.parm.saa_ragged`, :class:`moe_plugins.core.baseline_tp.RaggedBaselineTPSchedule`), at any
pipeline degree (the running candidate cuts its chunks and answers ``row_load``; PipeMoE's lane twin shares the
candidates' calls and which one runs). The choice is priced with the padded model
(Algorithm 1's volumes at the observed C_l); with drops and balanced load the ragged rows are about what it
prices.

:func:`ragged_form` derives the ragged class from a parm-auto / parm-tune class (a measured profile's included:
``ParmAutoSchedule.with_costs``), so that a host's costed class keeps its costs; :func:`padded_form` goes back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Type

import torch

from moe_plugins.core.baseline_tp import RaggedBaselineTPSchedule
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, RowLoad, Schedule
from moe_plugins.parm.ragged import RaggedParmS1Schedule, RaggedParmS2Schedule
from moe_plugins.parm.saa_ragged import RaggedParmS2SAASchedule
from moe_plugins.parm.steps import _ParmSchedule


FORMS = (RaggedParmS1Schedule, RaggedParmS2Schedule, RaggedParmS2SAASchedule)


@dataclass
class _Pick:
    """The candidate this call runs (its registered name; None between calls), shared with the lane twin."""

    name: Optional[str] = None


class _RaggedParmSteps(_ParmSchedule):
    """Below parm-auto / parm-tune in the MRO: their S1 and S2 preparation and the shared steps, run by the
    ragged S1 / S2 (with SAA or not) of this call (DeepSpeed's flow is their ``_tp``, the ragged baseline-tp:
    ``tp_class``)."""

    def __init__(self, config, groups, rec, *args, **kwargs):
        super().__init__(config, groups, rec, *args, **kwargs)
        self._forms: Dict[str, Schedule] = {form.name: form(config, groups, rec) for form in FORMS}
        self._pick = _Pick()

    def ragged_twin(self, groups) -> Schedule:
        """The lane twin (``twin``): parm-auto's, whose candidates share this one's calls and whose pick is this
        one's."""
        twin = type(self)(self.config, groups, self.rec, self._state)      # parm-auto's: the shared S2Form
        twin._forms = {name: form.twin(groups) for name, form in self._forms.items()}
        twin._tp, twin._pick = self._tp.twin(groups), self._pick
        return twin

    def _prepare_tokens(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        return self._start(RaggedParmS1Schedule.name).prepare(x_SM, params)

    def _prepare_capacity(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        form = RaggedParmS2SAASchedule.name if self._state.saa else RaggedParmS2Schedule.name   # the call's S2 form
        return self._start(form).prepare(x_SM, params)

    def _start(self, name: str) -> Schedule:
        self._pick.name = name
        return self._forms[name]

    def _running(self) -> Schedule:
        if self._state.tp:           # parm-auto's call state: DeepSpeed's flow (parm-auto routes its other steps)
            return self._tp
        if self._pick.name is None:
            raise ValueError(f"schedule {self.name!r} with the ragged exchange: a step before prepare")
        return self._forms[self._pick.name]

    def exchange(self, d: torch.Tensor) -> Exchange:
        return self._forms[self._pick.name or RaggedParmS1Schedule.name].exchange(d)

    def row_load(self, dispatched: Dispatched) -> Optional[RowLoad]:
        return self._running().row_load(dispatched)

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
        run, self._pick.name = self._running(), None
        return run.finish(r, dispatched)


def ragged_form(cls: Type[Schedule]) -> Type[Schedule]:
    """``cls`` (parm-auto, parm-tune, or a costed subclass) choosing among the ragged candidates."""
    return type(cls.__name__, (cls, _RaggedParmSteps),
                {"exchange_mode": "ragged", "tp_class": RaggedBaselineTPSchedule, "twin": _RaggedParmSteps.ragged_twin,
                 "padded_form": cls, "__module__": __name__})


def padded_form(cls: Type[Schedule]) -> Optional[Type[Schedule]]:
    """The padded class a :func:`ragged_form` was made from (None for any other class)."""
    return getattr(cls, "padded_form", None)
