"""Lina (Li et al., ATC '23): the MoE all-to-all before the gradient all-reduce. docs/lina.md explains it.

- :mod:`.config`: the ``"lina": {...}`` section of the ``moe_plugins`` config;
- :mod:`.microops`: tensor partitioning and the "auto" micro-op size (pure);
- :mod:`.reducer`: the scheduler: gradient buffers as background micro-ops on the communication engine;
- :mod:`.packing` (pure rule, layouts, move plan, checkpoint conversion), :mod:`.probe` (micro-op timings),
  :mod:`.regroup` (moving experts and their optimizer state), :mod:`.packer` (the packing coordinator);
- inference (§5.2): :mod:`.popularity` (the table), :mod:`.placement` (phase one and two, the splits),
  :mod:`.exchange` (the uneven all-to-all), :mod:`.replicas` (moving expert weights), :mod:`.infer` (one layer's
  two-phase schedule, and :func:`inference_stats` / :func:`reset_inference_stats` over a model).

The hosts' gradient hooks live with their adapters (``patches/``); they call :class:`.reducer.GradReducer`.
"""

from __future__ import annotations

from moe_plugins.lina.infer import clear_inference_replicas, inference_stats, reset_inference_stats

__all__ = ["clear_inference_replicas", "inference_stats", "register", "reset_inference_stats"]


def register(registry) -> None:
    """Add Lina's config section to ``registry``."""
    from moe_plugins.lina.config import lina_problems
    registry.add_section("lina", lina_problems, paper="lina")
