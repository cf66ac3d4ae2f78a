"""Test-only shim on top of :mod:`moe_plugins.bench.megatron_cpu_shims`, for Megatron-core 0.16.1's optimizer on CPU.

``megatron.core.optimizer`` creates its bookkeeping tensors with a literal ``device='cuda'``
(``optimizer.py``: ``FP32Optimizer._scale``, ``MixedPrecisionOptimizer.found_inf``; ``clip_grads.py``: the grad
norm), which a CPU build of torch rejects. :func:`cuda_factories_on_cpu` is a ``TorchFunctionMode`` that rewrites
a CUDA ``device=`` argument of any torch call to CPU while it is active; it changes nothing else and undoes
itself on exit. Gradient clipping stays unusable on CPU (``clip_grad_by_total_norm_fp32`` asserts
``param.grad.type() == 'torch.cuda.FloatTensor'``), so the training tests set ``clip_grad=0.0``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _CudaDeviceToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_factories_on_cpu() -> Iterator[None]:
    """Inside: ``torch.tensor(..., device='cuda')`` and friends make CPU tensors."""
    with _CudaDeviceToCpu():
        yield
