"""The ``pipeline_degree`` flag of a host config to what an executor runs: an int, PipeMoE's ``auto`` degree
(:class:`~moe_plugins.pipemoe.degree.AutoDegree`) or its ``tune`` degree
(:class:`~moe_plugins.pipemoe.tune.TunedDegree`)."""

from __future__ import annotations

from typing import Dict, Optional, Union

from moe_plugins.core.costmodel import CostProfile, PipeCosts
from moe_plugins.pipemoe.degree import AutoDegree, Degree
from moe_plugins.pipemoe.model import R_MAX
from moe_plugins.pipemoe.tune import TunedDegree

# PipeMoE's pipeline_degree words (registered by moe_plugins.pipemoe.register) and what each picks
WORDS: Dict[str, str] = {"auto": "the cost model's pick", "tune": "that pick checked by timing the layer"}


def degree_from_flag(value: Union[int, str], profile: Optional[CostProfile], *, r_max: int = R_MAX) -> Degree:
    """A host flag's value (an int, a digit string, "auto" or "tune") to what MoELayer takes. "auto" and
    "tune" need a profile (``moe-plugins profile``); the caller (a host adapter, the CLI) loads it at its
    boundary."""
    word = value.strip().lower() if isinstance(value, str) else None
    if word in WORDS:
        if profile is None:
            raise ValueError(f"pipeline_degree ({word!r}) needs a cost profile: run `moe-plugins profile` on "
                             "this cluster, or pass an int degree")
        kinds = [g for g in ("ep", "ep_esp") if f"all_to_all@{g}" in profile.models]
        costs = {g: PipeCosts.from_profile(profile, g) for g in kinds}
        source = f"profile {profile.key.slug()}"
        if word == "tune":
            return TunedDegree(costs=costs, r_max=r_max, source=source)
        return AutoDegree(costs=costs, r_max=r_max, source=source)
    try:
        degree = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"pipeline_degree ({value!r}) must be a positive integer, 'auto' or 'tune'") from None
    if degree < 1 or (isinstance(value, float) and value != degree):
        raise ValueError(f"pipeline_degree ({value!r}) must be a positive integer, 'auto' or 'tune'")
    return degree
