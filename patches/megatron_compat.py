"""Fixes for upstream bugs of a checked Megatron-core that stop a documented setup, applied while
the plugin is enabled (:func:`~moe_plugins.patches.megatron.enable`) or around a run
(:func:`megatron_compat`, which the Megatron recipe enters with the plugin on or off), each logged, each put
back after.

- ``moe_utils.te_general_gemm``: the router's gating GEMM (``RouterGatingLinearFunction``) reads this name,
  which 0.16.1 defines only when Transformer Engine imports, so without Transformer Engine every router call
  raises ``NameError`` on GPU (0.17 defines it as None). Set to None: Megatron's own torch GEMM path runs.
  Needed on 0.16.1 only: on 0.19.2 the name exists and :func:`compat_patches` returns nothing.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, List

from moe_plugins.core.patcher import Patch, Patcher

logger = logging.getLogger("moe_plugins.megatron")


def compat_patches() -> List[Patch]:
    """The fixes this Megatron needs (none where the names exist)."""
    from megatron.core.transformer.moe import moe_utils
    if "te_general_gemm" in vars(moe_utils):
        return []
    return [Patch(moe_utils, "te_general_gemm", None)]


@contextlib.contextmanager
def megatron_compat() -> Iterator[None]:
    """Apply :func:`compat_patches` for the duration of a block."""
    patches = compat_patches()
    if patches:
        logger.info("moe_plugins: Megatron-core without Transformer Engine: moe_utils.te_general_gemm set to None "
                    "for the run (upstream NameError in the router's GEMM, fixed in 0.17)")
    with Patcher(patches, logger=logger):
        yield


__all__ = ["compat_patches", "megatron_compat"]
