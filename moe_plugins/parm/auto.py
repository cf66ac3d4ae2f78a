"""parm-auto: per layer and token count, S1 or S2 (with SAA where the model prices it lower) by Algorithm 1
as extended in docs/parm.md, or DeepSpeed's own flow (baseline-tp) where that is priced no dearer, from the
cost profile's terms (:mod:`moe_plugins.parm.cost`).

Shapes: S tokens, M model dim, E experts.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Dict, List, Optional, Set, Type, Union

import torch

from moe_plugins.core import comm
from moe_plugins.core.baseline_tp import BaselineTPSchedule
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams
from moe_plugins.parm.cost import (DEFAULT_COSTS, DEFAULT_COSTS_SOURCE, SCHEDULE_S1, SCHEDULE_TP, ParmChoice,
                                   ParmCosts, ParmShape, choose_schedule)
from moe_plugins.parm.schedules import (ParmS2SAASchedule, ParmS2Schedule, S2Form, _ParmSchedule,
                                        _S1Watch, mp_block_slots)

log = logging.getLogger("moe_plugins.parm.schedules")


class ParmAutoSchedule(_ParmSchedule):
    """Parm: per layer and token count, S1 or S2 by Algorithm 1, S2 with SAA or without, whichever the same
    model prices lower (:func:`moe_plugins.parm.cost.choose_schedule`). The decision depends only on
    the token count, the config, the layout, the costs and values agreed by every rank, so every rank makes
    the same one; it is logged when it is first made or changes, and kept in ``choices``. Costs: the class
    attribute ``costs`` (use :meth:`with_costs` for a measured profile; a class, so PipeMoE's lane twin
    inherits it). The running call's S2 form lives in an :class:`S2Form` shared with that twin.

    S1's buffer. Algorithm 1 prices S1 with balanced routing's C_l (:func:`moe_plugins.parm.cost.s1_slots`).
    Real routing is skewed, and S1's buffer is the largest per-expert count over the MP group's token blocks
    (and over the EP&ESP group): on the bench's random gate it was 1.16x balanced at f = 1 and 1.56x at
    f = 0.5, which moves the choice. So every call notes the C_l its routing gives (S1's own, or, running
    S2, what S1 would have used: a bincount of the routing it already holds, no communication), and every
    ``observe_every`` calls of a token count, starting with the first, the ranks agree on the largest mean
    of those notes (two integer max all-reduces, over EP&ESP then MP); from the next call on, S1 is priced
    with that. (The max of the ranks' means is at most the mean of the per-call EP&ESP maxima S1 pays.)
    ``observe_every = 0`` keeps the paper's balanced pricing and issues nothing.

    DeepSpeed's flow. Where the layout allows it (ESP = 1 or MP) and the costs price it, ``baseline-tp`` is
    a third candidate (:func:`moe_plugins.parm.cost.choose_schedule`); a call that runs it delegates every
    step to a :class:`BaselineTPSchedule` on the same groups (``tp`` in the shared :class:`S2Form` tells the
    lane twin's exchanges), so it computes what baseline-tp computes, and it still notes S1's C_l."""

    name = "parm-auto"
    saa = True
    model_saa: ClassVar[bool] = True      # S2 may run with SAA (then Algorithm 1 prices both forms)
    observe_every: ClassVar[int] = 16
    costs: ClassVar[ParmCosts] = DEFAULT_COSTS
    costs_source: ClassVar[str] = DEFAULT_COSTS_SOURCE
    tp_class: ClassVar[type] = BaselineTPSchedule      # DeepSpeed's flow (its ragged form: parm/ragged_auto.py)

    def __init__(self, config, groups, rec, state: Optional[S2Form] = None):
        super().__init__(config, groups, rec)
        self._state = state if state is not None else S2Form()
        self._tp = self.tp_class(config, groups, rec)        # the steps of a call that runs DeepSpeed's flow
        self._tp_allowed = not BaselineTPSchedule.layout_problems(groups.layout)
        self.choices: Dict[int, ParmChoice] = {}
        self.watch: Dict[int, _S1Watch] = {}
        self.made: Set[str] = set()             # every schedule run so far (parm-s1, parm-s2, parm-s2-saa)

    def saa_now(self) -> bool:           # this call's S2 form (read by the shared exchange steps)
        return self._state.saa

    def twin(self, groups) -> "ParmAutoSchedule":
        return type(self)(self.config, groups, self.rec, state=self._state)

    @classmethod
    def exchange_variant(cls, exchange: str):
        if exchange == cls.exchange_mode:
            return cls
        from moe_plugins.parm.ragged_auto import padded_form, ragged_form     # it builds on this module
        return ragged_form(cls) if exchange == "ragged" else padded_form(cls) if exchange == "padded" else None

    @classmethod
    def with_costs(cls, costs: ParmCosts, source: str) -> Type["ParmAutoSchedule"]:
        return type(cls.__name__, (cls,), {"costs": costs.check(), "costs_source": source})

    def shape_for(self, num_tokens: int) -> ParmShape:
        cfg, layout = self.config, self.groups.layout
        return ParmShape(B=1, L=num_tokens, M=cfg.hidden, H=cfg.ffn, E=cfg.num_experts, k=cfg.k,
                         f=cfg.capacity_factor, mp=layout.mp, ep=layout.ep, esp=layout.esp)

    def choose(self, num_tokens: int) -> ParmChoice:
        if num_tokens not in self.choices:
            self._decide(num_tokens)
        return self.choices[num_tokens]

    def _decide(self, num_tokens: int) -> None:
        """(Re)make the decision for ``num_tokens`` with the agreed C_l, if any; log it when what runs changes."""
        watch, before = self.watch.get(num_tokens), self.choices.get(num_tokens)
        choice = choose_schedule(self.shape_for(num_tokens), self.costs, saa=self.model_saa,
                                 c_l=watch.agreed if watch is not None else None, tp=self._tp_allowed)
        if before is None or run_name(before) != run_name(choice):
            log.info("%s: parm-auto chose %s for %d tokens (t_s1=%.3g s with C_l=%.4g [%s], t_s2=%.3g s [%s], "
                     "t_baseline_tp=%s; costs: %s)", self.rec.layer, run_name(choice), num_tokens, choice.t_s1,
                     choice.s1_slots, choice.s1_source, choice.t_s2, choice.s2_form, _seconds(choice.t_tp),
                     self.costs_source)
        self.choices[num_tokens] = choice

    def observe(self, num_tokens: int, block_slots: Union[int, torch.Tensor]) -> None:
        """Note one call's C_l (S2 passes a 0-dim tensor: summed on the device, read on the host only on the
        agreement calls, every ``observe_every``); on those, agree with every rank and re-decide."""
        if self.observe_every <= 0 or self.groups.layout.mp == 1:
            return
        watch = self.watch.setdefault(num_tokens, _S1Watch())
        watch.calls, watch.seen, watch.total = watch.calls + 1, watch.seen + 1, watch.total + block_slots
        if (watch.calls - 1) % self.observe_every:
            return
        mean = -(-int(watch.total) // watch.seen)
        agreed = comm.all_reduce_max(comm.all_reduce_max(mean, self.groups.ep_esp, self.rec), self.groups.mp,
                                     self.rec)
        watch.seen = watch.total = 0
        if agreed != watch.agreed:
            watch.agreed = agreed
            self._decide(num_tokens)

    def notes(self) -> List[str]:
        return [f"parm-auto: {run_name(c)} for {tokens} tokens (t_s1 {c.t_s1 * 1e3:.3g} ms with C_l {c.s1_slots:.4g} "
                f"{c.s1_source}, t_s2 {c.t_s2 * 1e3:.3g} ms {c.s2_form}"
                + ("" if c.t_tp is None else f", t_baseline_tp {c.t_tp * 1e3:.3g} ms") + ")"
                for tokens, c in sorted(self.choices.items())]

    def ran(self) -> Set[str]:
        return set(self.made)

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        num_tokens = x_SM.shape[0]
        choice = self.choose(num_tokens)
        self.made.add(run_name(choice))
        self._state.saa, self._state.tp = choice.s2_form == "saa", choice.choice == SCHEDULE_TP
        if choice.choice == SCHEDULE_S1:
            dispatched = self._prepare_tokens(x_SM, params)
            block_slots = dispatched.state.block_slots
        elif choice.choice == SCHEDULE_TP:
            dispatched = self._tp.prepare(x_SM, params)
            block_slots = mp_block_slots(self._tp.routing_of(dispatched), self.config.num_experts, self.groups.mp.size)
        else:
            dispatched = self._prepare_capacity(x_SM, params)
            block_slots = mp_block_slots(dispatched.state.routing, self.config.num_experts, self.groups.mp.size)
        self.observe(num_tokens, block_slots)
        return dispatched

    # -- steps: DeepSpeed's flow when the call runs it, else Parm's (S1/S2, told apart by shape) ----------

    def exchange(self, d: torch.Tensor) -> Exchange:
        return self._tp.exchange(d) if self._state.tp else super().exchange(d)

    def exchange_in(self, d: torch.Tensor) -> torch.Tensor:
        return self._tp.exchange_in(d) if self._state.tp else super().exchange_in(d)

    def expert(self, e: torch.Tensor, params: LayerParams) -> torch.Tensor:
        return self._tp.expert(e, params) if self._state.tp else super().expert(e, params)

    def exchange_out(self, o: torch.Tensor) -> torch.Tensor:
        return self._tp.exchange_out(o) if self._state.tp else super().exchange_out(o)

    def finish(self, r: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return self._tp.finish(r, dispatched) if self._state.tp else super().finish(r, dispatched)


def _seconds(t: Optional[float]) -> str:
    return "not a candidate" if t is None else f"{t:.3g} s"


def run_name(choice: ParmChoice) -> str:
    """The registered schedule a decision runs as: parm-s1, parm-s2, parm-s2-saa or baseline-tp."""
    if choice.choice in (SCHEDULE_S1, SCHEDULE_TP):
        return choice.choice
    return ParmS2SAASchedule.name if choice.s2_form == "saa" else ParmS2Schedule.name


def parm_auto_for(profile, element_bytes: int, mp: int,
                  base: Type[ParmAutoSchedule] = ParmAutoSchedule) -> Type[ParmAutoSchedule]:
    """``parm-auto`` (or ``base``, e.g. parm-tune) deciding from a measured
    :class:`moe_plugins.core.costmodel.CostProfile` (None: the documented defaults, ``DEFAULT_COSTS_SOURCE``). With
    N_MP = 1 there is no MP split, S1 and S2 issue the same collectives and no MP all-gather exists to
    profile, so the defaults stand: the choice changes nothing."""
    if profile is None or mp == 1:
        return base
    return base.with_costs(ParmCosts.from_profile(profile, element_bytes), f"profile {profile.key.slug()}")
