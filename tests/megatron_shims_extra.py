"""Test-only shim for Megatron-core 0.16.1's optimizer on CPU: ``cuda_factories_on_cpu`` is
:func:`moe_plugins.patches.megatron_cpu.megatron_optimizer_on_cpu` (documented there), kept under its old name
for the tests. Gradient clipping stays unusable on CPU, so the training tests set ``clip_grad=0.0``.
"""

from __future__ import annotations

from moe_plugins.patches.megatron_cpu import megatron_optimizer_on_cpu as cuda_factories_on_cpu

__all__ = ["cuda_factories_on_cpu"]
