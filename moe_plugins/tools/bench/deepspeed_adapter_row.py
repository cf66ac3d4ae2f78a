"""Row ``deepspeed@plugin=<schedule>[,r=<degree>]``: the ``deepspeed`` row's stock layer, swapped by moe_plugins'
DeepSpeed adapter exactly as a user's ds_config section ``"moe_plugins": {"schedule": ..., "pipeline_degree": ...}``
swaps it (the real user path: DeepSpeed's gate through the exact fast gate, DeepSpeed's expert modules, the
schedule's data flow and executor).

Built like the ``deepspeed`` row (:func:`.stock_deepspeed.stock_moe`: the same module from the same CaseData
weights, fed the same tokens), then:

1. ``moe_plugins.enable(ds_config, ledger=...)`` with a ds_config holding the row's section, plus the case's
   ``ranks_per_node`` so that the adapter's layout is the bench's;
2. ``moe.set_deepspeed_parallelism()``: the call DeepSpeed's engine makes for every MoE layer in
   ``_configure_distributed_model``. The adapter's patched ``_create_process_groups`` builds its groups,
   registers them with DeepSpeed and swaps the layer;
3. the row's ``close()`` is the handle's ``disable()``: DeepSpeed's functions and group registry are restored and
   the adapter's groups destroyed (collective; the runner closes auto rows after each rate, the others after
   each case, in the same order on every rank).

Cost profiles (``plugin=parm-auto``, ``r=auto``, ``r=tune``): the adapter reads the profile ``moe-plugins
profile`` caches. The row writes the profile the runner measured at this rate (``CaseData.extras['profile']``, as
the plugin rows get theirs) into a private cache directory and points ``$MOE_PLUGINS_CACHE`` there while
enabling, which is when the adapter reads the variable. Without a profile the directory stays empty, so a
user's own cache never leaks into a bench.

One at a time: the adapter patches DeepSpeed process-wide with one configuration (``enable`` refuses a second
while one is on), so a run holds at most one ``deepspeed@plugin`` row (:func:`adapter_rows_problems`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from moe_plugins.core.costmodel import CostProfile, cache_path
from moe_plugins.core.ledger import CommLedger
from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.core.plugin_config import SECTION, PluginConfig
from moe_plugins.core.profile_ops import profile_key
from moe_plugins.core.schedule import exchange_problems
from moe_plugins.plugins import default_registry
from moe_plugins.tools.bench.case import CaseData, Row
from moe_plugins.tools.bench.lancet_exposure import INLINE, UNMEASURED
from moe_plugins.tools.bench.matrix import RowSpec
from moe_plugins.tools.bench.traffic import LedgerMeter

PLUGIN = "plugin"            # the deepspeed row's option naming the schedule the adapter swaps in
DEGREE = "r"                 # its pipeline degree (the section's pipeline_degree)
EXCHANGE = "exchange"        # its exchange (the section's exchange: padded or ragged)
CACHE_ENV = "MOE_PLUGINS_CACHE"
OPTIONS = {
    PLUGIN: "swap the layer through moe_plugins' DeepSpeed adapter with this schedule (the ds_config section's "
            "schedule: " + ", ".join(default_registry().schedule_names()) + ")",
    DEGREE: "with plugin=: the section's pipeline_degree (an int; 'auto' or 'tune' from the cost profile measured "
            "at this rate)",
    EXCHANGE: "with plugin=: the section's exchange (padded, or ragged: only occupied capacity slots travel)",
}


# ---- the row's section, checked before anything runs ----------------------------------------------------

def pipeline_degree(spec: RowSpec) -> Union[int, str]:
    value = spec.option(DEGREE, "1")
    return int(value) if value.isdigit() else value


def plugin_section(spec: RowSpec, ranks_per_node: Optional[int] = None) -> Dict[str, Any]:
    """Pure: the ``moe_plugins`` section a user would write for this row."""
    section: Dict[str, Any] = {"schedule": spec.option(PLUGIN), "pipeline_degree": pipeline_degree(spec)}
    if spec.option(EXCHANGE) is not None:
        section["exchange"] = spec.option(EXCHANGE)
    if ranks_per_node is not None:
        section["ranks_per_node"] = ranks_per_node
    return section


def adapter_row_problems(spec: RowSpec) -> List[str]:
    """Every problem with a ``deepspeed`` row's adapter options, naming the row, the option and its value."""
    schedule = spec.option(PLUGIN)
    if schedule is None:
        return [f"row ({spec.label!r}): option {key!r} is unknown for the stock layer; give it with "
                f"{PLUGIN}=<schedule>, as the adapter's {field}"
                for key, field in ((DEGREE, "pipeline_degree"), (EXCHANGE, "exchange")) if spec.option(key) is not None]
    names = default_registry().schedule_names()
    if schedule not in names:
        return [f"row ({spec.label!r}): {PLUGIN} ({schedule!r}) is not a registered schedule; allowed: "
                f"{', '.join(names)}"]
    try:
        from moe_plugins.patches.deepspeed_hecate import config_choices   # the DeepSpeed adapter's rules (Hecate)
        section = PluginConfig.from_dict(plugin_section(spec), SECTION, **config_choices())
    except ValueError as exc:
        return [f"row ({spec.label!r}): {exc}"]
    return [f"row ({spec.label!r}): {SECTION}.{p}" for p in exchange_problems(
        default_registry().schedule_class(schedule), section.exchange, section.pipeline_degree)]


def adapter_rows_problems(specs: Sequence[RowSpec]) -> List[str]:
    """Pure: more than one ``deepspeed@plugin`` row cannot be live at once (the adapter is process-wide)."""
    labels = [s.label for s in specs if s.name == "deepspeed" and s.option(PLUGIN) is not None]
    if len(labels) < 2:
        return []
    return [f"rows ({', '.join(labels)}): at most one deepspeed@{PLUGIN}=... row per run; moe_plugins' DeepSpeed "
            "adapter patches DeepSpeed process-wide with one configuration at a time (run the others separately)"]


# ---- building and closing the row --------------------------------------------------------------------------

@contextlib.contextmanager
def _environ(key: str, value: str) -> Iterator[None]:
    """``os.environ[key] = value`` for the block, restored after."""
    before = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _write_profile(cache_dir: str, profile: Optional[CostProfile], data: CaseData, device: torch.device) -> None:
    """Cache ``profile`` where the adapter looks it up for the case's layout (nothing when None)."""
    if profile is not None:
        profile.save(cache_path(Path(cache_dir), profile_key(data.groups.layout, dist.get_backend(), device)))


def _swap(moe: torch.nn.Module, spec: RowSpec, data: CaseData, ledger: CommLedger, profile: Optional[CostProfile]):
    """Enable the adapter with the row's ds_config and let it swap ``moe``; returns the handle (enabled)."""
    import moe_plugins
    from moe_plugins.patches import deepspeed as adapter
    from moe_plugins.tools.bench.stock_deepspeed import case_mpu
    from deepspeed.utils import groups as ds_groups
    if adapter.active() is not None:
        raise ValueError(f"row ({spec.label!r}): moe_plugins is already enabled for DeepSpeed (another "
                         f"deepspeed@{PLUGIN} row is live); the adapter takes one configuration at a time")
    ds_config = {SECTION: plugin_section(spec, data.groups.layout.ranks_per_node)}
    with tempfile.TemporaryDirectory(prefix="moe-bench-ds-profile-") as cache_dir:
        _write_profile(cache_dir, profile, data, next(moe.parameters()).device)
        with _environ(CACHE_ENV, cache_dir):
            handle = moe_plugins.enable(ds_config, ledger=ledger)
        try:
            with Patcher([Patch(ds_groups, "mpu", case_mpu(data))]):     # the engine's mpu, as initialize sets it
                moe.set_deepspeed_parallelism()
            if len(handle.swaps) != 1:
                raise ValueError(f"row ({spec.label!r}): the adapter swapped {len(handle.swaps)} layers, not 1")
        except BaseException:
            handle.disable()
            raise
    return handle


def swap_notes(handle: Any) -> Tuple[str, ...]:
    """What the adapter reported for the swapped layer (its setup record)."""
    return tuple(f"adapter: schedule {s['schedule']}{', ragged exchange' if s['exchange'] == 'ragged' else ''}, "
                 f"pipeline_degree {s['pipeline_degree']}, mp{s['mp']} ep{s['ep']} esp{s['esp']}" for s in handle.swaps)


def build_adapter_row(spec: RowSpec, data: CaseData, profile: Optional[CostProfile]) -> Row:
    """The stock layer swapped by the adapter (collective: the adapter builds groups); ``close()`` restores.
    ``profile``: the cost profile measured at this rate, for a section that reads one (else None)."""
    from moe_plugins.tools.bench.stock_deepspeed import case_mpu, moe_forward, stock_moe, tensor_parallel_scope
    problems = adapter_row_problems(spec)
    if problems:
        raise ValueError("; ".join(problems))
    moe = stock_moe(data)
    ledger = CommLedger()
    handle = _swap(moe, spec, data, ledger, profile)
    mpu, esp = case_mpu(data), data.groups.esp.size
    return Row(label=spec.label, kind="plugin", module=moe, forward=partial(moe_forward, moe),
               meter=LedgerMeter(ledger), scope=lambda: tensor_parallel_scope(mpu, esp),
               notes=swap_notes(handle), close=handle.disable,
               exposure=INLINE if pipeline_degree(spec) == 1 else UNMEASURED)   # its experts are not timed
