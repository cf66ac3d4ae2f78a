"""Hecate's section of the ``moe_plugins`` config (``"hecate": {...}``), typed and validated at the boundary.

::

    "hecate": {
        "enabled": true,          # false keeps the section but runs the plain schedule
        "extra_experts": "auto",  # the memory budget m: expert copies per rank beyond its own experts, an
                                  # integer >= 1, or "auto": as many as the rank owns (E / EP)
        "rematerialize": false,   # true: free the copies after the layer's forward and spAG them again for
                                  # its backward (less copy memory, one more spAG per layer and step)
        "regather": "early",      # with rematerialize: "early" starts the re-gather on the engine's pipeline
                                  # lane as soon as the next layer has released its copies (regather.py);
                                  # "at_need" runs it inline when the backward first needs the copies
        "prefetch": false,        # true: plan from the previous calls' load and issue spAG before the gate, on
                                  # the engine's pipeline lane, at the start of the layer's transformer block,
                                  # with the overlap degree t measured (moe_plugins/hecate/early.py)
        "reshard_every": 0,       # re-home the experts by Algorithm 2 every n optimizer steps (0: never;
                                  # DeepSpeed ZeRO 0/1/2, fp32: moe_plugins/hecate/rehome.py)
        "pool_slots": false       # with reshard_every: the layers share every rank's expert slots (the paper's
                                  # Algorithm 2: a rank may hold more experts of one layer and fewer of another);
                                  # false: each layer's experts stay E / R per rank
    }

How the section selects the schedule: an enabled section switches schedule ``baseline`` to ``hecate`` (the
baseline's data flow with FSSDP, :class:`~moe_plugins.hecate.schedule.HecateSchedule`); ``"schedule": "hecate"``
names the same schedule directly (its options then come from the section, or the defaults). Any other schedule
(Parm's, ``baseline-tp``) with an enabled section is refused, naming the schedule, and so are a pipeline degree
word (``"auto"``, ``"tune"``; integers run PipeMoE's chunks), a degree other than 1 with ``rematerialize``, an
explicit ``"exchange": "padded"`` (Hecate sends only the kept rows; absent, it is implied) and
``esp`` > 1. The DeepSpeed and Megatron-core adapters run Hecate (they supply ``LayerParams.expert_weights``):
each checks the section with :func:`host_rules` for its name (Megatron-core also refuses ``reshard_every`` > 0);
every other reader (:data:`SECTION_RULES`, the registry's default) refuses an enabled section with one line, so
that nothing runs the plain baseline in its place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any, List, Mapping, Optional, Union

from moe_plugins.core.plugin_config import SectionRules, unknown_keys

AUTO = "auto"
REGATHERS = ("early", "at_need")   # when rematerialize's re-gather runs (moe_plugins/hecate/regather.py)
NAME = "hecate"                    # the schedule's registered name and the section's key
SWITCHES = ("baseline", NAME)      # the schedules an enabled section runs as Hecate
HOSTS = ("deepspeed", "megatron")  # the host adapters that run Hecate


@dataclass(frozen=True, kw_only=True)
class HecateConfig:
    enabled: bool = True
    extra_experts: Union[int, str] = AUTO
    rematerialize: bool = False
    regather: str = "early"
    prefetch: bool = False
    reshard_every: int = 0
    pool_slots: bool = False

    @classmethod
    def from_dict(cls, section: Optional[Mapping[str, Any]], path: str = "moe_plugins.hecate") -> "HecateConfig":
        """The section (None: the defaults), or one ValueError listing every problem."""
        if section is None:
            return cls()
        problems = hecate_problems(section, path)
        if problems:
            raise ValueError(f"invalid {path} section: " + "; ".join(problems))
        return cls(**dict(section))

    def budget_m(self, local_experts: int) -> int:
        """m, the copies per rank: ``extra_experts``, or with "auto" the experts the rank owns (E / EP)."""
        return local_experts if self.extra_experts == AUTO else int(self.extra_experts)


def _int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def hecate_problems(section: Any, path: str = "moe_plugins.hecate") -> List[str]:
    """Every problem of a ``hecate`` section, each naming ``path.key``, the value and what is allowed (pure)."""
    if not isinstance(section, Mapping):
        return [f"{path} ({section!r}) must be a JSON object (see docs/hecate.md) or null"]
    allowed = [f.name for f in fields(HecateConfig)]
    problems = unknown_keys(section, allowed, path)

    def bad(key: str, rule: str) -> None:
        problems.append(f"{path}.{key} ({section[key]!r}) {rule}")

    if "enabled" in section and not isinstance(section["enabled"], bool):
        bad("enabled", "must be true or false")
    if "extra_experts" in section and not (section["extra_experts"] == AUTO or _int(section["extra_experts"], 1)):
        bad("extra_experts", 'must be an integer >= 1 (expert copies per rank) or "auto" (as many as it owns)')
    for key in ("rematerialize", "prefetch", "pool_slots"):
        if key in section and not isinstance(section[key], bool):
            bad(key, "must be true or false")
    if "regather" in section and section["regather"] not in REGATHERS:
        bad("regather", f"must be one of {', '.join(map(repr, REGATHERS))} (when rematerialize's re-gather runs)")
    if "reshard_every" in section:
        if not _int(section["reshard_every"], 0):
            bad("reshard_every", "must be an integer >= 0 (optimizer steps between re-shardings; 0: never)")
    if section.get("pool_slots") is True and not (_int(section.get("reshard_every", 0), 1)):
        problems.append(f"{path}.pool_slots (True) needs {path}.reshard_every >= 1 (it changes how re-sharding "
                        f"places the experts), not {section.get('reshard_every', 0)!r}")
    return problems


def hecate_on(cfg: Any) -> bool:
    """Whether a PluginConfig ``cfg`` (or None) runs Hecate: enabled, with an enabled ``hecate`` section or schedule
    ``hecate``."""
    return cfg is not None and cfg.enabled and enabled_in({"schedule": cfg.schedule, NAME: cfg.hecate})


def prefetch_on(cfg: Any) -> bool:
    """Whether a PluginConfig ``cfg`` runs Hecate with its early gather (which needs an engine's pipeline lane)."""
    return hecate_on(cfg) and isinstance(cfg.hecate, Mapping) and cfg.hecate.get("prefetch") is True


def lane_on(cfg: Any) -> bool:
    """Whether a PluginConfig ``cfg`` runs Hecate work on an engine's pipeline lane: the early gather, or
    ``rematerialize``'s early re-gather (moe_plugins/hecate/regather.py)."""
    return prefetch_on(cfg) or (hecate_on(cfg) and isinstance(cfg.hecate, Mapping)
                                and cfg.hecate.get("rematerialize") is True
                                and cfg.hecate.get("regather", "early") == "early")


def reshard_interval(cfg: Any) -> int:
    """A PluginConfig's ``hecate.reshard_every`` (0 without Hecate or without the key)."""
    if not hecate_on(cfg) or not isinstance(cfg.hecate, Mapping):
        return 0
    return HecateConfig.from_dict(cfg.hecate).reshard_every


def pooled_slots(cfg: Any) -> bool:
    """A PluginConfig's ``hecate.pool_slots`` (False without re-sharding)."""
    return bool(reshard_interval(cfg)) and HecateConfig.from_dict(cfg.hecate).pool_slots


def enabled_in(section: Mapping[str, Any]) -> bool:
    """Whether a ``moe_plugins`` section runs Hecate: its ``hecate`` section enabled, or schedule ``hecate``."""
    hecate = section.get(NAME)
    on = isinstance(hecate, Mapping) and hecate.get("enabled", True) is True
    return on or section.get("schedule") == NAME


def hecate_across(section: Mapping[str, Any], path: str = "moe_plugins", host: Optional[str] = None) -> List[str]:
    """How the ``hecate`` section fits the rest of the ``moe_plugins`` section (pure): the schedules, pipeline
    degree, exchange and ESP degree Hecate runs with, and the ``host`` that reads it (one of :data:`HOSTS`; None
    or another: refused), each problem naming the field and its value."""
    hecate = section.get(NAME)
    if isinstance(hecate, Mapping) and hecate.get("enabled") is False and section.get("schedule") == NAME:
        return [f"{path}.{NAME}.enabled (False) contradicts {path}.schedule ('{NAME}'): enable the section or "
                "name another schedule"]
    if not enabled_in(section):
        return []
    problems = []
    schedule = section.get("schedule", "baseline")
    if schedule not in SWITCHES:
        problems.append(f"{path}.schedule ({schedule!r}) cannot run Hecate ({path}.{NAME} is enabled): Hecate runs "
                        f"the baseline's data flow only (schedule 'baseline' or '{NAME}'); schedule {schedule!r} "
                        "with FSSDP is not built")
    degree = section.get("pipeline_degree", 1)
    if degree not in (1, "1") and isinstance(hecate, Mapping) and hecate.get("rematerialize") is True:
        problems.append(f"{path}.pipeline_degree ({degree!r}) must be 1 with {path}.{NAME}.rematerialize: the "
                        "re-gather is built for one expert step per call")
    if section.get("exchange", "ragged") != "ragged":
        problems.append(f"{path}.exchange ({section['exchange']!r}) cannot be used with Hecate, which sends only "
                        "the kept rows (the ragged exchange): drop the key or write 'ragged'")
    esp = section.get("esp")
    if _int(esp, 2):
        problems.append(f"{path}.esp ({esp!r}) must be 1 or null with Hecate: copies of ESP shards are not built")
    if host not in HOSTS:     # a reader that would run the plain baseline silently in its place: refuse
        problems.append(f"{path}.{NAME}: Hecate is run by the DeepSpeed and Megatron-core adapters (moe_plugins."
                        "enable(), the ds_config section or the --moe-plugins flag) and by the core "
                        f"MoELayer(schedule='{NAME}'); this reader (a tool that checks the section without an "
                        "adapter's rules) does not run it")
    return problems


def host_rules(host: Optional[str]) -> SectionRules:
    """The section's checks as read by ``host`` (one of :data:`HOSTS` runs Hecate; None: a reader that does not)."""
    return SectionRules(value=hecate_problems, across=partial(hecate_across, host=host))


SECTION_RULES = host_rules(None)      # the registry's: readers other than the adapters refuse Hecate
