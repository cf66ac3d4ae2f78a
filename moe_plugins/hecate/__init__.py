"""Hecate (FSSDP): experts sharded over all devices and materialised sparsely where the tokens are.
docs/hecate.md explains it; the ragged exchange it needs lives in :mod:`moe_plugins.core.ragged`.

Built so far, as standalone modules (not yet wired into a layer, the config or the hosts):

- :mod:`moe_plugins.hecate.plan`: Algorithm 1 as pure functions: the per-expert load over the last 5
  iterations (:class:`~moe_plugins.hecate.plan.LoadWindow`, summed over the group by
  :func:`~moe_plugins.hecate.plan.global_load`), the budget (overlap degree t, memory budget m), node-first
  copies of the top experts (:func:`~moe_plugins.hecate.plan.plan_placement`) and the even, deterministic split
  of a source's routes among an expert's copies, local first, then same node, then remote
  (:func:`~moe_plugins.hecate.plan.split_routes`).
- :mod:`moe_plugins.hecate.sparse`: SparseAllGather / SparseReduceScatter, each one uneven all-to-all through
  the layer's communication engine (ledger ops ``spag`` and ``sprs``), with ``W_copies = spAG(W_owned)`` an
  autograd function whose backward is spRS; their exact bytes and the paper's Eq. 2 volume.
"""
