"""``parm-tune``: Parm's Algorithm 1 (parm-auto), checked by timing the layer.

Algorithm 1 prices S1 and S2 with alpha-beta fits and balanced routing. Where real routing is uneven (S1's
buffer C_l is the largest per-expert count over the MP group, so it sends more than the balanced T / N_MP),
or where the fitted SAA curve is optimistic, its pick can be the slower one (docs/parm.md). ``parm-tune``
starts from that pick and then times each candidate on the layer's own calls, per token count and for
training and no_grad calls apart (:class:`moe_plugins.core.tuning.Search`):

- candidates: ``parm-s1``, ``parm-s2``, ``parm-s2-saa`` and DeepSpeed's flow ``baseline-tp`` where the
  layout allows it (ESP = 1 or MP) (with N_MP = 1 all issue the same collectives and Algorithm 1's pick
  stands untimed); Algorithm 1's pick is timed first;
- each runs ``warmup_calls`` untimed calls, then ``timed_calls`` timed ones: the whole layer call (gate to
  combine) and, when autograd records and the input needs a gradient, its backward;
- the fastest median, agreed as the slowest rank's over the EP&ESP and MP groups, is kept; a candidate
  within ``TIE_TOLERANCE`` of it that is Algorithm 1's pick wins the tie.

Every candidate computes the same function (the same routes dropped, the same outputs and gradients to
round-off), so tuning changes speed only. The call's candidate lives in a small state object shared with
PipeMoE's lane twin (:meth:`ParmAutoSchedule.twin`), whose exchanges read ``saa`` from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from moe_plugins.parm.cost import SCHEDULE_S1, SCHEDULE_S2, SCHEDULE_TP
from moe_plugins.core.tuning import TIE_TOLERANCE, Sample, Search
from moe_plugins.core.schedule import Dispatched, LayerParams
from moe_plugins.parm.auto import ParmAutoSchedule
from moe_plugins.parm.schedules import ParmS2SAASchedule, S2Form

SCHEDULE_S2_SAA = ParmS2SAASchedule.name


def model_pick(choice: str, s2_form: str) -> str:
    """Algorithm 1's decision as a candidate name (S2 priced with SAA runs as parm-s2-saa)."""
    return SCHEDULE_S2_SAA if choice == SCHEDULE_S2 and s2_form == "saa" else choice


def candidates(start: str, mp: int, tp: bool = False, saa: bool = True) -> Tuple[str, ...]:
    """What to time, Algorithm 1's pick first; only the pick when N_MP = 1. ``tp``: DeepSpeed's flow can
    run on the layout; ``saa``: S2 may run with SAA (not with the ragged exchange)."""
    if mp == 1:
        return (start,)
    every = (SCHEDULE_S1, SCHEDULE_S2) + ((SCHEDULE_S2_SAA,) if saa else ()) + ((SCHEDULE_TP,) if tp else ())
    return (start,) + tuple(c for c in every if c != start)


def first_unmeasured(order: Sequence[str], times_s: Mapping[str, float]) -> Optional[str]:
    return next((c for c in order if c not in times_s), None)


def fastest(start: str, times_s: Mapping[str, float], tie_tolerance: float = TIE_TOLERANCE) -> str:
    """The fastest measured candidate; Algorithm 1's pick when it is within ``tie_tolerance`` of it."""
    best = min(times_s, key=times_s.get)
    if start in times_s and times_s[start] <= (1 + tie_tolerance) * times_s[best]:
        return start
    return best


@dataclass
class _CallState(S2Form):
    """Per-call state shared with the lane twin: the running candidate's SAA, and the call's Sample."""

    sample: Optional[Sample] = None


class ParmTuneSchedule(ParmAutoSchedule):
    """Algorithm 1's pick, then the measured choice described in the module docstring; ``searches`` holds
    it per (token count, autograd on)."""

    name = "parm-tune"
    warmup_calls: ClassVar[int] = 1
    timed_calls: ClassVar[int] = 3

    def __init__(self, config, groups, rec, state: Optional[_CallState] = None):
        super().__init__(config, groups, rec, state if state is not None else _CallState())
        self.searches: Dict[Tuple[int, bool], Search[str]] = {}

    def _search(self, num_tokens: int, training: bool) -> Search[str]:
        key = (num_tokens, training)
        if key not in self.searches:
            choice = self.choose(num_tokens)
            start = model_pick(choice.choice, choice.s2_form)
            order = candidates(start, self.groups.mp.size, self._tp_allowed, self.model_saa)
            self.searches[key] = Search(start=start, propose=partial(first_unmeasured, order),
                                        pick=partial(fastest, start), warmup=self.warmup_calls,
                                        timed=self.timed_calls, decided=start if len(order) == 1 else None)
        return self.searches[key]

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        training = torch.is_grad_enabled()
        search = self._search(x_SM.shape[0], training)
        run, sample = search.call(self.groups, x_SM.device, training and x_SM.requires_grad)
        self._state.saa, self._state.tp, self._state.sample = run == SCHEDULE_S2_SAA, run == SCHEDULE_TP, sample
        x_SM = x_SM if sample is None else sample.wrap_input(x_SM)
        if run == SCHEDULE_S1:
            return self._prepare_tokens(x_SM, params)
        if run == SCHEDULE_TP:
            return self._tp.prepare(x_SM, params)
        return self._prepare_capacity(x_SM, params)

    def finish(self, r: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        y = super().finish(r, dispatched)
        sample, self._state.sample = self._state.sample, None
        return y if sample is None else sample.wrap_output(y)

    def ran(self) -> Set[str]:
        """Its decided candidates already name S2's form."""
        return {s.decided for (_, training), s in self.searches.items() if training and s.decided}

    def notes(self) -> List[str]:
        return [f"parm-tune ({tokens} tokens, {'training' if training else 'forward'}): {s.describe()}"
                for (tokens, training), s in sorted(self.searches.items())]
