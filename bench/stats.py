"""Order statistics for the benchmarks: one median-and-spread shape for every figure.

Every timed figure is reported as its median with the 10th and 90th percentiles beside it
(`spread`), so a prefill and a decode figure are comparable and a noisy run shows as a wide
band, not as a better or worse number. A difference of two quantities measured on the same
requests is taken per request first, then summarised (`paired`): the median of differences,
never a difference of medians (which need not describe any request).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) with linear interpolation between order statistics."""
    if not xs:
        raise ValueError("no samples")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(xs: Sequence[float]) -> dict[str, float]:
    """median, p10, p90 (and n) of a non-empty sample."""
    return {
        "median": statistics.median(xs),
        "p10": percentile(xs, 0.1),
        "p90": percentile(xs, 0.9),
        "n": len(xs),
    }


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """spread of the per-item differences a[i] - b[i]."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length ({len(a)} != {len(b)})")
    return spread([x - y for x, y in zip(a, b, strict=True)])
