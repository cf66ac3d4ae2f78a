"""Hecate's schedule (``"hecate"``): the baseline's ragged data flow with FSSDP's sparse materialisation.

One call (ESP 1; docs/hecate.md, "The FSSDP layer"; at PipeMoE's integer pipeline degree r > 1 steps 5 and 6 run
per piece, :func:`~moe_plugins.hecate.flow.piece_plans`, the copies shared by every piece):

1. **Gate** (the layer's router) and the ragged route order (``core/ragged.py``): this rank's kept routes per
   expert.
2. **Counts.** Those E integers are all-gathered over the EP group (the FSSDP group): one collective and one
   host read. Their column sums are the global load (what :func:`~moe_plugins.hecate.plan.global_load`'s
   all-reduce gives), pushed into the layer's :class:`~moe_plugins.hecate.plan.LoadWindow`; and every rank
   learns every source's counts, so each computes every source's split sizes itself.
3. **Plan.** Algorithm 1 on the window's mean load: owners = the stock EP owners (``whole_shards``: the layer's
   own expert parameters stay the owners, so checkpoints stay stock), overlap degree t = E (no attention time is
   known in the layer), memory budget m = ``extra_experts`` ("auto": E / EP). Every rank plans the same.
4. **spAG** materialises this rank's copies (its own experts included) from the owners' flat parameters, one
   uneven all-to-all; its backward is spRS, so the owners' parameters get the sum of all copies' gradients.
5. **Dispatch.** Each kept route goes to a copy of its expert (local copy, then same node, then remote; even),
   rows sent destination by destination in one uneven all-to-all (:func:`~moe_plugins.hecate.flow.route_plan`).
6. **Experts** on the received rows grouped per copy (``expert_rows``), with the copies' weights and the core's
   functional FFN; **reverse exchange**; the combine of the ragged baseline (``combine_rows``).

With ``prefetch`` (moe_plugins/hecate/early.py) steps 3 and 4 come first: :meth:`HecateSchedule.prefetch` plans
from the previous calls' load with t = max(the measured overlap degree, the experts whose copies pay for
themselves: :func:`~moe_plugins.hecate.plan.paying_experts`) and issues the spAG on the engine's pipeline
lane (from the block's forward pre-hook, or at the start of the call); step 2 then only feeds the window and
carries each rank's t_r, and the call waits for the gather after its route plan.

With ``rematerialize`` (moe_plugins/hecate/remat.py) step 6 runs under saved-tensor hooks: the copies are freed
after it and spAG runs again for the expert step's backward, early on the pipeline lane where there is one
(moe_plugins/hecate/regather.py). Every copy tensor is recorded in the
layer's copy-memory ledger (:attr:`HecateSchedule.memory`, moe_plugins/hecate/memory.py).

Each rank's copies reach the loss on every call (its own experts are always among them, computed on padding
when no row arrives), so every rank takes part in spRS. Shapes: S tokens, X kept routes of this rank, Q rows it
receives, C experts it holds a copy of, n rows per copy (padded), M model dim, F elements per expert.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple, Type

import torch

from moe_plugins.core import comm
from moe_plugins.core.experts import ExpertWeights, partial_ffn
from moe_plugins.core.ragged import combine_rows, expert_rows, ragged_all_to_all, route_order
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, RowLoad, Schedule
from moe_plugins.hecate.config import NAME, HecateConfig
from moe_plugins.hecate.early import EarlyGather, agreed_overlap, issue_early
from moe_plugins.hecate.flow import (RoutePlan, expert_numel, ffn_activation_problems, flat_experts,
                                     piece_plans, rows_per_expert, unflat_experts)
from moe_plugins.hecate.memory import CopyLedger
from moe_plugins.hecate.plan import Placement, materialise_budget, paying_experts, plan_placement, stock_homes
from moe_plugins.hecate.state import Call, HecateStats, State
from moe_plugins.hecate.regather import rematerialiser, start_at_output
from moe_plugins.hecate.remat import OwnedRead, Rematerialiser
from moe_plugins.hecate.sparse import ShardSpec, sparse_all_gather, sparse_exchange, whole_shards


class HecateSchedule(Schedule):
    """FSSDP on the baseline's ragged data flow (module docstring). Options: :attr:`options`
    (:meth:`configured`, :meth:`from_section`)."""

    name = NAME
    exchange_mode = "ragged"
    needs_expert_weights = True
    options: ClassVar[HecateConfig] = HecateConfig()
    activation: ClassVar[Optional[str]] = None     # the copies' activation; None: MoEConfig.activation

    @classmethod
    def configured(cls, options: HecateConfig, activation: Optional[str] = None) -> Type["HecateSchedule"]:
        """This schedule with ``options`` (a subclass under the same registered name) and, from a host whose
        experts' activation differs from the layer config's (DeepSpeed's tanh GELU), the copies' ``activation``."""
        if not isinstance(options, HecateConfig):
            raise ValueError(f"options ({options!r}) must be a HecateConfig")
        problems = ffn_activation_problems(activation) if activation is not None else []
        if problems:
            raise ValueError(problems[0])
        return type(cls.__name__, (cls,), {"options": options, "activation": activation, "__module__": cls.__module__})

    @classmethod
    def from_section(cls, section: Optional[Mapping[str, Any]],
                     path: str = "moe_plugins.hecate") -> Type["HecateSchedule"]:
        """This schedule configured from a ``hecate`` section (None: the defaults); a ValueError names every
        bad field."""
        return cls.configured(HecateConfig.from_dict(section, path))

    @classmethod
    def exchange_variant(cls, exchange: str) -> Optional[Type[Schedule]]:
        return cls if exchange == "ragged" else None

    @classmethod
    def layout_problems(cls, groups_layout) -> List[str]:
        if groups_layout.esp != 1:
            return [f"schedule '{NAME}' runs at esp 1, not {groups_layout.esp}: copies of ESP shards are not built"]
        return []

    @classmethod
    def degree_problems(cls, pipeline_degree: Any) -> List[str]:
        if pipeline_degree in (1, "1"):
            return []
        if cls.options.rematerialize:
            return [f"schedule '{NAME}' with rematerialize runs pipeline_degree 1, not {pipeline_degree!r}: the "
                    "re-gather is built for one expert step per call"]
        return []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._state = State(self.config.num_experts, self.rec.layer, self.stock_homes())

    def twin(self, groups) -> "HecateSchedule":
        twin = type(self)(self.config, groups, self.rec)
        twin._state = self._state
        return twin

    def exchange(self, d: torch.Tensor) -> Exchange:
        return Exchange("ep", 1.0, 1.0)             # the rows to the copies, over EP (a degree word's row_load)

    def row_load(self, dispatched: Dispatched) -> RowLoad:
        return dispatched.state.row_load(self.groups, self.rec)

    @property
    def last(self) -> Optional[HecateStats]:
        """The last call's placement, global load and this rank's computed rows (None before the first)."""
        return self._state.last

    @property
    def overlap(self) -> Optional[int]:
        """With ``prefetch``: the overlap degree t every rank agreed on at the last call (None before it)."""
        return self._state.overlap

    @property
    def regathers(self) -> Dict[str, int]:      # rematerialize: re-gathers by what started them (regather.py)
        return dict(self._state.regathers)

    @property
    def memory(self) -> CopyLedger:
        """This layer's copy-memory ledger on this rank (merge several layers' with ``memory.live_peak``)."""
        return self._state.memory

    def notes(self) -> List[str]:
        state, last = self._state, self._state.last
        if last is None:
            return []
        remat = "; copies freed after forward, re-gathered in backward" if self.options.rematerialize else ""
        homes = f"; experts re-homed to ranks {list(state.homes)}" if state.homes != self.stock_homes() else ""
        early = (f"; gathered early, planned with t {state.planned} (hidden-time t now {state.overlap})"
                 if self.options.prefetch else "")
        return [f"hecate: copies per expert {[len(c) for c in last.placement.copies_E]} "
                f"({last.extra_copies()} beyond the homes){remat}{early}{homes}"]

    # ---- the plan --------------------------------------------------------------------------------------
    def _counts(self, counts_E: torch.Tensor) -> List[List[int]]:
        """Every EP member's kept routes per expert (with ``prefetch``, then its overlap degree t_r, which
        sets the agreed t): one all-gather, one host read."""
        ep, state = self.groups.ep, self._state
        counts_E = counts_E.to(torch.int64).contiguous()
        if self.options.prefetch:
            degree = state.meter.degree(state.expert_bytes)
            counts_E = torch.cat([counts_E, counts_E.new_tensor([degree])])
        got = counts_E if ep.size == 1 else self.rec.issue("all_gather", ep, counts_E, "forward")
        flat, num = got.tolist(), counts_E.numel()                                  # the host read
        rows = [flat[r * num:(r + 1) * num] for r in range(ep.size)]
        if self.options.prefetch:
            state.overlap = agreed_overlap([row.pop() for row in rows], self.config.num_experts)
        return rows

    def _placement(self, counts_RE: List[List[int]],
                   early: Optional[EarlyGather]) -> Tuple[Placement, Tuple[int, ...]]:
        """This call's placement (the early gather's, planned before this call's load was known) and its load."""
        load_E = tuple(sum(col) for col in zip(*counts_RE))
        self._state.window = self._state.window.push(load_E)
        if early is not None:
            return early.placement, load_E
        return self._plan(self.config.num_experts), load_E

    def _plan(self, overlap: int, load_E=None) -> Placement:
        """Algorithm 1 on ``load_E`` (default: the window's mean load) with overlap degree ``overlap``."""
        ep, num = self.groups.ep, self.config.num_experts
        budget = materialise_budget(overlap, self.options.budget_m(num // ep.size), num)
        load_E = self._state.window.mean() if load_E is None else load_E
        return plan_placement(load_E, self._state.homes, self.fssdp_nodes(), budget)

    def _shards(self) -> ShardSpec:
        cfg = self.config
        return whole_shards(expert_numel(cfg.hidden, cfg.ffn), self._state.homes, self.groups.ep.size)

    # ---- the homes (Algorithm 2 moves them: moe_plugins/hecate/rehome.py) --------------------------------
    @property
    def homes(self) -> Tuple[int, ...]:
        """Each expert's owner (EP member): its storage holds its experts in ascending id."""
        return self._state.homes

    def stock_homes(self) -> Tuple[int, ...]:
        return stock_homes(self.config.num_experts, self.groups.ep.size)

    def set_homes(self, homes_E: Tuple[int, ...], pooled: bool = False) -> None:
        """After the storage moved to ``homes_E`` (E / EP experts per member; any number with ``pooled`` slots)."""
        num, ranks = self.config.num_experts, self.groups.ep.size
        per_R = [list(homes_E).count(r) for r in range(ranks)]        # a home out of range is counted nowhere
        if len(homes_E) != num or sum(per_R) != num or (not pooled and per_R != [num // ranks] * ranks):
            raise ValueError(f"homes_E ({list(homes_E)}) must give each of the {num} experts one of the {ranks} EP "
                             f"members{'' if pooled else f', {num // ranks} each'}")
        if self._state.early is not None:          # a gather planned on the old homes reads the wrong rows
            self._state.early.drain()
            self._state.early = None
        self._state.homes = tuple(int(r) for r in homes_E)

    def window_load(self) -> Tuple[int, ...]:
        """The load window's routes per expert, summed over its iterations (integers)."""
        return tuple(sum(col) for col in zip(*self._state.window.loads_WE)) or (0,) * self.config.num_experts

    def overlappable(self, load_E) -> Tuple[int, ...]:
        """Algorithm 2's J: the experts Algorithm 1 copies beyond their home under load ``load_E``."""
        num = self.config.num_experts
        t = self._state.overlap if self.options.prefetch and self._state.overlap is not None else num
        return tuple(e for e, copies in enumerate(self._plan(t, load_E).copies_E) if len(copies) > 1)

    def fssdp_nodes(self) -> Tuple[int, ...]:
        return tuple(self.groups.layout.node_of(r) for r in self.groups.ep.ranks)

    # ---- the early gather ------------------------------------------------------------------------------
    def prefetch(self, weights: Optional[ExpertWeights]) -> None:
        """With ``prefetch``: plan the next call from the previous calls' load (the first call: the homes only)
        with the agreed overlap degree, and issue its spAG on the engine's pipeline lane now. A gather still
        pending (issued for a call that never ran) is waited for and dropped first. Without it: nothing."""
        if not self.options.prefetch or weights is None:
            return
        state = self._state
        if state.early is not None:
            state.early.drain()
            state.early = None
        with torch.no_grad():
            w_owned_O = flat_experts(weights)
        state.expert_bytes = expert_numel(self.config.hidden, self.config.ffn) * w_owned_O.element_size()
        overlap = 0
        if state.window.loads_WE:         # t: what hides under the work before the layer, or pays for itself
            paying = paying_experts(state.window.mean(), self.config.hidden * w_owned_O.element_size(),
                                    state.expert_bytes, self.groups.ep.size)
            overlap = max(paying, state.overlap if state.overlap is not None else self.config.num_experts)
        state.planned = overlap
        placement = self._plan(overlap)
        ex = sparse_exchange(placement, self._shards(), self.groups.ep.rank)
        state.early = issue_early(w_owned_O, placement, ex, self.groups.ep, self.rec)

    def _take_early(self, weights: ExpertWeights) -> Optional[EarlyGather]:
        if not self.options.prefetch:
            return None
        if self._state.early is None:           # no block hook issued it: issue it now (only the gate hides it)
            self.prefetch(weights)
        early, self._state.early = self._state.early, None
        return early

    def _received(self, early: EarlyGather) -> torch.Tensor:
        recv_Q, hide_ns, took_ns = early.received(self.rec)
        if early.hidden:
            self._state.meter.measure(hide_ns, took_ns, early.wire_bytes)
        return recv_Q

    # ---- the five steps --------------------------------------------------------------------------------
    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        if params.expert_weights is None:
            raise ValueError(f"schedule '{NAME}' needs LayerParams.expert_weights (this rank's experts as "
                             "ExpertWeights): the core layer and the DeepSpeed host supply them; the Megatron-core "
                             "host does not")
        cfg, ep = self.config, self.groups.ep
        early = self._take_early(params.expert_weights)
        try:
            routing = params.router(x_SM)
            order = route_order([routing], cfg.num_experts)
            counts_RE = self._counts(order.counts_EN[:, 0])
            placement, load_E = self._placement(counts_RE, early)
            pieces = piece_plans(counts_RE, ep.rank, placement, 1)
            received = None if early is None else self._received(early)
        except BaseException:
            if early is not None:
                early.drain()           # its lane stays in step; the call fails as it would have
            raise
        shards = self._shards()
        w_CF = sparse_all_gather(flat_experts(params.expert_weights), placement, shards, ep, self.rec, received)
        kept = sum(counts_RE[ep.rank])          # d: this rank's kept rows in the whole call's send order
        whole_X = _index(pieces[0].rows, x_SM.device)                 # d's rows as (expert, slot) rows
        at_R = torch.argsort(whole_X)
        pos_SK = torch.cat([at_R, at_R.new_full((1,), kept)])[order.pos_NSK[0]]     # the combine reads d's order
        self._state.call = Call(routing, pos_SK, counts_RE, placement, at_R, pieces,
                                 unflat_experts(w_CF, cfg.hidden, cfg.ffn),
                                 self._track(w_CF, params, placement, shards))
        self._state.last = HecateStats(placement, load_E, rows_per_expert(pieces, cfg.num_experts))
        token_X = order.token_X[:kept].index_select(0, whole_X)
        return Dispatched(d=x_SM.index_select(0, token_X), cap_dim=0, state=self._state.call,
                          aux_loss=routing.aux_loss, exp_counts_E=routing.exp_counts_E, dropped=routing.dropped)

    def _track(self, w_CF: torch.Tensor, params: LayerParams, placement: Placement,
               shards: ShardSpec) -> Optional[Rematerialiser]:
        """Record the call's copies in the memory ledger; with ``rematerialize``, how to gather them again."""
        state = self._state
        call, state.calls = state.calls, state.calls + 1
        state.memory.track(w_CF, "forward", call)
        if not self.options.rematerialize:
            return None
        return rematerialiser(w_CF, OwnedRead(params.expert_weights), placement, shards, self.groups.ep, self.rec,
                              partial(state.memory.track, phase="backward", call=call), state.chain,
                              state.regathers, early=self.options.regather == "early")

    def join_chain(self, chain: Any) -> None:
        """Re-gather early when the next layer of ``chain`` (a ``regather.RegatherChain``) releases its copies."""
        self._state.chain = chain

    def chunks(self, dispatched: Dispatched, degree: int) -> List[torch.Tensor]:
        """The pieces, each in its send order: ``d`` itself (the whole call), or PipeMoE's ``degree`` chunks
        (``flow.piece_plans``), cut from ``d`` by where their rows sit in it."""
        problems = self.degree_problems(degree)
        if problems:
            raise ValueError(problems[0])
        call: Call = dispatched.state
        if degree == 1:
            return [dispatched.d]
        call.pieces = piece_plans(call.counts_RE, self.groups.ep.rank, call.placement, degree)
        last = self._state.last
        if last is not None:
            self._state.last = HecateStats(last.placement, last.load_E, rows_per_expert(call.pieces, len(last.load_E)))
        d = dispatched.d
        call.at_X = call.at_R.index_select(0, _index([r for p in call.pieces for r in p.rows], d.device))
        return list(d.index_select(0, call.at_X).split([len(p.rows) for p in call.pieces]))

    def join(self, outs: List[torch.Tensor], dispatched: Dispatched) -> torch.Tensor:
        """The pieces' rows back in ``d``'s order (the whole call's send order)."""
        if len(outs) == 1:
            return outs[0]
        return torch.cat(outs).index_select(0, torch.argsort(dispatched.state.at_X))

    def _piece(self, step: str, rows: int, side: str) -> Tuple[Call, RoutePlan]:
        """The call in flight and its next piece for ``step``, checked: ``rows`` must be the piece's ``side``
        ("send" or "recv") total."""
        call = self._state.call
        if call is None:
            raise ValueError(f"schedule '{NAME}': {step} before prepare")
        index = call.taken[step]
        if index >= len(call.pieces):
            raise ValueError(f"schedule '{NAME}': {step} called more often than the call has pieces "
                             f"({len(call.pieces)})")
        plan = call.pieces[index].plan
        if rows != sum(getattr(plan, side)):
            raise ValueError(f"schedule '{NAME}': {step} got {rows} rows, not the {sum(getattr(plan, side))} of "
                             f"piece {index} of {len(call.pieces)}; run the pieces through Schedule.chunks and join")
        call.taken[step] = index + 1
        return call, plan

    def exchange_in(self, d_XM: torch.Tensor) -> torch.Tensor:
        _, plan = self._piece("exchange_in", d_XM.shape[0], "send")
        return ragged_all_to_all(d_XM, plan.send, plan.recv, self.groups.ep, self.rec)

    def expert(self, e_QM: torch.Tensor, params: LayerParams) -> torch.Tensor:
        call, plan = self._piece("expert", e_QM.shape[0], "recv")
        model_dim, replicas = e_QM.shape[-1], self.groups.mp.size
        gather, back, rows = expert_rows(plan.recv_RC)
        padded = torch.cat([e_QM, e_QM.new_zeros(1, model_dim)])
        x_CnM = padded.index_select(0, _index(gather, e_QM.device)).view(len(plan.experts), rows, model_dim)
        if replicas > 1:          # MP replicas: every row arrives once per replica (as the baseline)
            x_CnM = comm.grad_scale(x_CnM, float(replicas))
        activation, copies = self.activation or self.config.activation, call.copies
        if copies is None:
            raise ValueError(f"schedule '{NAME}': expert called twice for one call (its copies are freed after use)")
        with call.remat.hooks() if call.remat is not None else nullcontext():
            y_CnM = partial_ffn(x_CnM, copies, activation) + copies.b2_EM.unsqueeze(1)
        if call.taken["expert"] == len(call.pieces):
            call.copies = None    # from here only autograd holds the copies (none of them with rematerialize)
        if replicas > 1:
            y_CnM = comm.grad_scale(y_CnM, 1.0 / replicas)
        return y_CnM.reshape(-1, model_dim).index_select(0, _index(back, e_QM.device))

    def exchange_out(self, o_QM: torch.Tensor) -> torch.Tensor:
        _, plan = self._piece("exchange_out", o_QM.shape[0], "recv")
        return ragged_all_to_all(o_QM, plan.recv, plan.send, self.groups.ep, self.rec)

    def finish(self, r_XM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        call: Call = dispatched.state
        if self._state.call is call:
            self._state.call = None         # hold nothing of this call (its copies) past the layer
        y_SM = combine_rows(r_XM, call.pos_SK, call.routing)      # r_XM in d's order (join), as pos_SK reads it
        if call.remat is not None:
            start_at_output(call.remat, y_SM)    # the re-gather starts with the backward, if nothing started it
        return y_SM


def _index(rows, device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)
