"""Lina's section of the ``moe_plugins`` config (``"lina": {...}``), typed and validated at the boundary.

::

    "lina": {
        "priority": true,        # gradient micro-ops yield to the MoE exchanges; false: one op per bucket, FIFO
        "micro_op_mb": "auto",   # micro-op size in MB (10^6 bytes), > 0; "auto": about 2.5 ms on the DP link
        "packing": 1,            # pack p times the experts per device (ep / p): an integer >= 1 or "auto"
        "inference": {           # the two-phase expert scheduling of eval-mode forwards (§5.2; DeepSpeed only)
            "table": "popularity.json",     # the table `moe-plugins lina-profile` wrote (needed with estimation)
            "start_layer": 4,               # MoE layers >= this are scheduled (default: the table's start_layer)
            "max_experts_per_device": 4,    # the packing bound (§7.1: 4)
            "estimation": true,             # false: phase 2 only, placement from the gate's actual counts
            "expert_weights": "all"         # "all": every rank keeps every expert's weights in host memory
                                            # (§6.2), replicas swapped in locally; "home": fetched from the
                                            # expert's home rank over the EP group when placed
        }
    }

The gradient part (``priority``, ``micro_op_mb``, ``packing``) is on when the section names any of its keys or
has no ``inference`` key (``"lina": {}`` is Lina's training part with its defaults); a section holding only
``inference`` turns on the inference scheduling alone (:attr:`LinaConfig.training`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, List, Mapping, Optional, Union

from moe_plugins.core.plugin_config import unknown_keys

AUTO = "auto"
TRAINING_KEYS = ("priority", "micro_op_mb", "packing")
EXPERT_WEIGHTS = ("all", "home")


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    table: Optional[str] = None
    start_layer: Optional[int] = None            # None: the table's start_layer (0 without estimation)
    max_experts_per_device: int = 4
    estimation: bool = True
    expert_weights: str = "all"                  # "all" (§6.2: every expert in every rank's host memory) | "home"


@dataclass(frozen=True, kw_only=True)
class LinaConfig:
    priority: bool = True
    micro_op_mb: Union[float, str] = AUTO
    packing: Union[int, str] = 1
    inference: Optional[InferenceConfig] = None
    training: bool = True                        # derived: the gradient part is on (module docstring)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any], path: str = "moe_plugins.lina") -> "LinaConfig":
        problems = lina_problems(section, path)
        if problems:
            raise ValueError(f"invalid {path} section: " + "; ".join(problems))
        values = {k: v for k, v in section.items() if k != "inference"}
        inference = section.get("inference")
        training = bool(values) or inference is None
        return cls(**values, training=training,
                   inference=None if inference is None else InferenceConfig(**dict(inference)))


def _number(value: Any) -> bool:
    """A finite JSON number (not a bool; NaN and infinities are not sizes)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def lina_problems(section: Any, path: str = "moe_plugins.lina") -> List[str]:
    """Every problem of a ``lina`` section, each naming ``path.key``, the value and what is allowed (pure)."""
    if not isinstance(section, Mapping):
        return [f"{path} ({section!r}) must be a JSON object"]
    allowed = list(TRAINING_KEYS) + ["inference"]
    problems = unknown_keys(section, allowed, path)

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
        if not (value == AUTO or _int(value, 1)):
            bad("packing", 'must be an integer >= 1 (the experts per device multiplied by it), or "auto"')
    if section.get("inference") is not None:
        problems += inference_problems(section["inference"], f"{path}.inference")
    return problems


def inference_problems(section: Any, path: str = "moe_plugins.lina.inference") -> List[str]:
    """Every problem of an ``inference`` sub-section, each naming the field, its value and what is allowed."""
    if not isinstance(section, Mapping):
        return [f"{path} ({section!r}) must be a JSON object (see docs/lina.md, Inference) or null"]
    allowed = [f.name for f in fields(InferenceConfig)]
    problems = unknown_keys(section, allowed, path)

    def bad(key: str, rule: str) -> None:
        problems.append(f"{path}.{key} ({section[key]!r}) {rule}")

    estimation = section.get("estimation", True)
    if "estimation" in section and not isinstance(estimation, bool):
        bad("estimation", "must be true (phase 1 from the popularity table, then phase 2) or false (phase 2 only)")
    table = section.get("table")
    if table is not None and not (isinstance(table, str) and table.strip()):
        bad("table", "must be the path of a popularity table (`moe-plugins lina-profile --out PATH`), or null "
                     "with estimation false")
    elif table is None and estimation is not False:
        problems.append(f"{path}.table is missing: estimation (true) needs the popularity table "
                        "`moe-plugins lina-profile` writes (or set estimation to false: phase 2 only)")
    start = section.get("start_layer")
    if start is not None and not _int(start, 0):
        bad("start_layer", "must be an integer >= 0 (at or above the table's start_layer with estimation), or null "
                           "for the table's start_layer")
    if "expert_weights" in section and section["expert_weights"] not in EXPERT_WEIGHTS:
        bad("expert_weights", 'must be "all" (every expert\'s weights kept in every rank\'s host memory, as the '
                              'paper\'s §6.2) or "home" (fetched from the home rank when placed)')
    if "max_experts_per_device" in section and not _int(section["max_experts_per_device"], 1):
        bad("max_experts_per_device", "must be an integer >= 1 (the paper's is 4)")
    return problems
