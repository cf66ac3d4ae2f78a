"""Test-only shim for Megatron-core's optimizer on CPU (0.16.1 and 0.19.2: both create bookkeeping tensors with a
literal ``device='cuda'``): ``cuda_factories_on_cpu`` is
:func:`moe_plugins.patches.megatron_cpu.megatron_optimizer_on_cpu` (documented there), kept under its old name
for the tests. Gradient clipping stays unusable on CPU, so the training tests set ``clip_grad=0.0``.
"""

from __future__ import annotations

from moe_plugins.patches.megatron_cpu import megatron_optimizer_on_cpu as cuda_factories_on_cpu

__all__ = ["cuda_factories_on_cpu"]
