"""The batched usage writer: settlements and usage records go to the store in batches, one
transaction per batch, and each caller learns when *its* record is committed.

Invariant: a request awaits `commit()` before its final chunk / `[DONE]` / body goes out, so
a response a client saw always has its record. A request that cannot await (its client is
gone, the handler is being cancelled) calls `submit()`: the record is written all the same.
A `commit()` that finds the writer idle writes its record at once, as a batch of one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from gateway.metrics import GatewayMetrics
from gateway.store.base import Settlement, Store

log = logging.getLogger("duet.gateway.usage")


class UsageWriter:
    def __init__(self, store: Store, metrics: GatewayMetrics, max_batch: int = 256) -> None:
        self.store = store
        self.metrics = metrics
        self.max_batch = max_batch
        self._queue: asyncio.Queue[tuple[Settlement, asyncio.Future[None]]] = asyncio.Queue()
        #: a batch is being written (by the writer task or a caller's batch of one)
        self._writing = False

    def submit(self, s: Settlement) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((s, fut))
        return fut

    async def commit(self, s: Settlement) -> None:
        if self._queue.empty() and not self._writing:
            # Nothing queued, nothing being written: this record is a batch of one — write it
            # now instead of waking the writer task and waiting for it to wake us back; at
            # once if the store can (no task, no wait: nothing to shield from cancellation).
            if self.store.settle_now([s]):
                self.metrics.usage_batches.inc()
                return
            await asyncio.shield(self._write_now([s]))
            return
        await asyncio.shield(self.submit(s))

    async def _write_now(self, batch: list[Settlement]) -> None:
        self._writing = True
        try:
            await self.store.settle(batch)
        finally:
            self._writing = False
        self.metrics.usage_batches.inc()

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._write(batch)

    async def _write(self, batch: list[tuple[Settlement, asyncio.Future[None]]]) -> None:
        try:
            await self._write_now([s for s, _ in batch])
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)
        except Exception as e:
            log.exception("writing %d usage records failed", len(batch))
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
                    fut.exception()  # retrieved: a caller that stopped waiting must not warn

    async def flush(self) -> None:
        """Write everything queued (at shutdown)."""
        batch = []
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        if batch:
            await self._write(batch)

    async def lifecycle(self) -> AsyncIterator[None]:
        task = asyncio.ensure_future(self.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self.flush()
