"""Lancet's section of the ``moe_plugins`` config (``"lancet": {...}``), typed and validated at the boundary.

::

    "lancet": {
        "defer_wgrad": true,   # the experts' weight gradients are deferred and run while the layer's backward
                               # exchanges are in flight; false keeps the section but defers nothing
        "partitions": 1,       # Part 2's batch partitions: n >= 1 equal groups of samples, n dividing the
                               # micro-batch (1: none); "auto": chosen per batch shape by the planner's model
                               # from the cost profile cached for the layout (`moe-plugins profile`); "tune":
                               # chosen per batch shape by timing the executor's own ranges (lancet/tune.py)
        "dense_wgrad": false   # defer the model's dense weight gradients too (its nn.Linear and HF Conv1D
                               # modules outside the MoE layers; tied ones stay stock), with defer_wgrad on
    }

With ``defer_wgrad`` on, the section runs with schedule ``baseline`` and the padded exchange at any fixed or
chosen pipeline degree; ``partitions`` > 1 (the block executor, ``moe_plugins.lancet.blocks``) needs pipeline
degree 1 too (the partitions replace PipeMoE's capacity chunks); Parm's schedules, ``baseline-tp``, Hecate, Lina's gradient micro-ops and the ragged
exchange are refused, naming the field and its value (their exchanges are other autograd Functions, which the overlap hook does not reach yet).
Every problem names ``moe_plugins.lancet.<key>``, the value and what is allowed, before anything is patched.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any, List, Mapping, Optional, Union

from moe_plugins.core.plugin_config import SectionRules, unknown_keys

NAME = "lancet"
AUTO = "auto"
TUNE = "tune"
WORDS = (AUTO, TUNE)                # partition counts chosen per batch shape
SCHEDULES = ("baseline",)           # the schedules whose exchanges carry the overlap hook
EXCHANGES = ("padded",)
HOSTS = ("deepspeed", "megatron")   # the adapters that run the section (the core layer takes a LancetConfig)
DENSE_HOSTS = ("deepspeed", "megatron")   # those that wrap the model's dense layers (dense_wgrad)


@dataclass(frozen=True, kw_only=True)
class LancetConfig:
    defer_wgrad: bool = True
    partitions: Union[int, str] = 1
    dense_wgrad: bool = False

    @classmethod
    def from_dict(cls, section: Optional[Mapping[str, Any]], path: str = "moe_plugins.lancet") -> "LancetConfig":
        """The section (None: the defaults), or one ValueError listing every problem."""
        if section is None:
            return cls()
        problems = lancet_problems(section, path)
        if problems:
            raise ValueError(f"invalid {path} section: " + "; ".join(problems))
        return cls(**dict(section))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def partitions_problem(value: Any, path: str) -> Optional[str]:
    """Why ``partitions`` is refused (None for an integer >= 1): one line naming the field and the value (pure).
    Whether it divides the micro-batch is checked where the batch is known (``lancet.partition``)."""
    if (_is_int(value) and value >= 1) or value in WORDS:
        return None
    return (f"{path}.partitions ({value!r}) must be an integer >= 1 that divides the micro-batch, \"auto\" or "
            "\"tune\"")


def lancet_problems(section: Any, path: str = "moe_plugins.lancet") -> List[str]:
    """Every problem of a ``lancet`` section, each naming ``path.key``, the value and what is allowed (pure)."""
    if not isinstance(section, Mapping):
        return [f"{path} ({section!r}) must be a JSON object (see docs/lancet.md) or null"]
    allowed = [f.name for f in fields(LancetConfig)]
    problems = unknown_keys(section, allowed, path)
    if "defer_wgrad" in section and not isinstance(section["defer_wgrad"], bool):
        problems.append(f"{path}.defer_wgrad ({section['defer_wgrad']!r}) must be true or false")
    if "partitions" in section:
        problem = partitions_problem(section["partitions"], path)
        if problem is not None:
            problems.append(problem)
    dense = section.get("dense_wgrad", False)
    if not isinstance(dense, bool):
        problems.append(f"{path}.dense_wgrad ({dense!r}) must be true or false")
    elif dense and section.get("defer_wgrad", True) is False:
        problems.append(f"{path}.dense_wgrad (True) needs {path}.defer_wgrad true: the dense weight gradients run "
                        "from the queue behind the MoE layers' backward exchanges")
    return problems


def enabled_in(section: Mapping[str, Any]) -> bool:
    """Whether a ``moe_plugins`` section runs Lancet: a ``lancet`` section with ``defer_wgrad`` on or partitions."""
    lancet = section.get(NAME)
    return isinstance(lancet, Mapping) and (lancet.get("defer_wgrad", True) is True or partitioned(lancet))


def partitioned(lancet: Mapping[str, Any]) -> bool:
    """Whether a ``lancet`` section cuts the batch into partitions (an integer partitions > 1, "auto" or "tune")."""
    value = lancet.get("partitions", 1)
    return (_is_int(value) and value > 1) or value in WORDS


def lancet_across(section: Mapping[str, Any], path: str = "moe_plugins", host: Optional[str] = None) -> List[str]:
    """How the ``lancet`` section fits the rest of the ``moe_plugins`` section (pure): the schedule and exchange
    it runs with, no Hecate, and the ``host`` that reads it (one of :data:`HOSTS`; None or another: refused, so
    that the Megatron-core adapter never runs the layer without Lancet silently), each problem naming the field
    and its value."""
    if not enabled_in(section):
        return []
    problems = []
    schedule = section.get("schedule", "baseline")
    if schedule not in SCHEDULES:
        problems.append(f"{path}.schedule ({schedule!r}) cannot run with {path}.{NAME}.defer_wgrad: Lancet overlaps "
                        f"the exchanges of schedule {', '.join(map(repr, SCHEDULES))} only in this version")
    exchange = section.get("exchange", "padded")
    if exchange not in EXCHANGES:
        problems.append(f"{path}.exchange ({exchange!r}) cannot run with {path}.{NAME}.defer_wgrad: only the padded "
                        "exchange carries the overlap in this version")
    lina = section.get("lina")
    lina_training = isinstance(lina, Mapping) and (set(lina) - {"inference"} or "inference" not in lina)
    if lina_training and host not in HOSTS:
        problems.append(f"{path}.lina (its gradient micro-ops) runs with {path}.{NAME} through the DeepSpeed and "
                        f"Megatron-core adapters only (one engine, both lanes); not on {host or 'this reader'}")
    hecate = section.get("hecate")
    if isinstance(hecate, Mapping) and hecate.get("enabled", True) is True:
        problems.append(f"{path}.hecate (enabled) cannot run with {path}.{NAME}.defer_wgrad: Hecate's expert copies "
                        "do not defer their weight gradients")
    if partitioned(section[NAME]) and section.get("pipeline_degree", 1) not in (1, "1"):
        problems.append(f"{path}.pipeline_degree ({section['pipeline_degree']!r}) cannot run with {path}.{NAME}."
                        f"partitions ({section[NAME]['partitions']}): the partitions replace PipeMoE's capacity "
                        "chunks; use pipeline_degree 1")
    if host not in HOSTS:
        problems.append(f"{path}.{NAME}: Lancet runs through the DeepSpeed and Megatron-core adapters (enable()) or "
                        "the core LancetMoELayer; this reader does not run it")
    else:
        if section[NAME].get("dense_wgrad") is True and host not in DENSE_HOSTS:
            problems.append(f"{path}.{NAME}.dense_wgrad (True): the dense layers' weight gradients are deferred on "
                            f"{' and '.join(DENSE_HOSTS)} only; on {host} use false (defer_wgrad runs)")
    return problems


def host_rules(host: Optional[str]) -> SectionRules:
    """The section's checks as read by ``host`` (one of :data:`HOSTS` runs Lancet; None: a reader that does not)."""
    return SectionRules(value=lancet_problems, across=partial(lancet_across, host=host))


SECTION_RULES = host_rules(None)      # the registry's: readers other than the host adapters refuse Lancet
