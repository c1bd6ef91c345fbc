"""When a simple batch should be done (`estimated_completion` of `POST /v1/batch` and of its
status while it runs): the lines queued ahead plus its own, at the recent run time of a line,
spread over the runner's concurrency. A guess, not a promise.

Its inputs are store reads — the lines queued (a sum over the open batches' rows) and the mean
run time of the lines that succeeded in the last hour — and they change slowly, so a gateway
keeps them for `TTL_S`: a client creating or polling in a loop costs the store one pair of
reads per `TTL_S`, whatever its rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.accounts.store.batch_tables import BatchTables
from gateway.batch.config import BatchConfig

#: how long the store's figures are reused
TTL_S = 10.0
#: the run times averaged: the lines that finished this long ago or less
WINDOW_S = 3600.0


class Estimator:
    def __init__(
        self,
        store: BatchTables,
        config: BatchConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self._at: float | None = None
        self._figures = (config.default_request_s, 0)

    async def _inputs(self) -> tuple[float, int]:
        """(mean seconds a line runs, lines queued), at most `TTL_S` old."""
        now = self.clock()
        if self._at is None or now - self._at >= TTL_S:
            mean = await self.store.mean_request_seconds(time.time() - WINDOW_S)
            queued = await self.store.pending_requests()
            self._figures = (mean or self.config.default_request_s, queued)
            self._at = now
        return self._figures

    async def completion(self, n: int, now: float) -> float:
        """When `n` more lines, queued after the others, should be done (unix seconds)."""
        mean, queued = await self._inputs()
        return now + (queued + n) * mean / max(self.config.concurrency, 1)
