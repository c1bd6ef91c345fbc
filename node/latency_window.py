"""A node's recent measured latency: TTFT and ITL over a sliding window, for its load frames
(protocol/kv_events.py LoadFrame `ttft_p90_s` / `itl_p90_s`), which the planner's load mode
weighs against its prediction (planner/decide.py).

The observations are the same as the node's `duet:time_to_first_token_seconds` and
`duet:inter_token_latency_seconds` histograms (node/responder.py): a histogram is cumulative
since the process started, the planner needs "the last `window_s`".

Invariants: a sample older than `window_s` is never counted; at most `max_samples` (the newest)
are kept, so a busy decode node's window costs bounded memory and a bounded sort per frame —
its P90 is then over the newest `max_samples` gaps, and the count it reports says so.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

#: the window nodes measure over (seconds); sent in every load frame as `latency_window_s`
WINDOW_S = 30.0
MAX_SAMPLES = 2048


class RecentLatency:
    """(monotonic time, seconds) samples of one latency over the last `window_s`."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, seconds: float) -> None:
        self._samples.append((self.clock(), seconds))

    def _trim(self) -> None:
        cut = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < cut:
            self._samples.popleft()

    def p90(self) -> tuple[float, int]:
        """(P90 in seconds, sample count) over the window; (0.0, 0) when it is empty. Nearest-rank
        P90: the smallest sample with at least 90 % of the samples at or below it."""
        self._trim()
        n = len(self._samples)
        if n == 0:
            return 0.0, 0
        values = sorted(s for _, s in self._samples)
        return values[max(0, math.ceil(0.9 * n) - 1)], n
