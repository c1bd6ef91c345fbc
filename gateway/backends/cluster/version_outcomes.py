"""The outcomes of a versioned model's attempts, per version, over a sliding window: what a
rollout (rollout.py) judges the new version by, against the old one.

An attempt counts once, when it ends: failed (no answer came from the version: every node
tried failed, or none could be routed) or answered, with its time to first token. A client
that leaves counts nothing. The counts are this gateway's own; the window holds at most
`MAX_KEPT` outcomes per version (the oldest go first), so memory stays bounded under any load.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

#: outcomes kept per version (a window longer than this many attempts is judged on the newest)
MAX_KEPT = 100_000


@dataclass(frozen=True)
class WindowStats:
    """One version's attempts in the window."""

    attempts: int
    failed: int
    #: the answered attempts' TTFT P90, nearest rank (None: none answered)
    ttft_p90_s: float | None

    @property
    def error_rate(self) -> float:
        return self.failed / self.attempts if self.attempts else 0.0


class VersionOutcomes:
    """(time, ok, ttft) per attempt, per version of one model."""

    def __init__(self) -> None:
        self._kept: dict[str, deque[tuple[float, bool, float]]] = {}
        #: attempts and failed attempts per version since the gateway started (a timeline's
        #: per-second counts are their differences)
        self.totals: dict[str, list[int]] = {}

    def record(self, version: str, ok: bool, ttft_s: float = 0.0, now: float | None = None) -> None:
        q = self._kept.setdefault(version, deque(maxlen=MAX_KEPT))
        q.append((time.monotonic() if now is None else now, ok, ttft_s))
        t = self.totals.setdefault(version, [0, 0])
        t[0] += 1
        t[1] += not ok

    def stats(self, version: str, window_s: float, now: float | None = None) -> WindowStats:
        """`version`'s attempts that ended within the last `window_s` seconds."""
        q = self._kept.get(version)
        if not q:
            return WindowStats(attempts=0, failed=0, ttft_p90_s=None)
        since = (time.monotonic() if now is None else now) - window_s
        while q and q[0][0] < since:  # older than any window asked: never needed again
            q.popleft()
        ttfts = sorted(t for _, ok, t in q if ok)
        failed = sum(1 for _, ok, _ in q if not ok)
        p90 = ttfts[max(0, math.ceil(0.9 * len(ttfts)) - 1)] if ttfts else None
        return WindowStats(attempts=len(q), failed=failed, ttft_p90_s=p90)
