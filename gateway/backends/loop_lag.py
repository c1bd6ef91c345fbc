"""How long the gateway's own event loop has been unable to run anything: a heartbeat.

A connect timeout is a timer on the event loop. When a burst of thousands of requests arrives
at once, one loop iteration can take seconds (accepting and parsing them all), and the timers
that expired meanwhile run before the loop looks at the sockets whose connects completed long
ago: the connects "time out" although each node answered in microseconds (1,024 of 10,000
streams failed so, with every node healthy). `stalled_since(t)` says how long the loop stood
still after `t`, so such a timeout can be told apart from a node that did not answer.

Invariant: the heartbeat costs one timer every `INTERVAL_S`; nothing else runs unless asked.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

#: the heartbeat's period
INTERVAL_S = 0.05
#: stalls shorter than this are not remembered
MIN_STALL_S = 0.01


class LoopLag:
    def __init__(self) -> None:
        #: (when a stall ended, how long it was), the last 256 stalls
        self._stalls: deque[tuple[float, float]] = deque(maxlen=256)
        #: when the heartbeat in progress went to sleep
        self._beat = time.monotonic()

    def stalled_since(self, t: float) -> float:
        """The longest stretch after monotonic time `t` in which the loop ran nothing (s),
        the stall going on now included (a heartbeat overdue is one)."""
        now = time.monotonic()
        worst = max(0.0, now - max(self._beat, t) - INTERVAL_S)
        for end, length in reversed(self._stalls):
            if end <= t:
                break
            worst = max(worst, min(length, end - t))
        return worst

    async def run(self) -> None:
        """The heartbeat: run it as a task for as long as the loop serves (cancel it to stop)."""
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(INTERVAL_S)
            now = time.monotonic()
            late = now - self._beat - INTERVAL_S
            if late >= MIN_STALL_S:
                self._stalls.append((now, late))
