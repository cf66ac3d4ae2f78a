"""What a profiler op is: the protocol between ``moe-plugins profile`` (tools/profiler.py) and the ops a
paper package registers (``Registry.add_profile_op``). Pure helpers only; the timing loop is the tool's.

A registered op is a callable ``op(spec, groups, device, stack) -> Optional[ProfileBench]``: None when the
spec does not ask for it (``spec.ops``) or the layout has nothing to measure. ``stack`` (an ExitStack) takes
whatever the bench must release afterwards (an engine, process groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import os
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Tuple, Union

import torch

from moe_plugins.core.costmodel import CostProfile, ProfileKey, load_cached
from moe_plugins.core.layout import ParallelLayout


@dataclass(frozen=True)
class ProfileBench:
    key: str                          # model key, e.g. "all_to_all@ep"
    x: Callable[[int], float]         # point index -> x of the model
    setup: Callable[[int], Callable[[], None]]    # point index -> the op to time
    aliases: List[str] = field(default_factory=list)   # other keys whose groups hold the same ranks
    per_op: Callable[[int], int] = lambda i: 1     # point index -> ops one timed run holds (its time is divided)
    points: Optional[int] = None      # how many points; None: one per size of the spec


def elements(nbytes: int, dtype: torch.dtype, multiple: int) -> int:
    """Elements of ``dtype`` in about ``nbytes``, a positive multiple of ``multiple`` (pure)."""
    per = torch.tensor([], dtype=dtype).element_size()
    return max(multiple, nbytes // per // multiple * multiple)


def profile_key(layout: ParallelLayout, backend: str, device: torch.device) -> ProfileKey:
    """What a cached profile is keyed by: the layout, the backend and the device's name."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return ProfileKey(world=layout.world, ranks_per_node=layout.ranks_per_node, mp=layout.mp, ep=layout.ep,
                      esp=layout.esp, backend=backend, device=name)


def cached_profile(profile_dir: Optional[Union[str, os.PathLike]], layout: ParallelLayout, backend: str,
                   device: torch.device) -> Optional[CostProfile]:
    """The cost profile ``moe-plugins profile`` cached in ``profile_dir`` for this layout, backend and device:
    the one lookup of both hosts and ``verify``. None without a directory or a cached file; a file there that
    cannot be used (corrupt, another layout's, another version): a ValueError naming it."""
    return None if profile_dir is None else load_cached(Path(profile_dir), profile_key(layout, backend, device))


def this_device() -> str:
    """The device name cached profiles are keyed by for this process: the current CUDA device's, else "cpu"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def newest_cached(cache_dir: Union[str, os.PathLike], device: str, models: Iterable[str],
                  **degrees: int) -> Optional[Tuple[Path, CostProfile]]:
    """The newest profile cached in ``cache_dir`` for ``device`` whose key has the layout ``degrees`` given
    (``ep=2``, ``mp=1``, ...) and that holds every model in ``models`` (the planners' lookup), or None."""
    cache_dir, wanted = Path(cache_dir), set(models)
    if not cache_dir.is_dir():
        return None
    for path in sorted(cache_dir.glob("profile-*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        profile = CostProfile.load(path)
        key = profile.key
        if key.device == device and all(getattr(key, n) == v for n, v in degrees.items()) \
                and wanted <= set(profile.models):
            return path, profile
    return None
