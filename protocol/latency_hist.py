"""A latency distribution on the wire: counts over fixed log-spaced buckets, so the planner can
merge its nodes' windows and take a pool's quantile (a mean of per-node P90s is not
one: a slow node with a tenth of the samples can own the pool's whole tail).

Buckets (scheme 1): bucket `i` holds the samples `x` with `GROWTH**(i-1) < x ≤ GROWTH**i`
seconds, `GROWTH = 1.1`; samples outside `[MIN_INDEX, MAX_INDEX]` (about 1 µs to 3.8 h) are
counted in the end buckets. A `LatencyHistogram` sends the counts from its lowest non-empty
bucket `first` to its highest (24 buckets a decade: a window spread over one decade costs ~25
small ints).

Resolution: a quantile read from (merged) counts is the geometric middle of the bucket that
holds its rank, `GROWTH**(i - ½)`. Buckets are ordered like the samples, so the exact
nearest-rank quantile of the pooled samples lies in that same bucket, and the answer is within
`√1.1 − 1 ≈ 4.9 %` of it (`RELATIVE_ERROR`), whatever the nodes' distributions; only clamped
samples (under 1 µs, over 3.8 h) are off by more.

Invariants: every node uses the same buckets, named by `scheme`; a reader merges only the
schemes it knows (a histogram of another scheme is as if absent, and the reader falls back to
the frame's own P90). Counts are never negative (checked on decode).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated

import msgspec

SCHEME = 1
GROWTH = 1.1
_LOG_GROWTH = math.log(GROWTH)
#: the end buckets: GROWTH**MIN_INDEX ≈ 1 µs, GROWTH**MAX_INDEX ≈ 13,781 s
MIN_INDEX = -145
MAX_INDEX = 100
N_BUCKETS = MAX_INDEX - MIN_INDEX + 1
#: the most a quantile read from the buckets can differ from the samples' own, relatively
RELATIVE_ERROR = math.sqrt(GROWTH) - 1


class LatencyHistogram(msgspec.Struct, frozen=True, kw_only=True):
    """One window's latency samples: `counts[k]` in bucket `first + k` of `scheme`."""

    scheme: int = SCHEME
    first: int = 0
    counts: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=N_BUCKETS)
    ] = []

    @property
    def total(self) -> int:
        return sum(self.counts)


def bucket(seconds: float) -> int:
    """The bucket index of one sample (clamped to the end buckets)."""
    if seconds <= GROWTH**MIN_INDEX:
        return MIN_INDEX
    if not seconds < GROWTH**MAX_INDEX:  # also inf and nan: never a failed frame
        return MAX_INDEX
    return max(MIN_INDEX, math.ceil(math.log(seconds) / _LOG_GROWTH))


def bucket_value(index: int) -> float:
    """What a quantile in bucket `index` reads as: the bucket's geometric middle (seconds)."""
    return GROWTH ** (index - 0.5)


def nearest_rank(q: float, n: int) -> int:
    """The 1-based rank of the nearest-rank `q` quantile of `n` ≥ 1 samples: the smallest with at
    least `q` of the samples at or below it (node/latency_window.py uses the same)."""
    return max(1, math.ceil(q * n))


def histogram_of(indices: Iterable[int]) -> LatencyHistogram:
    """The histogram of samples given by their bucket indices (`bucket(seconds)`)."""
    counts: dict[int, int] = {}
    for i in indices:
        counts[i] = counts.get(i, 0) + 1
    if not counts:
        return LatencyHistogram()
    lo, hi = min(counts), max(counts)
    return LatencyHistogram(first=lo, counts=[counts.get(i, 0) for i in range(lo, hi + 1)])


class MergedLatency:
    """Several windows' histograms added bucket by bucket: the pool's distribution."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0

    def add(self, h: LatencyHistogram) -> bool:
        """Add `h`'s counts; False (nothing added) when its scheme is not this reader's."""
        if h.scheme != SCHEME:
            return False
        for k, c in enumerate(h.counts):
            if c:
                self.counts[h.first + k] = self.counts.get(h.first + k, 0) + c
                self.total += c
        return True

    def quantile(self, q: float) -> float:
        """The nearest-rank `q` quantile (seconds, within RELATIVE_ERROR); 0.0 when empty."""
        if not self.total:
            return 0.0
        rank, seen = nearest_rank(q, self.total), 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                return bucket_value(i)
        raise AssertionError("unreachable: the counts sum to total")
