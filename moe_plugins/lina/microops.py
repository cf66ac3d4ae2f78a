"""Lina's tensor partitioning (§4.2), as pure functions: a gradient buffer cut into equal micro-ops, and the
micro-op size that ``micro_op_mb: "auto"`` derives from the fitted DP all-reduce model."""

from __future__ import annotations

from typing import List, Tuple

MB = 1_000_000
AUTO_TARGET_S = 2.5e-3          # one micro-op about 2-3 ms on the link (issue: "about 2-3 ms")
MIN_BYTES, MAX_BYTES = 64 * 1024, 64 * MB


def micro_op_slices(numel: int, chunk: int) -> List[Tuple[int, int]]:
    """``[start, stop)`` element ranges of a flat buffer of ``numel`` elements cut into micro-ops of ``chunk``
    elements (the last may be shorter); one slice of everything when ``chunk`` <= 0 (no partitioning)."""
    if numel < 0:
        raise ValueError(f"numel ({numel}) must be >= 0")
    if chunk <= 0 or chunk >= numel:
        return [(0, numel)] if numel else []
    return [(a, min(a + chunk, numel)) for a in range(0, numel, chunk)]


def micro_op_elements(micro_op_bytes: int, element_size: int) -> int:
    """Elements per micro-op for a size in bytes (at least one)."""
    if micro_op_bytes <= 0 or element_size <= 0:
        raise ValueError(f"micro_op_bytes ({micro_op_bytes}) and element_size ({element_size}) must be > 0")
    return max(1, micro_op_bytes // element_size)


def auto_micro_op_bytes(alpha_s: float, beta_s_per_byte: float, target_s: float = AUTO_TARGET_S) -> int:
    """The size that keeps the link busy for ``target_s`` by the fitted model t(b) = alpha + beta b: b = target /
    beta, clamped to [64 KiB, 64 MB]. The fixed cost alpha is left out on purpose: on gloo it is milliseconds of
    software per op, and sizing the whole op to the target would make micro-ops tiny and all overhead (the step
    bench's size sweep, docs/lina.md)."""
    del alpha_s                      # see the docstring
    if beta_s_per_byte <= 0:
        return MAX_BYTES
    return int(min(MAX_BYTES, max(MIN_BYTES, target_s / beta_s_per_byte)))


def micro_op_bytes(micro_op_mb, profile=None, group: str = "dp") -> int:
    """The configured size in bytes: ``micro_op_mb`` MB, or "auto" from the profile's ``all_reduce@<group>``
    model (x in bytes). "auto" without a profile is an error naming the field."""
    if micro_op_mb != "auto":
        return max(1, int(float(micro_op_mb) * MB))
    if profile is None:
        raise ValueError('moe_plugins.lina.micro_op_mb ("auto") needs a cost profile: run `moe-plugins profile` '
                         "on this cluster, or give a size in MB")
    model = profile.model("all_reduce", group)
    return auto_micro_op_bytes(model.alpha, model.beta)
