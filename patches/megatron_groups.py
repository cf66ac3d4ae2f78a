"""Megatron-core's ``ProcessGroupCollection`` and the project's node-aware groups, in both directions.

- :func:`build_megatron_groups`: from a :class:`~moe_plugins.core.layout.ParallelLayout` (MP = TP, EP, ESP =
  expert-TP) create the groups once and hand them to Megatron in a ``ProcessGroupCollection``, passed
  explicitly to the model, ``DistributedDataParallel``, the optimizer and ``finalize_model_grads``.
- :func:`groups_from_pg_collection`: read a collection Megatron already has (its ``parallel_state`` groups,
  or one built here) back into :class:`~moe_plugins.core.groups.MoEProcessGroups`, checking that every group holds
  the ranks the layout says (Megatron's default orders ``tp-cp-ep-dp-pp`` / ``tp-ep-dp-pp`` do).

Field mapping (megatron-core 0.16.1)::

    layout kind   ProcessGroupCollection field
    mp            tp  (also mp and tp_cp: PP = CP = 1)
    dp            dp  (also dp_cp, intra_dp_cp)
    ep            ep
    esp           expt_tp
    ep_esp        tp_ep  (also tp_ep_pp)
    expert_dp     expt_dp  (also intra_expt_dp)
    (world)       tp_dp_cp, intra_dist_opt
    (singleton)   pp, cp

Megatron calls ``.size()`` on its groups, so a group of one rank is a real singleton group there, while the
core's :class:`~moe_plugins.core.groups.Group` keeps ``pg=None`` for it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch.distributed as dist

from moe_plugins.core.groups import Group, MoEProcessGroups, build_process_groups, destroy_process_groups
from moe_plugins.core.layout import GROUP_KINDS, ParallelLayout

# layout kind -> the ProcessGroupCollection field that holds the same ranks
PGC_FIELD: Dict[str, str] = {"mp": "tp", "dp": "dp", "ep": "ep", "esp": "expt_tp", "ep_esp": "tp_ep",
                             "expert_dp": "expt_dp"}

# further collection fields that alias a kind's group when PP = CP = 1 (and one distributed-optimizer instance)
ALIASES: Dict[str, str] = {"mp": "mp", "tp_cp": "mp", "dp_cp": "dp", "intra_dp_cp": "dp", "tp_ep_pp": "ep_esp",
                           "intra_expt_dp": "expert_dp"}


@dataclass(frozen=True)
class MegatronGroups:
    """The project's groups of one layout and the same groups as Megatron's ``ProcessGroupCollection``."""

    layout: ParallelLayout
    groups: MoEProcessGroups
    pg_collection: Any
    singleton: Any           # this rank's group of one (Megatron's pp and cp, and its size-1 kinds)


def build_megatron_groups(layout: ParallelLayout) -> MegatronGroups:
    """Create the layout's groups and a ``ProcessGroupCollection`` holding them. Collective: every rank of the
    default group calls it, in the same order as any other group creation."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = build_process_groups(layout)
    rank, world = dist.get_rank(), dist.get_world_size()
    singletons = [dist.new_group([r]) for r in range(world)]     # collective: every rank makes every one
    mine = singletons[rank]

    def pg(kind: str):
        group: Group = getattr(groups, kind)
        return group.pg if group.pg is not None else mine

    pgc = ProcessGroupCollection()
    for kind, name in PGC_FIELD.items():
        setattr(pgc, name, pg(kind))
    for name, kind in ALIASES.items():
        setattr(pgc, name, pg(kind))
    pgc.pp, pgc.cp = mine, mine
    pgc.tp_dp_cp = pgc.intra_dist_opt = dist.group.WORLD
    pgc.embd = pgc.pos_embd = pgc.inter_dist_opt = None        # PP = 1; one optimizer instance
    return MegatronGroups(layout=layout, groups=groups, pg_collection=pgc, singleton=mine)


def destroy_megatron_groups(made: MegatronGroups) -> None:
    """Free the groups' communicators (gloo keeps threads per group). Collective: every rank calls it."""
    destroy_process_groups(made.groups)
    dist.destroy_process_group(made.singleton)


@contextmanager
def megatron_groups(layout: ParallelLayout) -> Iterator[MegatronGroups]:
    """:func:`build_megatron_groups` for the duration of a block, then destroyed (short jobs, checks, tests)."""
    made = build_megatron_groups(layout)
    try:
        yield made
    finally:
        destroy_megatron_groups(made)


def parallel_state_collection() -> Any:
    """Megatron's ``parallel_state`` groups as a full ``ProcessGroupCollection`` (what a layer uses when it is given
    no groups, as under Megatron-LM's flag path, where TransformerLayer passes the plugin's layer none).
    Megatron's own ``moe_utils.get_default_pg_collection`` leaves out the DP groups the layout check reads."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    return ProcessGroupCollection.use_mpu_process_groups()


def _ranks(pg: Optional[dist.ProcessGroup], rank: int) -> Tuple[int, ...]:
    return (rank,) if pg is None else tuple(dist.get_process_group_ranks(pg))


def pg_collection_problems(pg_collection: Any, layout: ParallelLayout, rank: int) -> List[str]:
    """Every collection field whose ranks differ from the layout's group of ``rank`` (empty when all agree)."""
    problems = []
    for kind in GROUP_KINDS:
        name = PGC_FIELD[kind]
        have, want = _ranks(getattr(pg_collection, name, None), rank), layout.group_of(kind, rank)
        if have != want:
            problems.append(f"pg_collection.{name} of rank {rank} holds ranks {list(have)}; the layout (world "
                            f"{layout.world}, mp {layout.mp}, ep {layout.ep}, esp {layout.esp}) needs {list(want)}")
    return problems


def groups_from_pg_collection(pg_collection: Any, layout: ParallelLayout) -> MoEProcessGroups:
    """The core's view of Megatron's groups: no new process group is created. Raises one ValueError listing
    every field that does not match the layout (a rank order other than Megatron's default, or a wrong
    layout)."""
    rank = dist.get_rank()
    problems = pg_collection_problems(pg_collection, layout, rank)
    if problems:
        raise ValueError("Megatron's process groups do not match the plugin's layout: " + "; ".join(problems))
    made = {}
    for kind in GROUP_KINDS:
        ranks = layout.group_of(kind, rank)
        pg = getattr(pg_collection, PGC_FIELD[kind], None) if len(ranks) > 1 else None
        made[kind] = Group(kind=kind, ranks=ranks, pg=pg, rank=ranks.index(rank),
                           remote_peers=layout.remote_peers(kind, rank), nodes=tuple(layout.node_of(r) for r in ranks))
    return MoEProcessGroups(layout=layout, global_rank=rank, **made)


def token_view(groups: MoEProcessGroups) -> MoEProcessGroups:
    """The groups a schedule runs on under Megatron: every rank's tokens are its own block (MP of size 1).

    Megatron's MoE layer receives distinct tokens on the ranks of a TP group (sequence parallelism; without
    it each TP rank routes and computes its copy on its own), whereas the core's MP group holds replicas of
    one token block. So the schedule sees MP = 1 and DP = the world; EP, ESP, EP&ESP and expert-DP are the
    same groups (their ranks do not depend on MP). No process group is created."""
    layout = groups.layout
    rank, world = groups.global_rank, layout.world
    tokens = ParallelLayout(world=world, ranks_per_node=layout.ranks_per_node, mp=1, ep=layout.ep, esp=layout.esp)
    everyone = tuple(range(world))
    mp = Group(kind="mp", ranks=(rank,), pg=None, rank=0, remote_peers=0)
    dp = Group(kind="dp", ranks=everyone, pg=dist.group.WORLD if world > 1 else None, rank=rank,
               remote_peers=tokens.remote_peers("dp", rank))
    return MoEProcessGroups(layout=tokens, global_rank=rank, mp=mp, dp=dp, ep=groups.ep, esp=groups.esp,
                            ep_esp=groups.ep_esp, expert_dp=groups.expert_dp)
