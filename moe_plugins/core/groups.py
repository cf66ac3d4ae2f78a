"""Real torch.distributed process groups for a ParallelLayout, collected in one object passed explicitly."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from moe_plugins.core.layout import GROUP_KINDS, ParallelLayout, Ranks
from moe_plugins.core.patcher import Patch, Patcher


@dataclass(frozen=True)
class Group:
    """This rank's view of one group: its process group (None when size 1), members and node facts."""

    kind: str
    ranks: Ranks
    pg: Optional[dist.ProcessGroup]
    rank: int            # index of this rank in ``ranks``
    remote_peers: int    # members on another node
    nodes: Tuple[int, ...] = ()   # each member's node (empty: not known; uneven volumes then assume an even spread)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def remote_share(self, rows_per_member) -> float:
        """Of ``rows_per_member`` (what this rank sends to each member, in order), the amount that goes to
        members on another node; without ``nodes``, the even-spread share ``remote_peers / size`` of the total."""
        if len(self.nodes) != self.size:
            return self.remote_peers * sum(rows_per_member) / self.size
        return float(sum(n for n, node in zip(rows_per_member, self.nodes) if node != self.nodes[self.rank]))


@dataclass(frozen=True)
class MoEProcessGroups:
    """Node-aware MP, DP, EP, ESP, fused EP&ESP and expert-DP groups of one layout (cf. Megatron's
    ProcessGroupCollection). Build it once with :func:`build_process_groups` and pass it to layers."""

    layout: ParallelLayout
    global_rank: int
    mp: Group
    dp: Group
    ep: Group
    esp: Group
    ep_esp: Group
    expert_dp: Group

    def by_kind(self) -> Dict[str, Group]:
        return {k: getattr(self, k) for k in GROUP_KINDS}


def world_timeout() -> Optional[timedelta]:
    """The default group's collective timeout (``init_process_group(timeout=...)``, a recipe's
    ``--dist-timeout``). torch does not pass it on: ``new_group`` without a timeout waits its own default (30
    minutes on gloo), so every group the plugin builds asks for this one. None if the backend hides it."""
    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):       # no backend for this device, or no options on it
            continue
    return None


def build_process_groups(layout: ParallelLayout, backend: Optional[str] = None,
                         timeout: Optional[timedelta] = None) -> MoEProcessGroups:
    """Create every group of the layout. Collective: all ranks of the default group must call it.
    ``timeout``: how long a collective on these groups waits for its peers (None: the default group's,
    :func:`world_timeout`)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
    if dist.get_world_size() != layout.world:
        raise ValueError(f"layout.world ({layout.world}) must equal the process group's world size "
                         f"({dist.get_world_size()})")
    rank, timeout = dist.get_rank(), timeout or world_timeout()
    made = {}
    for kind in GROUP_KINDS:
        for ranks in layout.groups(kind):
            # new_group is collective over the default group: every rank creates every group.
            pg = dist.new_group(list(ranks), backend=backend, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                made[kind] = Group(kind=kind, ranks=ranks, pg=pg, rank=ranks.index(rank),
                                   remote_peers=layout.remote_peers(kind, rank),
                                   nodes=tuple(layout.node_of(r) for r in ranks))
    return MoEProcessGroups(layout=layout, global_rank=rank, **made)


def destroy_process_groups(groups: MoEProcessGroups) -> None:
    """Free the groups' communicators (gloo keeps worker threads per group). Every member must call it.

    Measured with torch 2.13 on gloo: the threads go only when the last reference to the ProcessGroup goes
    (destroy alone leaves them), so callers should also drop the ``MoEProcessGroups`` and what holds it."""
    seen = set()
    for group in groups.by_kind().values():
        if group.pg is not None and id(group.pg) not in seen:
            seen.add(id(group.pg))
            dist.destroy_process_group(group.pg)


@contextmanager
def process_groups(layout: ParallelLayout, backend: Optional[str] = None) -> Iterator[MoEProcessGroups]:
    """Build the layout's groups for the duration of a block, then destroy them (short jobs, tests)."""
    groups = build_process_groups(layout, backend)
    try:
        yield groups
    finally:
        destroy_process_groups(groups)


@contextmanager
def group_timeout(timeout: timedelta) -> Iterator[None]:
    """Every process group created in the block without a timeout of its own waits ``timeout`` for a peer:
    DeepSpeed's and Megatron's groups too, which torch's ``new_group`` would otherwise give its backend default
    (30 min on gloo) whatever ``init_process_group`` was told. The recipes wrap a run in it with their
    ``--dist-timeout``; torch's two module defaults are put back after."""
    if not timeout.total_seconds() > 0:
        raise ValueError(f"timeout ({timeout!r}) must be > 0 seconds")
    names = [n for n in ("default_pg_timeout", "default_pg_nccl_timeout") if isinstance(getattr(c10d, n, None),
                                                                                       timedelta)]
    with Patcher([Patch(c10d, name, timeout) for name in names]):
        yield


def int_spread(values: Sequence[int], pg: Optional[Any]) -> Tuple[List[int], List[int]]:
    """(max, min) of each of ``values`` over process group ``pg``'s members: one all-reduce of 2n int64 (None:
    the values themselves). Collective. Used to check that members agree before an uneven collective whose split
    sizes would otherwise disagree, or before they act on a plan each computed."""
    mine = [int(v) for v in values]
    if pg is None:
        return mine, mine
    t = torch.tensor(mine + [-v for v in mine], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    n = len(mine)
    return [int(v) for v in t[:n]], [-int(v) for v in t[n:]]
