"""A small cost profile measured in a test, as ``moe-plugins profile`` would (pool jobs: collective)."""

from __future__ import annotations

import torch.distributed as dist

from moe_plugins.core.layout import ParallelLayout


def measure_ep_profile(layout: ParallelLayout, profile_dir: str) -> None:
    """Collective: the all-to-all on EP and the GEMM only, at few sizes (the tests' tiny models: M 16, H 24), for
    ``layout``, cached in ``profile_dir`` where ``"partitions": "auto"`` reads it."""
    from moe_plugins.core.costmodel import cache_path
    from moe_plugins.tools.profiler import ProfileSpec, profile_rank
    spec = ProfileSpec(layout=layout, sizes_bytes=(2 ** 12, 2 ** 14, 2 ** 16), gemm_rows=(16, 64, 256),
                       gemm_shape=(1, 16, 24), ops=("gemm", "all_to_all"), groups=("ep",), warmup=1, repeats=2)
    profile = profile_rank(spec, source="test", progress=False)
    if profile is not None:
        profile.save(cache_path(profile_dir, profile.key))
    dist.barrier()
