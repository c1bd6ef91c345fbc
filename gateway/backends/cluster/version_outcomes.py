"""The outcomes of a versioned model's attempts, per version, over a sliding window: what a
rollout (rollout.py) judges the new version by, against the old one.

An attempt counts once, at its first token or its failure: failed (no answer came from the
version: every node tried failed, or none could be routed) or answered, with its time to first
token. An answer that ends whole with two tokens or more also gives its inter-token latency
(the seconds after its first token over the tokens after it). A client that leaves counts
nothing more. The counts are this gateway's own; the window holds at most
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
    #: the whole answers' inter-token latency P90, nearest rank (None: none ended yet)
    itl_p90_s: float | None = None

    @property
    def error_rate(self) -> float:
        return self.failed / self.attempts if self.attempts else 0.0


class VersionOutcomes:
    """(time, ok, ttft) per attempt, per version of one model."""

    def __init__(self) -> None:
        self._kept: dict[str, deque[tuple[float, bool, float]]] = {}
        self._itl: dict[str, deque[tuple[float, float]]] = {}
        #: attempts and failed attempts per version since the gateway started (a timeline's
        #: per-second counts are their differences)
        self.totals: dict[str, list[int]] = {}

    def record(self, version: str, ok: bool, ttft_s: float = 0.0, now: float | None = None) -> None:
        q = self._kept.setdefault(version, deque(maxlen=MAX_KEPT))
        q.append((time.monotonic() if now is None else now, ok, ttft_s))
        t = self.totals.setdefault(version, [0, 0])
        t[0] += 1
        t[1] += not ok

    def record_itl(self, version: str, itl_s: float, now: float | None = None) -> None:
        q = self._itl.setdefault(version, deque(maxlen=MAX_KEPT))
        q.append((time.monotonic() if now is None else now, itl_s))

    def stats(self, version: str, window_s: float, now: float | None = None) -> WindowStats:
        """`version`'s attempts that ended within the last `window_s` seconds."""
        since = (time.monotonic() if now is None else now) - window_s
        itls = self._itl.get(version)
        while itls and itls[0][0] < since:  # older than any window asked: never needed again
            itls.popleft()
        itl_p90 = _p90([s for _, s in itls or ()])
        q = self._kept.get(version)
        if not q:
            return WindowStats(attempts=0, failed=0, ttft_p90_s=None, itl_p90_s=itl_p90)
        while q and q[0][0] < since:
            q.popleft()
        failed = sum(1 for _, ok, _ in q if not ok)
        ttft_p90 = _p90([t for _, ok, t in q if ok])
        return WindowStats(attempts=len(q), failed=failed, ttft_p90_s=ttft_p90, itl_p90_s=itl_p90)


def _p90(values: list[float]) -> float | None:
    """Nearest-rank P90 (None: no values)."""
    if not values:
        return None
    values.sort()
    return values[max(0, math.ceil(0.9 * len(values)) - 1)]
