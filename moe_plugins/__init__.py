"""moe_plugins: MoE training speed-ups for DeepSpeed and Megatron-core, one flag away.

The framework-agnostic core lives here (layout, groups, gating, schedules, ledger); host adapters live in
``moe_plugins.patches``.
"""

__version__ = "0.1.0"
