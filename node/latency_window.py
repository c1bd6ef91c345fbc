"""A node's recent measured latency: TTFT and ITL over a sliding window, for its load frames
(protocol/kv_events.py LoadFrame `ttft_p90_s` / `itl_p90_s`, and the window's distribution as
`ttft_hist` / `itl_hist`: protocol/latency_hist.py), which the planner's load mode weighs
against its prediction (planner/decide.py; it merges the nodes' histograms into a pool P90).

The observations are the same as the node's `duet:time_to_first_token_seconds` and
`duet:inter_token_latency_seconds` histograms (node/responder.py): a histogram is cumulative
since the process started, the planner needs "the last `window_s`".

Invariants: a sample older than `window_s` is never counted; at most `max_samples` (the newest)
are kept, so a busy decode node's window costs bounded memory and a bounded sort per frame —
its P90 is then over the newest `max_samples` gaps, and the count it reports says so. A
`Window` is taken in one trim: its P90, count and histogram describe the same samples.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from protocol.latency_hist import LatencyHistogram, bucket, histogram_of, nearest_rank

#: the window nodes measure over (seconds); sent in every load frame as `latency_window_s`
WINDOW_S = 30.0
MAX_SAMPLES = 2048


@dataclass(frozen=True)
class Window:
    """One latency over the window: its exact nearest-rank P90, sample count and histogram."""

    p90_s: float
    samples: int
    hist: LatencyHistogram


class RecentLatency:
    """(monotonic time, seconds, bucket) samples of one latency over the last `window_s` (the
    bucket is computed once per sample, not once per frame)."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        max_samples: int = MAX_SAMPLES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float, int]] = deque(maxlen=max_samples)

    def add(self, seconds: float) -> None:
        self._samples.append((self.clock(), seconds, bucket(seconds)))

    def _trim(self) -> None:
        cut = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < cut:
            self._samples.popleft()

    def p90(self) -> tuple[float, int]:
        """(P90 in seconds, sample count) over the window; (0.0, 0) when it is empty. Nearest-rank
        P90: the smallest sample with at least 90 % of the samples at or below it."""
        w = self.window()
        return w.p90_s, w.samples

    def window(self) -> Window:
        """The window's P90, count and histogram, from one trim."""
        self._trim()
        n = len(self._samples)
        if n == 0:
            return Window(0.0, 0, LatencyHistogram())
        values = sorted(s for _, s, _ in self._samples)
        return Window(
            values[nearest_rank(0.9, n) - 1], n, histogram_of(b for _, _, b in self._samples)
        )
