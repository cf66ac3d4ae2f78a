"""A measured exchange time as a curve (the isotonic fit of a profile's per-size medians), the alternative to
the alpha-beta line of :mod:`moe_plugins.core.costmodel` where a link changes regime with the message size.

Units: x in bytes (elements where a planner converts), seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np
from scipy.optimize import isotonic_regression


@dataclass(frozen=True, kw_only=True)
class ExchangeCurve:
    """One exchange's time as measured, not as a line: t(x) is the isotonic (non-decreasing) least-squares
    fit of the profile's per-size medians, linearly interpolated between the measured sizes.

    Why: over a gloo link one all-to-all changes regime with its size. On the emulated link
    (benchmarks/results/duplex-link.md) an exchange of 2 MiB each way took 2x its time at the rate while
    half of it took 1x: past a size the two directions take turns. A line fitted across both regimes
    overprices small chunks and underprices large exchanges, which is where PipeMoE's choice is made.
    Below the smallest size t is the smallest size's time; past the largest it grows with ``beta_tail``
    (the fitted line's slope)."""

    x: Tuple[float, ...]          # bytes, increasing
    seconds: Tuple[float, ...]    # non-decreasing
    beta_tail: float              # s/byte past the last size

    def time(self, x: float) -> float:
        if x >= self.x[-1]:
            return self.seconds[-1] + self.beta_tail * (x - self.x[-1])
        return float(np.interp(x, self.x, self.seconds))

    def problems(self) -> List[str]:
        out = []
        if len(self.x) < 2 or len(self.x) != len(self.seconds):
            out.append(f"exchange_curve needs >= 2 sizes and one time per size (got {len(self.x)} sizes, "
                       f"{len(self.seconds)} times)")
        elif any(b <= a for a, b in zip(self.x, self.x[1:])) or self.x[0] < 0:
            out.append(f"exchange_curve sizes ({list(self.x)!r}) must be increasing and >= 0")
        elif any(b < a for a, b in zip(self.seconds, self.seconds[1:])) or self.seconds[0] < 0:
            out.append(f"exchange_curve times ({list(self.seconds)!r}) must be non-decreasing and >= 0")
        if not (math.isfinite(self.beta_tail) and self.beta_tail >= 0):
            out.append(f"exchange_curve beta_tail ({self.beta_tail!r}) must be a finite number >= 0")
        return out

    @staticmethod
    def fit(measurement, beta_tail: float) -> "ExchangeCurve":
        """The isotonic fit of ``measurement`` (a costmodel.Measurement: x, seconds), one point per size (repeated sizes enter as their mean,
        weighted by their count)."""
        x_U, inverse, count_U = np.unique(np.asarray(measurement.x, dtype=float), return_inverse=True,
                                          return_counts=True)
        mean_U = np.bincount(inverse, weights=np.asarray(measurement.seconds, dtype=float)) / count_U
        t_U = isotonic_regression(mean_U, weights=count_U.astype(float)).x
        return ExchangeCurve(x=tuple(float(v) for v in x_U), seconds=tuple(float(max(t, 0.0)) for t in t_U),
                             beta_tail=max(float(beta_tail), 0.0))
