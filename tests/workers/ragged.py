"""Pool jobs for the ragged exchange tests (tests/test_ragged_exchange.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import List

from moe_plugins.tools.verify import VerifySpec, collect_rank


def padded_and_ragged(specs: List[VerifySpec]):
    """Every spec run with the padded and with the ragged exchange; rank 0 returns [(padded, ragged)] per spec,
    each the per-rank results of ``collect_rank``."""
    out = [(collect_rank(replace(s, exchange="padded")), collect_rank(replace(s, exchange="ragged"))) for s in specs]
    return out
