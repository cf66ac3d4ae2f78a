"""Parallel layout: pure functions that place ranks into MP, EP, ESP, fused EP&ESP, expert-DP and DP groups.

Notation (parm.txt Table I): P = world size, N_MP / N_EP / N_ESP the group sizes.

Rank order
----------
Dense side (Megatron order): ``rank = dp_index * MP + mp_index``. MP is innermost, so an MP group is
contiguous and stays inside a node whenever ``MP`` divides ``ranks_per_node``.

Expert side: ``rank = edp_index * (EP*ESP) + ep_index * ESP + esp_index``. ESP is innermost, so with
``ESP == MP`` the ESP groups are the MP groups (DeepSpeed's expert tensor parallelism, and Parm's setting).
A fused EP&ESP group is one contiguous block of ``EP*ESP`` ranks. Expert-DP groups hold the replicas of
one expert shard.

Nothing here touches torch.distributed: these functions are unit-tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

Ranks = Tuple[int, ...]

GROUP_KINDS = ("mp", "dp", "ep", "esp", "ep_esp", "expert_dp")


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """World size, node size and the three degrees a user chooses; DP and expert-DP are derived."""

    world: int
    ranks_per_node: int
    mp: int = 1
    ep: int = 1
    esp: int = 1

    def __post_init__(self) -> None:
        problems = layout_problems(self.world, self.ranks_per_node, self.mp, self.ep, self.esp)
        if problems:
            raise ValueError("invalid parallel layout: " + "; ".join(problems))

    @property
    def dp(self) -> int:
        return self.world // self.mp

    @property
    def expert_dp(self) -> int:
        return self.world // (self.ep * self.esp)

    @property
    def num_nodes(self) -> int:
        return self.world // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def groups(self, kind: str) -> List[Ranks]:
        """All groups of one kind, each a tuple of global ranks, in a fixed order every rank agrees on."""
        builders = {
            "mp": lambda: mp_groups(self.world, self.mp),
            "dp": lambda: dp_groups(self.world, self.mp),
            "ep": lambda: ep_groups(self.world, self.ep, self.esp),
            "esp": lambda: esp_groups(self.world, self.ep, self.esp),
            "ep_esp": lambda: ep_esp_groups(self.world, self.ep, self.esp),
            "expert_dp": lambda: expert_dp_groups(self.world, self.ep, self.esp),
        }
        if kind not in builders:
            raise ValueError(f"group kind {kind!r} is unknown; allowed: {', '.join(GROUP_KINDS)}")
        return builders[kind]()

    def group_of(self, kind: str, rank: int) -> Ranks:
        for ranks in self.groups(kind):
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} is outside world {self.world}")

    def coords(self, rank: int) -> Dict[str, int]:
        """Index of ``rank`` along every axis: mp, dp, esp, ep, expert_dp."""
        block = self.ep * self.esp
        return {
            "mp": rank % self.mp,
            "dp": rank // self.mp,
            "esp": rank % self.esp,
            "ep": (rank % block) // self.esp,
            "expert_dp": rank // block,
        }

    def remote_peers(self, kind: str, rank: int) -> int:
        """How many members of ``rank``'s group of this kind sit on another node."""
        node = self.node_of(rank)
        return sum(1 for r in self.group_of(kind, rank) if self.node_of(r) != node)

    def intra_node(self, kind: str) -> bool:
        """True when every group of this kind lies inside one node."""
        return all(len({self.node_of(r) for r in g}) == 1 for g in self.groups(kind))

    def describe(self) -> Dict[str, object]:
        return {
            "world": self.world, "ranks_per_node": self.ranks_per_node, "nodes": self.num_nodes,
            "mp": self.mp, "ep": self.ep, "esp": self.esp, "dp": self.dp, "expert_dp": self.expert_dp,
            "groups": {k: [list(g) for g in self.groups(k)] for k in GROUP_KINDS},
        }


def layout_problems(world: int, ranks_per_node: int, mp: int, ep: int, esp: int) -> List[str]:
    """Every reason the layout is invalid, each naming the field and the numbers (empty when valid)."""
    problems = []
    for name, value in (("world", world), ("ranks_per_node", ranks_per_node), ("mp", mp), ("ep", ep), ("esp", esp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{name} ({value!r}) must be a positive integer")
    if problems:
        return problems
    if world % ranks_per_node:
        problems.append(f"world ({world}) must be divisible by ranks_per_node ({ranks_per_node})")
    if world % mp:
        problems.append(f"world ({world}) must be divisible by mp ({mp})")
    if world % (ep * esp):
        problems.append(f"world ({world}) must be divisible by ep*esp ({ep}*{esp}={ep * esp})")
    return problems


def mp_groups(world: int, mp: int) -> List[Ranks]:
    return [tuple(range(start, start + mp)) for start in range(0, world, mp)]


def dp_groups(world: int, mp: int) -> List[Ranks]:
    return [tuple(range(i, world, mp)) for i in range(mp)]


def ep_esp_groups(world: int, ep: int, esp: int) -> List[Ranks]:
    block = ep * esp
    return [tuple(range(start, start + block)) for start in range(0, world, block)]


def esp_groups(world: int, ep: int, esp: int) -> List[Ranks]:
    return [tuple(range(start, start + esp)) for start in range(0, world, esp)]


def ep_groups(world: int, ep: int, esp: int) -> List[Ranks]:
    return [block[i::esp] for block in ep_esp_groups(world, ep, esp) for i in range(esp)]


def expert_dp_groups(world: int, ep: int, esp: int) -> List[Ranks]:
    block = ep * esp
    return [tuple(range(i, world, block)) for i in range(block)]


def exchange_free(layout: Any) -> bool:
    """Whether every MoE collective of ``layout`` stays on one rank (mp = ep = esp = 1: one device, or pure data
    parallelism): its exchanges move nothing and issue no op. Pure; ``layout``: anything with mp, ep and esp."""
    return layout.mp * layout.ep * layout.esp == 1
