"""Lina's section of the ``moe_plugins`` config (``"lina": {...}``), typed and validated at the boundary.

::

    "lina": {
        "priority": true,        # gradient micro-ops yield to the MoE exchanges; false: one op per bucket, FIFO
        "micro_op_mb": "auto",   # micro-op size in MB (10^6 bytes), > 0; "auto": about 2.5 ms on the DP link
        "packing": 1             # pack p times the experts per device (ep / p): an integer >= 1 or "auto"
    }
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, List, Mapping, Union

from moe_plugins.core.plugin_config import did_you_mean

AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class LinaConfig:
    priority: bool = True
    micro_op_mb: Union[float, str] = AUTO
    packing: Union[int, str] = 1

    @classmethod
    def from_dict(cls, section: Mapping[str, Any], path: str = "moe_plugins.lina") -> "LinaConfig":
        problems = lina_problems(section, path)
        if problems:
            raise ValueError(f"invalid {path} section: " + "; ".join(problems))
        return cls(**dict(section))


def _number(value: Any) -> bool:
    """A finite JSON number (not a bool; NaN and infinities are not sizes)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def lina_problems(section: Any, path: str = "moe_plugins.lina") -> List[str]:
    """Every problem of a ``lina`` section, each naming ``path.key``, the value and what is allowed (pure)."""
    if not isinstance(section, Mapping):
        return [f"{path} ({section!r}) must be a JSON object"]
    allowed = [f.name for f in fields(LinaConfig)]
    problems = [f"{path}.{key} is unknown; allowed: {', '.join(allowed)}{did_you_mean(key, allowed)}"
                for key in section if key not in allowed]

    def bad(key: str, rule: str) -> None:
        problems.append(f"{path}.{key} ({section[key]!r}) {rule}")

    if "priority" in section and not isinstance(section["priority"], bool):
        bad("priority", "must be true or false")
    if "micro_op_mb" in section:
        value = section["micro_op_mb"]
        if not (value == AUTO or (_number(value) and value > 0)):
            bad("micro_op_mb", 'must be a number of MB > 0, or "auto"')
    if "packing" in section:
        value = section["packing"]
        if not (value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)):
            bad("packing", 'must be an integer >= 1 (the experts per device multiplied by it), or "auto"')
    return problems
