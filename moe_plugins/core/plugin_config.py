"""The ``moe_plugins`` section of a host config (DeepSpeed's ds_config, Megatron's arguments): one typed,
frozen config shared by every host adapter, validated at the boundary.

Schema (documented for users in ``docs/config.md``)::

    "moe_plugins": {
        "enabled": true,            # false keeps the section but runs the host's stock MoE layers
        "schedule": "baseline",     # a registered schedule (moe_plugins.plugins.default_registry())
        "pipeline_degree": 1,       # capacity chunks per layer: an integer >= 1 or a registered degree
                                    # policy's word (Registry.degree_policies(); docs/config.md)
        "exchange": "padded",       # "ragged": the exchange sends only occupied capacity slots (schedule
                                    # "baseline", pipeline_degree 1; one host read per call; docs/hecate.md)
        "esp": null,                # expert-sharding degree; null: the host's expert tensor-parallel degree;
                                    # another value is a layout the host cannot express (docs/config.md)
        "ranks_per_node": null,     # ranks per node for the node-aware layout; null: LOCAL_WORLD_SIZE
        "lina": null,               # Lina's gradient micro-ops behind the all-to-all: {"priority": true,
                                    # "micro_op_mb": "auto", "packing": 1} (a registered section; docs/lina.md)
        "fssdp": false,             # reserved (Hecate)
        "overlap": false,           # reserved (Lancet)
        "hecate": null,             # Hecate's FSSDP: {"enabled": true, "extra_experts": "auto", ...} (a
                                    # registered section; docs/hecate.md)
        "lancet": null              # Lancet's deferred weight gradients: {"defer_wgrad": true, "partitions": 1,
                                    # "dense_wgrad": false} (a registered section; docs/lancet.md)
    }

:meth:`PluginConfig.from_dict` reports every unknown key and every bad value in one ``ValueError`` that names
the path, the value and what is allowed. Nothing here imports a host framework.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from moe_plugins.core.layout import exchange_free

SECTION = "moe_plugins"
EXCHANGES = ("padded", "ragged")     # the "exchange" values (core.schedule.EXCHANGES is this tuple)


def degree_needs_profile(value: Any) -> bool:
    """Whether a pipeline_degree value names a degree policy (a word, not a number), which decides from the
    cost profile. The words themselves are the registry's (``Registry.degree_policies``)."""
    return isinstance(value, str) and bool(value.strip()) and not value.strip().isdigit()


def alternatives(items: Sequence[str]) -> str:
    """``a``, ``a or b``, ``a, b or c`` (pure)."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def did_you_mean(word: Any, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a misspelt name, or "" (pure)."""
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_keys(section: Mapping[str, Any], allowed: Sequence[str], path: str) -> List[str]:
    """One problem per key of a config ``section`` not in ``allowed``: ``path.key``, the allowed keys and the
    closest one (pure; the papers' sections use it)."""
    return [f"{path}.{key} is unknown; allowed: {', '.join(allowed)}{did_you_mean(key, allowed)}"
            for key in section if key not in allowed]


# Keys a later issue implements: accepted with their "off" value only, so configs can be written ahead.
RESERVED: Dict[str, str] = {
    "fssdp": "Hecate's fully sharded sparse data parallelism (FSSDP)",
    "overlap": "Lancet's overlap of the all-to-all with non-MoE computation",
}


# Top-level ds_config keys that tell a whole ds_config from a bare section.
_DS_CONFIG_KEYS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                             "optimizer", "scheduler", "zero_optimization", "fp16", "bf16", "gradient_clipping"})


@dataclass(frozen=True, kw_only=True)
class PluginConfig:
    """What the plugin does to a host's MoE layers. Defaults reproduce the host's math with the baseline
    schedule; each field is documented in docs/config.md."""

    enabled: bool = True
    schedule: str = "baseline"
    pipeline_degree: Union[int, str] = 1
    exchange: str = "padded"
    esp: Optional[int] = None
    ranks_per_node: Optional[int] = None
    lina: Optional[Dict[str, Any]] = field(default=None, hash=False)    # validated by the lina package
    fssdp: bool = False
    overlap: bool = False
    hecate: Optional[Dict[str, Any]] = field(default=None, hash=False)  # validated by the hecate package
    lancet: Optional[Dict[str, Any]] = field(default=None, hash=False)  # validated by the lancet package

    def __post_init__(self) -> None:
        problems = plugin_config_problems(asdict(self), SECTION)
        if problems:
            raise ValueError(f"invalid {SECTION} section: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, section: Any, path: str = SECTION, *, schedules: Optional[Sequence[str]] = None,
                  degrees: Optional[Mapping[str, str]] = None,
                  sections: Optional[Mapping[str, SectionCheck]] = None) -> "PluginConfig":
        """Build from a parsed JSON object. Raises one ValueError listing every problem, each with its path.
        ``schedules`` and ``degrees``: the registry's schedule names and pipeline_degree words (with what each
        picks); the core knows none itself."""
        if not isinstance(section, Mapping):
            raise ValueError(f"{path} ({section!r}) must be a JSON object (dict), got {type(section).__name__}")
        problems = plugin_config_problems(section, path, schedules=schedules, degrees=degrees, sections=sections)
        if problems:
            raise ValueError(f"invalid {path} section: " + "; ".join(problems))
        return cls(**dict(section))

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


# A registered sub-section (``Registry.add_section``): problems(value, path) -> every problem, each naming
# path.key, the value and what is allowed.
SectionCheck = Callable[[Any, str], List[str]]
PAPER_SECTIONS = ("lina", "hecate", "lancet")     # PluginConfig's sub-sections a paper registers a check for


@dataclass(frozen=True)
class SectionRules:
    """A registered sub-section's checks when it also constrains the rest of the section (a callable
    ``SectionCheck`` too): ``value(v, path)`` its own fields, ``across(section, path)`` how it fits the other keys
    (e.g. the schedules it runs with), each problem naming the field and its value."""

    value: SectionCheck
    across: Optional[Callable[[Mapping[str, Any], str], List[str]]] = None

    def __call__(self, value: Any, path: str) -> List[str]:
        return self.value(value, path)


def _names() -> List[str]:
    return [f.name for f in fields(PluginConfig)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plugin_config_problems(section: Mapping[str, Any], path: str = SECTION, *,
                           schedules: Optional[Sequence[str]] = None,
                           degrees: Optional[Mapping[str, str]] = None,
                           sections: Optional[Mapping[str, SectionCheck]] = None) -> List[str]:
    """Every unknown key and bad value of a section, each naming ``path.key``, the value and what is allowed
    (empty when valid). Pure: no host, no process group. ``schedules``: the registered names to check
    ``schedule`` against; ``degrees``: the registered pipeline_degree words, each with what it picks
    (``Registry.degree_policies()``). None: only the value's type (hosts pass the registry's and check the
    layout too)."""
    allowed = _names()
    problems = []
    for key in section:
        if key not in allowed:
            hint = did_you_mean(key, allowed)
            problems.append(f"{path}.{key}: unknown key{hint}; allowed keys: {', '.join(allowed)}")

    def bad(key: str, rule: str) -> None:
        problems.append(f"{path}.{key} ({section[key]!r}) {rule}")

    if "enabled" in section and not isinstance(section["enabled"], bool):
        bad("enabled", "must be true or false")
    if "schedule" in section and not (isinstance(section["schedule"], str) and section["schedule"]):
        bad("schedule", "must be a schedule name (a non-empty string)")
    elif "schedule" in section and schedules is not None and section["schedule"] not in schedules:
        bad("schedule", f"must be one of {', '.join(sorted(schedules))}{did_you_mean(section['schedule'], schedules)}")
    if "pipeline_degree" in section:
        value = section["pipeline_degree"]
        if isinstance(value, str):
            ok = value in degrees if degrees is not None else degree_needs_profile(value) and value == value.strip()
        else:
            ok = _is_int(value) and value >= 1
        if not ok:
            words = ([f'"{word}" ({summary})' for word, summary in sorted(degrees.items())] if degrees is not None
                     else ["a registered degree policy's word"])
            hint = did_you_mean(value, degrees) if isinstance(value, str) and degrees is not None else ""
            bad("pipeline_degree", "must be " + alternatives(["an integer >= 1"] + words) + hint)
    if "exchange" in section and section["exchange"] not in EXCHANGES:
        bad("exchange", f"must be {alternatives([repr(e) for e in EXCHANGES])}"
            f"{did_you_mean(section['exchange'], EXCHANGES) if isinstance(section['exchange'], str) else ''}")
    for key in ("esp", "ranks_per_node"):
        if key in section and section[key] is not None and not (_is_int(section[key]) and section[key] >= 1):
            bad(key, "must be an integer >= 1, or null to derive it")
    for key in PAPER_SECTIONS:
        if section.get(key) is None:
            continue
        check = (sections or {}).get(key)
        if not isinstance(section[key], Mapping):
            bad(key, f"must be a JSON object (see docs/{key}.md) or null")
        elif check is not None:
            problems += check(section[key], f"{path}.{key}")
    for check in (sections or {}).values():
        if isinstance(check, SectionRules) and check.across is not None:
            problems += check.across(section, path)
    for key, technique in RESERVED.items():
        if key not in section:
            continue
        if not isinstance(section[key], bool):
            bad(key, "must be true or false")
        elif section[key]:
            bad(key, f"is reserved for {technique}, which a later issue implements; only false is accepted now")
    return problems


def profile_command(layout: Any) -> str:
    """The ``moe-plugins profile`` command that caches the cost profile of a layout (anything with world,
    ranks_per_node, mp, ep and esp)."""
    return (f"moe-plugins profile --world {layout.world} --ranks-per-node {layout.ranks_per_node} --mp {layout.mp} "
            f"--ep {layout.ep} --esp {layout.esp}")


def settled_degree(plugin: PluginConfig, layout: Any) -> PluginConfig:
    """``plugin`` with a pipeline_degree word resolved to 1 where the layout exchanges nothing: every chunk past
    the first would be pure overhead whatever the costs, so no cost profile is needed there (#27: "on one GPU,
    auto picks r = 1"). Otherwise ``plugin`` itself. Pure."""
    if degree_needs_profile(plugin.pipeline_degree) and exchange_free(layout):
        return replace(plugin, pipeline_degree=1)
    return plugin


def profile_problems(plugin: PluginConfig, layout: Any, lookup: Callable[[Any], Any], *,
                     profiled: bool) -> List[str]:
    """What a host finds when a section reads the cost profile cached for ``layout`` (``lookup(layout)``: the
    profile, None when none is cached, a ValueError naming the file when the one there cannot be used). A
    pipeline_degree word needs a profile; a ``profiled`` schedule (parm-auto) reads one when cached and
    otherwise runs on documented defaults. Pure: the host passes its lookup; checked before any group is built."""
    needs = degree_needs_profile(settled_degree(plugin, layout).pipeline_degree)
    if not (needs or profiled):
        return []
    key, value = ("pipeline_degree", plugin.pipeline_degree) if needs else ("schedule", plugin.schedule)
    try:
        found = lookup(layout)
    except ValueError as exc:
        return [f"{SECTION}.{key} ({value!r}) reads the cost profile cached for this layout, which cannot be used: "
                f"{exc}; run `{profile_command(layout)}` on this cluster to replace it"]
    if found is None and needs:
        return [f"{SECTION}.{key} ({value!r}) needs a cost profile for this layout, and none is cached: run "
                f"`{profile_command(layout)}` on this cluster, or give an integer"]
    return []


def load_ds_config(config: Union[str, os.PathLike, Mapping[str, Any]]) -> Dict[str, Any]:
    """A ds_config given as a dict or a JSON file path, read once (a file that cannot be read as JSON: a
    ValueError naming it)."""
    if isinstance(config, Mapping):
        return dict(config)
    try:
        with open(config, "r", encoding="utf-8") as fh:
            loaded = json.load(fh)
    except (OSError, ValueError) as exc:          # missing, unreadable, not UTF-8, not JSON
        raise ValueError(f"ds_config {os.fspath(config)!r} cannot be read as JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"ds_config {os.fspath(config)!r} must hold a JSON object, got {type(loaded).__name__}")
    return loaded


def section_of(ds_config: Mapping[str, Any], *, schedules: Optional[Sequence[str]] = None,
               degrees: Optional[Mapping[str, str]] = None,
               sections: Optional[Mapping[str, SectionCheck]] = None) -> Optional[PluginConfig]:
    """The validated ``moe_plugins`` section of a ds_config, or None when it has none."""
    if SECTION not in ds_config:
        return None
    return PluginConfig.from_dict(ds_config[SECTION], SECTION, schedules=schedules, degrees=degrees,
                                  sections=sections)


def resolve(config: Union[None, PluginConfig, str, os.PathLike, Mapping[str, Any]], *,
            schedules: Optional[Sequence[str]] = None,
            degrees: Optional[Mapping[str, str]] = None,
            sections: Optional[Mapping[str, SectionCheck]] = None) -> Optional[PluginConfig]:
    """What ``moe_plugins.enable(...)`` accepts, as a PluginConfig (None: decide per engine from its ds_config).

    - a PluginConfig;
    - a ds_config dict or JSON path holding a ``moe_plugins`` section (a ds_config without one is an error);
    - the section itself as a dict.
    """
    if config is None or isinstance(config, PluginConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        ds_config = load_ds_config(config)
        found = section_of(ds_config, schedules=schedules, degrees=degrees, sections=sections)
        if found is None:
            raise ValueError(f"ds_config {os.fspath(config)!r} has no {SECTION!r} section")
        return found
    if not isinstance(config, Mapping):
        raise ValueError(f"moe_plugins.enable expects a ds_config (dict or path), its {SECTION!r} section or a "
                         f"PluginConfig, got {type(config).__name__}")
    if SECTION in config:
        return section_of(config, schedules=schedules, degrees=degrees, sections=sections)
    host_keys = sorted(set(config) & _DS_CONFIG_KEYS)
    if host_keys:
        raise ValueError(f"the ds_config given (keys {', '.join(host_keys)}, ...) has no {SECTION!r} section")
    return PluginConfig.from_dict(config, SECTION, schedules=schedules, degrees=degrees, sections=sections)
