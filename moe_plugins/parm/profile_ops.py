"""Parm's op for ``moe-plugins profile``: SAA as the layer runs it (``saa@ep_esp+mp``)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.profile_ops import ProfileBench, elements
from moe_plugins.parm.saa import block_order, saa_raw

SAA_ROW = 64       # elements per slot row of the profiled SAA tensor (w: G x 1 x 1 x c x SAA_ROW)


def _saa(groups: MoEProcessGroups, numel: int, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """The layer's own SAA (:func:`moe_plugins.parm.saa.saa_raw`: p2p slices on EP&ESP, each peer block summed
    and all-gathered on MP as it lands) on ``numel`` all-to-all elements per rank, so the fitted term carries
    its per-slice costs; the all-gather is mp / esp times the all-to-all, as in S2."""
    g = groups.ep_esp.size
    w = torch.randn(g, 1, 1, numel // (g * SAA_ROW), SAA_ROW, device=device).to(dtype)
    order = block_order(groups.layout, groups.mp, groups.esp.size)
    rec = Recorder(None, "profile")
    return lambda: saa_raw(w, ep_esp=groups.ep_esp, mp=groups.mp, esp=groups.esp.size, order=order, rec=rec,
                           phase="forward")


def SAA_OP(spec, groups: MoEProcessGroups, device: torch.device, stack) -> Optional[ProfileBench]:
    """``saa@ep_esp+mp`` at the spec's sizes; x = bytes into the all-to-all. Needs EP&ESP and MP > 1."""
    if "saa" not in spec.ops or groups.ep_esp.size == 1 or groups.mp.size == 1:
        return None
    dtype = spec.torch_dtype
    elsize = torch.tensor([], dtype=dtype).element_size()
    numels = [elements(s, dtype, groups.ep_esp.size * SAA_ROW) for s in sorted(set(spec.sizes_bytes))]
    return ProfileBench("saa@ep_esp+mp", lambda i: float(numels[i] * elsize),
                        lambda i: _saa(groups, numels[i], dtype, device))
