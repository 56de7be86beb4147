"""Nearest-rank percentiles, for the strength test's hand-offs and the history's statistics."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], percent: float) -> float | None:
    """The nearest-rank ``percent`` percentile (0 < percent <= 100); ``None`` if no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return ordered[rank - 1]
