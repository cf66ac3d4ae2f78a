"""Hecate (FSSDP): experts sharded over all devices and materialised sparsely where the tokens are.
docs/hecate.md explains it; the ragged exchange it needs lives in :mod:`moe_plugins.core.ragged`.
"""
