"""Lina's expert packing (§4.2, §6.1) as pure functions: the packed layout, the rule that doubles the
packing, the index maps of the one all-to-all that moves the experts, and checkpoint conversion between
packings by global expert id.

Packing ``p`` on a base layout with ``ep = EP0`` is the layout with ``ep = EP0 / p``: every device holds ``p``
times more experts and expert-DP grows by ``p``; world, MP, ESP and the nodes stay. Global expert ids never
change: expert ``e`` lives on the ranks whose EP index is ``e // E_l`` (``E_l = E / ep``), as
:func:`moe_plugins.core.experts.shard_weights` places it.

The move. Of two layouts whose EP degrees divide one another, call *fine* the one with the larger EP. Member
``j`` of a fine EP group (its ranks in order: ``base + j * ESP``) has EP index ``j % ep_x`` in either layout
``x``, so every expert either layout places on a member is held by some member of the same fine EP group:
one all-to-all inside each fine EP group moves everything (:func:`move_plan`).

Shapes: E experts (E_l local), M model dim, H FFN hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch

from moe_plugins.core.experts import ffn_shard, local_experts
from moe_plugins.core.layout import ParallelLayout

AUTO = "auto"
START_STEP, EVERY_STEPS = 10, 4            # paper §7: packing from the 10th step, adjusted every 4 steps
EXPERT_KEYS = ("w1_EMH", "b1_EH", "w2_EHM", "b2_EM")
H_DIM = {"w1_EMH": 2, "b1_EH": 1, "w2_EHM": 1, "b2_EM": None}   # the ESP-sharded axis (b2 is replicated)


# ---- layouts ------------------------------------------------------------------------------------------

def packing_layout_problems(packing: Union[int, str], layout: ParallelLayout, num_experts: int,
                            path: str = "moe_plugins.lina") -> List[str]:
    """Every reason ``packing`` cannot pack ``layout`` (the unpacked one), each naming ``path.packing``: a
    fixed packing must divide the expert-parallel degree (the devices the experts are spread over), so that
    each device gets ``p`` times its ``num_experts / ep`` local experts."""
    if packing == AUTO:
        return []
    if not isinstance(packing, int) or isinstance(packing, bool) or packing < 1:
        return [f'{path}.packing ({packing!r}) must be an integer >= 1 (experts per device), or "auto"']
    if layout.ep % packing:
        return [f"{path}.packing ({packing}) must divide ep ({layout.ep}), the devices that the {num_experts} "
                f"experts ({num_experts // layout.ep} local per device) are spread over"]
    return []


def packed_layout(layout: ParallelLayout, packing: int) -> ParallelLayout:
    """``layout`` with its experts packed ``packing`` per device: ``ep = layout.ep / packing``."""
    if not isinstance(packing, int) or isinstance(packing, bool) or packing < 1 or layout.ep % packing:
        raise ValueError(f"packing ({packing!r}) must be a positive integer dividing ep ({layout.ep})")
    return ParallelLayout(world=layout.world, ranks_per_node=layout.ranks_per_node, mp=layout.mp,
                          ep=layout.ep // packing, esp=layout.esp)


def regroup_problems(old: ParallelLayout, new: ParallelLayout, num_experts: int) -> List[str]:
    """Why ``old`` cannot be regrouped into ``new`` by moving experts (empty when it can)."""
    problems = [f"{name} ({getattr(old, name)} -> {getattr(new, name)}) must stay the same when packing"
                for name in ("world", "ranks_per_node", "mp", "esp") if getattr(old, name) != getattr(new, name)]
    fine, coarse = max(old.ep, new.ep), min(old.ep, new.ep)
    if fine % coarse:
        problems.append(f"ep ({old.ep} -> {new.ep}): one must divide the other")
    if num_experts % fine:
        problems.append(f"num_experts ({num_experts}) must be divisible by ep ({fine})")
    return problems


def expert_block(num_experts: int, ep: int, ep_index: int) -> range:
    """Global ids of the experts on EP index ``ep_index`` of ``ep``."""
    if num_experts % ep or not 0 <= ep_index < ep:
        raise ValueError(f"ep_index ({ep_index}) of ep ({ep}) with num_experts ({num_experts}): ep must divide "
                         "num_experts and the index lie in [0, ep)")
    n = num_experts // ep
    return range(ep_index * n, (ep_index + 1) * n)


# ---- the move -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MovePlan:
    """Inside one fine EP group of ``size`` members: ``sends[i][j]``, the global expert ids member ``i``
    sends to member ``j`` (ascending; ``sends[j][j]`` are those it keeps). Member ``j`` then holds
    ``expert_block(E, ep_to, j % ep_to)``, in order, out of the rows received from members 0, 1, ..."""

    size: int
    num_experts: int
    ep_from: int
    ep_to: int
    sends: Tuple[Tuple[Tuple[int, ...], ...], ...]

    def received(self, j: int) -> List[int]:
        """The ids member ``j`` receives, in the order they arrive (source 0 first)."""
        return [e for i in range(self.size) for e in self.sends[i][j]]


def move_plan(num_experts: int, ep_from: int, ep_to: int) -> MovePlan:
    """Who sends which expert to whom when EP goes from ``ep_from`` to ``ep_to`` (one divides the other). A
    member keeps an expert it holds; otherwise the nearest holder after it (ring order) sends it, which
    spreads the senders evenly."""
    fine, coarse = max(ep_from, ep_to), min(ep_from, ep_to)
    if coarse < 1 or fine % coarse or num_experts % fine:
        raise ValueError(f"ep ({ep_from} -> {ep_to}) with num_experts ({num_experts}): one ep must divide the "
                         "other and both divide num_experts")
    held = [expert_block(num_experts, ep_from, i % ep_from) for i in range(fine)]
    sends: List[List[List[int]]] = [[[] for _ in range(fine)] for _ in range(fine)]
    for j in range(fine):
        for e in expert_block(num_experts, ep_to, j % ep_to):
            holders = [i for i in range(fine) if e in held[i]]
            src = j if j in holders else min(holders, key=lambda i: (i - j) % fine)
            sends[src][j].append(e)
    return MovePlan(fine, num_experts, ep_from, ep_to, tuple(tuple(tuple(s) for s in row) for row in sends))


# ---- the rule -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MicroOpTimes:
    """Summed durations (s) and counts of the timed forward micro-ops: the expert FFN steps and the exchange
    (all-to-all) steps."""

    expert_s: float = 0.0
    expert_n: int = 0
    a2a_s: float = 0.0
    a2a_n: int = 0

    def __add__(self, other: "MicroOpTimes") -> "MicroOpTimes":
        return MicroOpTimes(self.expert_s + other.expert_s, self.expert_n + other.expert_n,
                            self.a2a_s + other.a2a_s, self.a2a_n + other.a2a_n)

    @property
    def expert_mean_s(self) -> float:
        return self.expert_s / self.expert_n if self.expert_n else 0.0

    @property
    def a2a_mean_s(self) -> float:
        return self.a2a_s / self.a2a_n if self.a2a_n else 0.0


def is_check_step(step: int, start: int = START_STEP, every: int = EVERY_STEPS) -> bool:
    """Whether the boundary after ``step`` completed steps is a packing check: ``start``, ``start + every``, ..."""
    if start < 1 or every < 1:
        raise ValueError(f"start ({start}) and every ({every}) must be >= 1")
    return step >= start and (step - start) % every == 0


def max_packing_for(base_ep: int, limit: Optional[int] = None) -> int:
    """The largest packing allowed: ``base_ep`` (all experts on every device), capped by ``limit`` (the paper's
    maximum experts per device, there for memory)."""
    return base_ep if limit is None else max(1, min(base_ep, limit))


def next_packing(packing: int, base_ep: int, max_packing: Optional[int] = None) -> Optional[int]:
    """The packing a doubling would give, or None at the cap (:func:`max_packing_for`) or where it would not
    divide ``base_ep``."""
    nxt = packing * 2
    return None if nxt > max_packing_for(base_ep, max_packing) or base_ep % nxt else nxt


def decide_packing(packing: int, times: MicroOpTimes, base_ep: int, max_packing: Optional[int] = None) -> int:
    """The paper's rule at a check: double ``packing`` while the mean expert micro-op is shorter than the
    mean all-to-all micro-op (:func:`next_packing` bounds it). Without timings of both kinds it keeps the
    packing. Pure: every rank that passes the same (agreed) times decides the same."""
    nxt = next_packing(packing, base_ep, max_packing)
    if nxt is None or not (times.expert_n and times.a2a_n):
        return packing
    return nxt if times.expert_mean_s < times.a2a_mean_s else packing


# ---- checkpoints --------------------------------------------------------------------------------------

def split_expert_key(key: str) -> Optional[Tuple[str, str]]:
    """``("moe.0.", "w1_EMH")`` for ``"moe.0.w1_EMH"``; None for a key that is not an expert weight."""
    prefix, _, name = key.rpartition(".")
    return (prefix + "." if prefix else "", name) if name in EXPERT_KEYS else None


def unshard_expert_tensor(name: str, shards_by_rank: Mapping[int, torch.Tensor],
                          layout: ParallelLayout) -> torch.Tensor:
    """The full (all experts, all of H) tensor of expert weight ``name`` out of the ranks' shards under
    ``layout`` (any tensor shaped like the weight: its gradient, Adam's ``exp_avg``). Reads expert-DP replica 0."""
    first = layout.coords(0)
    pieces = []
    for ep_index in range(layout.ep):
        ranks = [r for r in range(layout.world) if layout.coords(r)["expert_dp"] == first["expert_dp"]
                 and layout.coords(r)["ep"] == ep_index]
        ranks.sort(key=lambda r: layout.coords(r)["esp"])
        missing = [r for r in ranks if r not in shards_by_rank]
        if missing:
            raise ValueError(f"{name}: the shards of ranks {missing} (EP index {ep_index}) are missing")
        parts = [shards_by_rank[r] for r in ranks]
        pieces.append(parts[0] if H_DIM[name] is None else torch.cat(parts, dim=H_DIM[name]))
    return torch.cat(pieces, dim=0)


def shard_expert_tensor(name: str, full: torch.Tensor, layout: ParallelLayout, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor of expert weight ``name``: the placement of the core's
    ``shard_weights`` (experts by EP index, H by ESP index)."""
    c = layout.coords(rank)
    shard = full[local_experts(c["ep"], full.shape[0], layout.ep)]
    if H_DIM[name] is not None:
        h = ffn_shard(c["esp"], full.shape[H_DIM[name]], layout.esp)
        shard = shard.narrow(H_DIM[name], h.start, h.stop - h.start)
    return shard.clone()


def convert_state_dicts(states_by_rank: Mapping[int, Mapping[str, torch.Tensor]], layout_from: ParallelLayout,
                        layout_to: ParallelLayout, rank: int) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s state dict under ``layout_to`` out of all ranks' state dicts saved under ``layout_from``
    (a model's or one MoE layer's): every expert weight (keys ending in ``w1_EMH``, ``b1_EH``, ``w2_EHM``,
    ``b2_EM``) re-sharded by global expert id; every other key copied from the same rank (same world and MP)."""
    if (layout_from.world, layout_from.mp) != (layout_to.world, layout_to.mp):
        raise ValueError(f"world/mp ({layout_from.world}/{layout_from.mp} -> {layout_to.world}/{layout_to.mp}) "
                         "must stay the same: only the expert weights are re-sharded")
    out: Dict[str, torch.Tensor] = {}
    for key, value in states_by_rank[rank].items():
        if split_expert_key(key) is None:
            out[key] = value
            continue
        name = split_expert_key(key)[1]
        full = unshard_expert_tensor(name, {r: s[key] for r, s in states_by_rank.items()}, layout_from)
        out[key] = shard_expert_tensor(name, full, layout_to, rank)
    return out
