"""The pipelined Megatron layers' engines, owned by whoever builds the layers: :func:`~moe_plugins.patches.megatron.
enable` (closed by ``disable()``), or the caller of the spec provider (``get_moe_module_spec(..., engines=...)``).

A PipeMoE degree other than 1 runs each layer's chunks on an engine's pipeline lane, a full set of twin process
groups. A layer never builds those itself: it asks the :class:`LayoutEngines` it is given for the engine of its
token layout, which the first layer of that layout builds (collective: Megatron builds its layers in the same
order on every rank), and every later layer of the layout shares. With Lina the plugin's
:class:`~moe_plugins.patches.megatron_lina.LinaState` plays this part (its engines also carry the reducer).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch.distributed as dist

from moe_plugins.core.engine import CommEngine, build_engine
from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.ledger import CommLedger

logger = logging.getLogger("moe_plugins.megatron")


class LayoutEngines:
    """One engine with a pipeline lane per token layout, built on first use and freed by :meth:`close`
    (collective; a context manager). Shared, not copied, when Megatron deep-copies a layer spec. ``timeout_s``:
    how long the lanes' collectives wait for a peer (None: the default group's timeout)."""

    def __init__(self, *, ledger: Optional[CommLedger] = None, timeout_s: Optional[float] = None,
                 record_timeline: bool = False):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s ({timeout_s!r}) must be > 0 seconds")
        self.ledger, self.timeout_s, self.record_timeline = ledger, timeout_s, record_timeline
        self.engines: Dict[ParallelLayout, CommEngine] = {}
        self.closed = False

    def engine_for(self, tokens: MoEProcessGroups) -> CommEngine:
        """The pipelined engine of ``tokens``' layout (collective the first time a layout is asked for)."""
        if self.closed:
            raise ValueError("these LayoutEngines were closed (the plugin was disabled, or their owner closed "
                             "them): build pipelined layers while they are open")
        found = self.engines.get(tokens.layout)
        if found is None:
            found = self.engines[tokens.layout] = build_engine(tokens, ledger=self.ledger, pipeline=True,
                                                               timeout_s=self.timeout_s,
                                                               record_timeline=self.record_timeline)
            log = logger.info if dist.get_rank() == 0 else logger.debug
            log("moe_plugins: pipeline engine for ep=%d esp=%d built (twin process groups)", tokens.layout.ep,
                tokens.layout.esp)
        return found

    def close(self) -> None:
        """Free every engine's twin groups (collective; layers on them must not run afterwards)."""
        engines, self.engines, self.closed = list(self.engines.values()), {}, True
        for engine in engines:
            engine.close()

    def __enter__(self) -> "LayoutEngines":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __deepcopy__(self, memo: Any) -> "LayoutEngines":
        return self


__all__ = ["LayoutEngines"]
