"""Pool jobs for Hecate's sparse collectives (tests/test_hecate_sparse.py), and the cases they run: a case
makes its parameters and gradients from its seed alone, so the test builds the single-process reference from
the same case."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from moe_plugins.hecate.plan import Placement
from moe_plugins.hecate.sparse import ShardSpec, even_shards, whole_shards

NODES = (0, 0, 1, 1)            # 4 ranks, 2 per node (the pool's layout below)


@dataclass(frozen=True)
class SparseCase:
    """One spAG/spRS: each expert's copies, F elements per expert, shards ``even`` (all ranks) or ``whole``
    (expert e on ``homes[e]``), fp64 parameters and integer-valued gradients (sums exact in any order)."""

    name: str
    copies_E: Tuple[Tuple[int, ...], ...]
    numel: int
    shards: str = "even"
    homes: Tuple[int, ...] = ()
    seed: int = 0

    def placement(self) -> Placement:
        return Placement(copies_E=self.copies_E, nodes_R=NODES)

    def shard_spec(self) -> ShardSpec:
        if self.shards == "even":
            return even_shards(self.numel, len(self.copies_E), len(NODES))
        return whole_shards(self.numel, self.homes, len(NODES))

    def full_EF(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randn(len(self.copies_E), self.numel, generator=gen, dtype=torch.float64)

    def grad_CF(self, rank: int) -> torch.Tensor:
        """The gradient rank ``rank``'s loss sends into its copies: integers in [-8, 8]."""
        gen = torch.Generator().manual_seed(self.seed * 100 + rank + 1)
        rows = len(self.placement().experts_on(rank))
        return torch.randint(-8, 9, (rows, self.numel), generator=gen).to(torch.float64)


def _layout():
    from moe_plugins.core.layout import ParallelLayout
    return ParallelLayout(world=len(NODES), ranks_per_node=2, ep=len(NODES))


def spag_and_sprs(cases: List[SparseCase]):
    """Every case on this rank: ``w_copies = spAG(w_owned)``, then backward of sum(w_copies * grad_CF). Per case:
    this rank's copies, its owned buffer's gradient and its ledger records (op, phase, bytes, inter-node bytes)."""
    from moe_plugins.core.comm import Recorder
    from moe_plugins.core.groups import process_groups
    from moe_plugins.core.ledger import CommLedger
    from moe_plugins.hecate.sparse import sparse_all_gather

    out = []
    with process_groups(_layout()) as groups:
        group = groups.ep
        for case in cases:
            ledger = CommLedger()
            shards = case.shard_spec()
            w_owned_O = shards.shard(case.full_EF(), group.rank).clone().requires_grad_(True)
            w_copies_CF = sparse_all_gather(w_owned_O, case.placement(), shards, group,
                                            Recorder(ledger=ledger, layer="hecate"))
            (w_copies_CF * case.grad_CF(group.rank)).sum().backward()
            out.append({"rank": group.rank, "copies": w_copies_CF.detach(), "grad": w_owned_O.grad,
                        "records": [(r.op, r.phase, r.group, r.bytes, r.inter_node_bytes) for r in ledger.records]})
    return out


def loads_summed(num_experts: int):
    """global_load of this rank's loads [rank * 10 + e for e]: the sum every rank reads, and its records."""
    from moe_plugins.core.comm import Recorder
    from moe_plugins.core.groups import process_groups
    from moe_plugins.core.ledger import CommLedger
    from moe_plugins.hecate.plan import global_load

    ledger = CommLedger()
    with process_groups(_layout()) as groups:
        mine = torch.tensor([groups.ep.rank * 10 + e for e in range(num_experts)], dtype=torch.int32)
        total = global_load(mine, groups.ep, Recorder(ledger=ledger, layer="hecate"))
    return total, [(r.op, r.bytes) for r in ledger.records]
