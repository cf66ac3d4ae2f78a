"""Hecate (FSSDP): experts sharded over all devices and materialised sparsely where the tokens are.
docs/hecate.md explains it; the ragged exchange it needs lives in :mod:`moe_plugins.core.ragged`.

What each module holds (the core layer runs it; the hosts through patches/deepspeed_hecate*.py and
patches/megatron_hecate*.py):

- :mod:`moe_plugins.hecate.plan`: Algorithm 1 as pure functions: the per-expert load over the last 5
  iterations (:class:`~moe_plugins.hecate.plan.LoadWindow`, summed over the group by
  :func:`~moe_plugins.hecate.plan.global_load`), the budget (overlap degree t, memory budget m), node-first
  copies of the top experts (:func:`~moe_plugins.hecate.plan.plan_placement`) and the even, deterministic split
  of a source's routes among an expert's copies, local first, then same node, then remote
  (:func:`~moe_plugins.hecate.plan.split_routes`).
- :mod:`moe_plugins.hecate.sparse`: SparseAllGather / SparseReduceScatter, each one uneven all-to-all through
  the layer's communication engine (ledger ops ``spag`` and ``sprs``), with ``W_copies = spAG(W_owned)`` an
  autograd function whose backward is spRS; their exact bytes and the paper's Eq. 2 volume.
- :mod:`moe_plugins.hecate.flow`: one call's routes to copies and split sizes, and experts as flat rows (pure).
- :mod:`moe_plugins.hecate.schedule`: the ``hecate`` schedule, the baseline's ragged data flow with FSSDP (plan,
  spAG of the copies, dispatch to copies, spRS of their gradients), exact against the baseline.
- :mod:`moe_plugins.hecate.remat`: re-materialisation (``rematerialize``): the copies freed after the layer's
  forward (saved-tensor hooks keep only where they lie) and gathered again by a second spAG right before its
  backward.
- :mod:`moe_plugins.hecate.memory`: the copy-memory ledger: every copy tensor's bytes and lifetime per layer
  (``schedule.memory``), merged over layers into peaks per step and per layer call.
- :mod:`moe_plugins.hecate.early`: the early gather (``prefetch``): spAG planned before the gate, on the lane.
- :mod:`moe_plugins.hecate.reshard` and :mod:`moe_plugins.hecate.rehome`: heterogeneous sharding (Algorithm 2,
  ``reshard_every``, per-layer or pooled slots) and the move of experts with their optimizer state.
- :mod:`moe_plugins.hecate.config`: the ``"hecate": {...}`` section of the ``moe_plugins`` config.
- :mod:`moe_plugins.hecate.regather`: when re-materialisation's re-gather runs (early on the pipeline lane).
- :mod:`moe_plugins.hecate.explain`: Algorithm 1's plan for one load, explained in bytes; ``moe-plugins plan
  hecate`` (:mod:`moe_plugins.hecate.plan_cli`) prints it.
"""

from __future__ import annotations

__all__ = ["register"]


def _planner(subparsers) -> None:
    from moe_plugins.hecate import plan_cli     # imported when `moe-plugins plan hecate` is asked for
    plan_cli.register(subparsers)


def register(registry) -> None:
    """Add Hecate's schedule, config section and planner (``moe-plugins plan hecate``) to ``registry``."""
    from moe_plugins.hecate.config import NAME, SECTION_RULES
    from moe_plugins.hecate.schedule import HecateSchedule
    registry.add_schedule(HecateSchedule, paper=NAME)
    registry.add_section(NAME, SECTION_RULES, paper=NAME)
    registry.add_planner(NAME, _planner)
