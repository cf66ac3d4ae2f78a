"""Pool job for the Megatron-core recipe tests: ``moe_plugins.recipes.train_megatron.main`` on every rank of an
already-initialised gloo group (the recipe joins it and leaves it up; it tears down Megatron's parallel state)."""

from __future__ import annotations

from typing import Any, Dict, List


def train_job(argv: List[str]) -> Dict[str, Any]:
    """Rank 0: the run's report (meta, per-step losses); other ranks: {}."""
    from moe_plugins.recipes.train_megatron import main
    return main(argv)
