"""Hecate's pooled slots (``"hecate": {"reshard_every": n, "pool_slots": true}``: Algorithm 2 as the paper has it):
the re-sharded layers' local expert modules, in model order, as one storage whose i-th module on a rank holds the
i-th of the (layer, expert) pairs homed there, ascending: the ``local_experts`` order of the layers' homes laid end
to end, which :meth:`~moe_plugins.hecate.rehome.Resharder._move_pool` follows. So a rank may hold more experts of
one layer and fewer of another, and an expert may sit in another layer's module; each layer reads its experts
from the pool (:meth:`SlotPool.experts_of`). Before any move each layer's modules hold its own experts. Hosts
build one per set of layers re-sharded together (patches/deepspeed_hecate_reshard.py,
patches/megatron_hecate_reshard.py)."""

from __future__ import annotations

from typing import Any, List, Sequence

from torch import nn

from moe_plugins.hecate.reshard import local_experts


class SlotPool:
    """Pooled slots over ``owners`` (the hosts' MoE layers, in model order, the same on every rank): ``modules_L``
    each owner's local expert modules, ``schedules`` each owner's Hecate schedule (its homes)."""

    def __init__(self, owners: Sequence[Any], modules_L: Sequence[Sequence[nn.Module]], schedules: Sequence[Any]):
        if not (len(owners) == len(modules_L) == len(schedules)):
            raise ValueError(f"SlotPool: {len(owners)} layers, {len(modules_L)} module lists and {len(schedules)} "
                             "schedules; one of each per layer")
        self.owners, self.schedules = list(owners), list(schedules)
        self.modules = [m for modules in modules_L for m in modules]

    def holds(self, owner: Any) -> bool:
        return any(o is owner for o in self.owners)

    def experts_of(self, owner: Any) -> List[nn.Module]:
        """The modules holding ``owner``'s experts homed on this rank, in ascending expert id."""
        layer = next(i for i, o in enumerate(self.owners) if o is owner)
        homes_L = [s.homes for s in self.schedules]
        start, ids = sum(map(len, homes_L[:layer])), local_experts([r for h in homes_L for r in h],
                                                                    self.schedules[0].groups.ep.rank)
        return [self.modules[i] for i, g in enumerate(ids) if start <= g < start + len(homes_L[layer])]
