"""A node's busy fraction over its recent window: the share of wall time its engine spent in
forward passes, for the load frame (protocol/kv_events.py `LoadFrame.busy`).

Why the planner needs it: queue depth says whether a pool keeps up *now*, not what n − 1
nodes would do. Three prefill nodes each 35 % busy show empty queues, and so would two at
52 % — but one at 105 % never catches up. The planner's scale-in test multiplies the pool's
busy fraction by n / (n − 1) (planner/decide.py); the queues alone let it scale a 1 req/s
prefill pool from 3 to 1 in the middle of a load step (a `duet up --autoscale` run, 05 Dec).

The engine thread reports cumulative seconds in steps and in the node's work between steps
that left work (engine/async_engine.py StepTiming); each load frame samples their sum, and the
fraction is the increase over the last `window_s` (the measured latencies' window,
node/latency_window.py) divided by the time it spans.

Invariants: the fraction is in [0, 1] (a sample older than the window is kept as the base until
a newer one covers the window, so the span never shrinks to a few frames); None until two
samples span at least `min_span_s` — a new node says nothing rather than 0 or 1.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from node.latency_window import WINDOW_S

#: shorter spans say little (one prefill step is up to a second)
MIN_SPAN_S = 2.0


class BusyWindow:
    def __init__(
        self,
        window_s: float = WINDOW_S,
        min_span_s: float = MIN_SPAN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque()

    def observe(self, busy_s: float) -> float | None:
        """Record the engine's cumulative busy seconds now; the fraction over the window."""
        now = self.clock()
        if self._samples and busy_s < self._samples[-1][1]:  # the engine restarted: start over
            self._samples.clear()
        self._samples.append((now, busy_s))
        cut = now - self.window_s
        while len(self._samples) > 2 and self._samples[1][0] <= cut:
            self._samples.popleft()
        t0, b0 = self._samples[0]
        span = now - t0
        if span <= 0 or span < self.min_span_s:
            return None
        return min(1.0, max(0.0, (busy_s - b0) / span))
