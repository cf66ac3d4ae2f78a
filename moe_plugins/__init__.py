"""moe_plugins: MoE training speed-ups for DeepSpeed and Megatron-core, one flag away.

The framework-agnostic core lives here (layout, groups, gating, schedules, ledger); host adapters live in
``moe_plugins.patches``.
"""

__version__ = "0.1.0"


def enable(config=None, *, host: str = "deepspeed", **kwargs):
    """Turn the plugin on for a host framework; returns a handle that is also a context manager.

    ``config``: a ds_config (dict or JSON path) holding a ``moe_plugins`` section, the section itself, a
    :class:`moe_plugins.core.plugin_config.PluginConfig`, or None to let each engine's ds_config section decide.
    Call before ``deepspeed.initialize``. The host is imported here, lazily: ``import moe_plugins`` alone
    never imports DeepSpeed.
    """
    if host != "deepspeed":
        raise ValueError(f"host ({host!r}) must be 'deepspeed'")
    from moe_plugins.patches import deepspeed as adapter
    return adapter.enable(config, **kwargs)


def disable() -> None:
    """Restore the host exactly (the patched functions are the original objects again); a no-op when off."""
    import sys
    adapter = sys.modules.get(f"{__name__}.patches.deepspeed")
    if adapter is not None:
        adapter.disable()
