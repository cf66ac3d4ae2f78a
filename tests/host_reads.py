"""Counting host reads of tensor values: the CPU stand-in for ``torch.cuda.set_sync_debug_mode`` (issue #27).

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``int()``/``float()``/``bool()`` of a
tensor, ``nonzero`` and the ops whose output size depends on values) waits for the device: a synchronisation.
:class:`HostReads` is a ``TorchFunctionMode`` that records every such call made while it is active, with the
innermost frame of this project that made it, so a test can require none in a steady-state step.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

# tensor methods / functions whose result depends on values being on the host
READS = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float", torch.Tensor.__bool__: "bool", torch.Tensor.__index__: "index",
    torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero", torch.Tensor.numpy: "numpy",
    torch.unique: "unique", torch.Tensor.unique: "unique", torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select", torch.equal: "equal", torch.Tensor.any: None,
}
SIZE_FROM_VALUES = {torch.repeat_interleave: "repeat_interleave", torch.Tensor.repeat_interleave: "repeat_interleave"}


def _where() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/moe_plugins/" in frame.filename or "/patches/" in frame.filename:
            return f"{frame.filename.split('/')[-1]}:{frame.lineno} {frame.name}"
    return "outside the project"


class HostReads(TorchFunctionMode):
    """Records (kind, where) of every host read while active; ``counts()`` groups them."""

    def __init__(self, reads: Optional[List[Tuple[str, str]]] = None) -> None:
        super().__init__()
        self.reads: List[Tuple[str, str]] = reads if reads is not None else []

    def in_thread(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` counted into the same list when it runs on another thread (modes are per thread: the
        engine's lanes run PipeMoE's chunk closures on theirs)."""
        def counted(*args: Any) -> Any:
            with HostReads(self.reads):
                return fn(*args)
        return counted

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = READS.get(func)
        if kind is None and func in SIZE_FROM_VALUES and kwargs.get("output_size") is None:
            kind = SIZE_FROM_VALUES[func]
        if kind is None and func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            index = args[1]
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                kind = "bool-mask index"
        if kind is not None:
            self.reads.append((kind, _where()))
        return func(*args, **kwargs)

    def counts(self) -> Counter:
        return Counter(self.reads)
