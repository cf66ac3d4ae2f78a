"""Small pure helpers of the bench reports, shared by :mod:`.report`, :mod:`.lina_report` and :mod:`.lancet_report`
(kept apart so that those modules import it, not each other): paired ratios of interleaved timings, and the
tables' number formats."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import numpy as np


def paired_ratio(times_s: Sequence[float], ref_s: Sequence[float], *, draws: int = 2000,
                 seed: int = 0) -> Optional[Dict[str, Any]]:
    """Pure, seeded. Rows are interleaved per round, so round i of every row of a group ran side by side: the
    median of the per-round ratios ``times_s[i] / ref_s[i]`` cancels the drift a shared 2-core machine adds to
    both, and its bootstrap 90% interval says how far noise can move it. None when the rounds do not pair."""
    a, b = np.asarray(times_s, dtype=float), np.asarray(ref_s, dtype=float)
    if a.size != b.size or a.size < 2:
        return None
    ratio = a / b
    meds = np.median(ratio[np.random.default_rng(seed).integers(0, ratio.size, (draws, ratio.size))], axis=1)
    return {"median": float(np.median(ratio)), "ci90": [float(np.percentile(meds, 5)), float(np.percentile(meds, 95))]}


def fmt_value(v: Optional[float], digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.{digits}f}"


def fmt_paired(p: Optional[Dict[str, Any]]) -> str:
    """A :func:`paired_ratio` as ``median (lo–hi)``; ``–`` when there is none."""
    return "–" if p is None else f"{p['median']:.3f} ({p['ci90'][0]:.3f}–{p['ci90'][1]:.3f})"
