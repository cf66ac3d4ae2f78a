"""The steps Parm's schedules share (parm.txt §III; :mod:`moe_plugins.parm.schedules` explains the schedules):
expert partial sums, S1's token split (the block routing, its local slots and C_l), S2's capacity split, and
``_ParmSchedule``, the prepare / exchange / expert / finish steps of S1 and S2 on padded buffers, which
parm-s1, parm-s2, parm-s2-saa and parm-auto build on (and the ragged forms, :mod:`moe_plugins.parm.ragged`,
reuse the block routing and the partials).

Shapes: S tokens of the MP group (s per rank), E experts (E_l per EP rank), C capacity (c a chunk), M model dim,
K routes per token, G = N_EP * N_ESP members of the fused group, P = N_MP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, ClassVar, Optional

import torch
import torch.nn.functional as F

from moe_plugins.core import comm
from moe_plugins.core.dispatch import combine, dispatch
from moe_plugins.core.experts import ExpertWeights, partial_ffn, sharded_experts
from moe_plugins.core.gating import BlockRouting, Routing
from moe_plugins.core.groups import Group
from moe_plugins.parm.saa import block_order, saa_gather, saa_scatter
from moe_plugins.core.schedule import Dispatched, Exchange, LayerParams, Schedule

log = logging.getLogger(__name__)


# ---- expert partial sums (no ESP reduction: Parm's local combine does it) -------------------------------

def sharded_expert_partials(x_ElNM: torch.Tensor, *, weights: ExpertWeights, activation: str,
                            esp_size: int) -> torch.Tensor:
    """This shard's H-partial of every local expert, plus b2 / N_ESP, so that the N_ESP partials of a row
    sum to the expert's output. b2 is replicated on the ESP shards; its gradient is scaled by N_ESP so each
    replica gets the full gradient, as with the ESP all-reduce of the baseline."""
    b2_EM = comm.grad_scale(weights.b2_EM, float(esp_size)) / esp_size
    return partial_ffn(x_ElNM, weights, activation) + b2_EM.unsqueeze(1)


def expert_partials(params: LayerParams, esp: Group) -> Callable[[torch.Tensor], torch.Tensor]:
    """The callable that gives un-reduced expert partials. With N_ESP = 1 the layer's ``experts`` is one
    already. Otherwise ``params.partial_experts`` when the host supplies it, else the core's
    :func:`sharded_experts` re-bound to its partial form."""
    if esp.size == 1:
        return params.experts
    supplied = getattr(params, "partial_experts", None)
    if supplied is not None:
        return supplied
    fn = params.experts
    if isinstance(fn, partial) and fn.func is sharded_experts and not fn.args:
        return partial(sharded_expert_partials, weights=fn.keywords["weights"],
                       activation=fn.keywords["activation"], esp_size=esp.size)
    raise ValueError(f"Parm schedules with esp ({esp.size}) > 1 need the experts' partial sums: the host must "
                     "supply LayerParams.partial_experts (its experts callable does the ESP all-reduce itself)")


# ---- prepared state ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _TokenSplit:
    """S1: this rank's token block, routed into its own C_l-slot buffer."""

    local: Routing          # this rank's s rows: slots in [0, C_l), weights split from the full routing
    num_tokens: int         # S before padding
    block_slots: int        # C_l of this MP group's blocks, before the EP&ESP max


@dataclass
class S2Form:
    """The running call's S2 form (SAA or not), and whether it runs DeepSpeed's flow (``tp``: parm-auto's
    third candidate), shared with PipeMoE's lane twin, whose exchanges read it."""

    saa: bool = True
    tp: bool = False


@dataclass
class _S1Watch:
    """What parm-auto has seen of S1's buffer for one token count: this MP group's C_l summed over the calls
    since the last agreement, and the agreed value (None before the first)."""

    calls: int = 0
    seen: int = 0
    total: int = 0
    agreed: Optional[int] = None


@dataclass(frozen=True)
class _CapacitySplit:
    """S2: the MP group's full routing; the capacity axis is split over MP."""

    routing: Routing


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _pad_rows(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_full((rows - t.shape[0],) + tuple(t.shape[1:]), value)
    return torch.cat([t, pad])


def block_counts(expert_SK: torch.Tensor, slot_SK: torch.Tensor, num_experts: int, blocks: int,
                 block_rows: int) -> torch.Tensor:
    """counts_PE: kept routes of each token block (rows [p*s, (p+1)*s)) per expert."""
    kept_SK = slot_SK >= 0
    block_SK = (torch.arange(expert_SK.shape[0], device=expert_SK.device) // block_rows).unsqueeze(1).expand_as(kept_SK)
    bins = blocks * num_experts                       # dropped routes count in a scratch bin (no host read)
    flat = torch.where(kept_SK, block_SK * num_experts + expert_SK, bins).reshape(-1)
    counts = torch.zeros(bins + 1, dtype=torch.long, device=expert_SK.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))[:bins].view(blocks, num_experts)


def local_slots(expert_sK: torch.Tensor, slot_sK: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """Slots of a token block's kept routes in its own buffer: the baseline's slot order, compacted per
    expert (route at global slot j of expert e goes to the number of the block's kept routes of e below
    j). Dropped routes stay -1."""
    kept = slot_sK >= 0                               # no boolean-mask indexing: its size is a host read
    slot_sK = torch.where(kept, slot_sK, cap)         # dropped routes: a scratch column at index cap
    occupied_EC = torch.zeros(num_experts, cap + 1, dtype=torch.long, device=expert_sK.device)
    occupied_EC[expert_sK, slot_sK] = kept.long()     # kept (e, slot) pairs are distinct; scratch writes are 0
    rank_EC = occupied_EC.cumsum(1) - 1
    rank_EC[:, cap] = -1
    return rank_EC[expert_sK, slot_sK]


def mp_block_slots(routing: Routing, num_experts: int, blocks: int) -> torch.Tensor:
    """C_l that S1 would use for this routing of the MP group's whole token block (before the EP&ESP max):
    the largest per-expert count of kept routes over its ``blocks`` token blocks (0-dim, not read)."""
    rows = _round_up(routing.num_tokens, blocks)
    counts_PE = block_counts(_pad_rows(routing.expert_SK, rows, 0), _pad_rows(routing.slot_SK, rows, -1),
                             num_experts, blocks, rows // blocks)
    return counts_PE.max()


def whole_block_routing(routing: Routing, num_experts: int, mp: Group, rec: comm.Recorder) -> BlockRouting:
    """S1 with a gate that cannot be split (``LayerParams.block_router`` is None): the routing of the MP
    group's whole token block, made on every MP rank, cut down to this rank's rows. The combine weights are
    MP-split, so in backward their S x K gradient is all-gathered and the gate weight's gradient is complete
    on every MP rank."""
    num_tokens = routing.num_tokens
    rows = _round_up(num_tokens, mp.size)
    s = rows // mp.size
    expert_SK = _pad_rows(routing.expert_SK, rows, 0)
    slot_SK = _pad_rows(routing.slot_SK, rows, -1)
    own = slice(mp.rank * s, (mp.rank + 1) * s)
    w_sK = comm.split(F.pad(routing.weight_SK, (0, 0, 0, rows - num_tokens)), mp, rec, dim=0)
    mine = Routing(expert_SK=expert_SK[own], slot_SK=slot_SK[own], weight_SK=w_sK, capacity=routing.capacity,
                   aux_loss=routing.aux_loss, exp_counts_E=routing.exp_counts_E)
    return BlockRouting(routing=mine, kept_PE=block_counts(expert_SK, slot_SK, num_experts, mp.size, s),
                        dropped=routing.dropped)


# ---- the schedules ---------------------------------------------------------------------------------------

class _ParmSchedule(Schedule):
    """Steps 2-4, shared by S1 and S2 (so parm-auto's pipeline twin needs no state)."""

    saa: ClassVar[bool] = False
    needs_expert_partials: ClassVar[bool] = True     # the local combine sums partial ESP outputs itself

    def exchange(self, d: torch.Tensor) -> Exchange:
        # S1 (d_EcM): the dump copies each row to the N_ESP shards; S2 (d_EPcM): MP-split first, then the dump
        per = self.groups.esp.size / (self.groups.mp.size if d.dim() == 4 else 1)
        return Exchange("ep_esp", per, per)

    def saa_now(self) -> bool:
        """Whether this call's S2 exchange runs as SAA (the class's ``saa``; parm-tune decides per call)."""
        return self.saa

    @property
    def _esp(self) -> int:
        return self.groups.esp.size

    def _order(self):
        return block_order(self.groups.layout, self.groups.mp, self._esp)

    def _dump(self, d_EXM: torch.Tensor) -> torch.Tensor:
        """Fig. 4c's local dump: the rows for EP block b go to each of its N_ESP expert shards."""
        esp, g = self._esp, self.groups.ep_esp.size
        rest = tuple(d_EXM.shape[1:])
        blocks = d_EXM.reshape((g // esp, 1, d_EXM.shape[0] * esp // g) + rest)
        return blocks.expand((g // esp, esp) + tuple(blocks.shape[2:])).reshape((g, blocks.shape[2]) + rest)

    def exchange_in(self, d: torch.Tensor) -> torch.Tensor:
        groups = self.groups
        if d.dim() == 4:                                         # S2: d_EPcM, keep this rank's MP block
            if self.saa_now() and groups.mp.size > 1:
                return saa_scatter(d, ep_esp=groups.ep_esp, mp=groups.mp, esp=self._esp, order=self._order(),
                                   rec=self.rec)
            d = comm.split(d, groups.mp, self.rec, dim=1)        # E, 1, c, M
        return comm.all_to_all(self._dump(d), groups.ep_esp, self.rec)

    def expert(self, e: torch.Tensor, params: LayerParams) -> torch.Tensor:
        """Rows from every member of the fused group, regrouped per local expert; H-partials come back."""
        g, e_l, m = e.shape[0], e.shape[1], e.shape[-1]
        x_ElNM = e.transpose(0, 1).reshape(e_l, e.numel() // max(e_l * m, 1), m)
        y_ElNM = expert_partials(params, self.groups.esp)(x_ElNM)
        return y_ElNM.reshape((e_l, g) + tuple(e.shape[2:])).transpose(0, 1)

    def exchange_out(self, o: torch.Tensor) -> torch.Tensor:
        groups, esp = self.groups, self._esp
        if o.dim() == 5 and self.saa_now() and groups.mp.size > 1:    # S2 with SAA: r_EPcM
            return saa_gather(o, ep_esp=groups.ep_esp, mp=groups.mp, esp=esp, order=self._order(), rec=self.rec)
        r = comm.all_to_all(o, groups.ep_esp, self.rec)
        g, e_l, rest = r.shape[0], r.shape[1], tuple(r.shape[2:])
        r = r.reshape((g // esp, esp, e_l) + rest).sum(1).reshape((g // esp * e_l,) + rest)   # Fig. 4d
        if r.dim() == 4:                                         # S2: gather the capacity over MP
            r = comm.all_gather(r, groups.mp, self.rec, dim=1, bwd="split")
        return r

    # -- S1 ---------------------------------------------------------------------------------------------

    def _block_routing(self, x_SM: torch.Tensor, params: LayerParams):
        """This MP rank's token block x_sM, its BlockRouting, and its routing with block-local slots (capacity
        still the gate's C)."""
        cfg, mp, rec = self.config, self.groups.mp, self.rec
        num_tokens, e = x_SM.shape[0], cfg.num_experts
        rows = _round_up(num_tokens, mp.size)
        x_sM = comm.split(F.pad(x_SM, (0, 0, 0, rows - num_tokens)), mp, rec, dim=0)
        if params.block_router is not None:
            block = params.block_router(x_sM, num_tokens)
        else:
            block = whole_block_routing(params.router(x_SM), e, mp, rec)
        routing = block.routing
        local = Routing(expert_SK=routing.expert_SK,
                        slot_SK=local_slots(routing.expert_SK, routing.slot_SK, e, routing.capacity),
                        weight_SK=routing.weight_SK, capacity=routing.capacity, aux_loss=routing.aux_loss,
                        exp_counts_E=routing.exp_counts_E)
        return x_sM, block, local

    def _prepare_tokens(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        e, num_tokens = self.config.num_experts, x_SM.shape[0]
        x_sM, block, local = self._block_routing(x_SM, params)
        cap_local = block_slots = int(block.kept_PE.max())
        if not set(self.groups.ep_esp.ranks) <= set(self.groups.mp.ranks):  # members with other tokens: agree
            cap_local = comm.all_reduce_max(cap_local, self.groups.ep_esp, self.rec)
        cap_local = max(cap_local, 1)
        local = replace(local, capacity=cap_local)
        d_EcM = dispatch(x_sM, local, e, cap_local)
        return Dispatched(d=d_EcM, cap_dim=1, state=_TokenSplit(local, num_tokens, block_slots),
                          aux_loss=local.aux_loss, exp_counts_E=local.exp_counts_E, dropped=block.dropped)

    def _finish_tokens(self, r_EcM: torch.Tensor, st: _TokenSplit) -> torch.Tensor:
        y_sM = combine(r_EcM, st.local)
        return comm.all_gather(y_sM, self.groups.mp, self.rec, dim=0, bwd="split")[:st.num_tokens]

    # -- S2 ---------------------------------------------------------------------------------------------

    def _prepare_capacity(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        cfg, p = self.config, self.groups.mp.size
        routing = params.router(x_SM)
        slots = _round_up(routing.capacity, p)
        d_EPcM = dispatch(x_SM, routing, cfg.num_experts, slots).view(cfg.num_experts, p, slots // p, -1)
        return Dispatched(d=d_EPcM, cap_dim=2, state=_CapacitySplit(routing), aux_loss=routing.aux_loss,
                          exp_counts_E=routing.exp_counts_E, dropped=routing.dropped)

    def _finish_capacity(self, r_EPcM: torch.Tensor, st: _CapacitySplit) -> torch.Tensor:
        e, p, c, m = r_EPcM.shape
        return combine(r_EPcM.reshape(e, p * c, m), st.routing)

    def finish(self, r: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        st = dispatched.state
        if isinstance(st, _TokenSplit):
            return self._finish_tokens(r, st)
        return self._finish_capacity(r, st)
