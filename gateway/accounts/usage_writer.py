"""The batched usage writer: settlements and usage records go to the store in batches, one
transaction per batch, and each caller learns when *its* record is committed.

Invariant: a request awaits `commit()` before its final chunk / `[DONE]` / body goes out, so
a response a client saw always has its record. A request that cannot await (its client is
gone, the handler is being cancelled) calls `submit()`: the record is written all the same.
A `commit()` that finds the writer idle writes its record at once, as a batch of one.

A batch the store refuses (a database gone, a full disk) is never dropped: it goes back to the
writer, which retries it with a backoff (`RETRY_S`, doubling to `MAX_RETRY_S`) until the store
takes it, in the order it came. A request waits for its record at most `COMMIT_WAIT_S`, then
answers anyway (the record stays queued: it is written once the store is back). At shutdown,
what is still queued is retried for `FLUSH_S`; what the store still refuses then is logged
record by record (an operator can replay it), not silently lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from gateway.accounts.store.base import Settlement, Store
from gateway.metrics import GatewayMetrics

log = logging.getLogger("duet.gateway.usage")
#: the first retry of a batch the store refused, doubling to MAX_RETRY_S
RETRY_S = 0.2
MAX_RETRY_S = 5.0
#: how long a request waits for its record before answering anyway (the record stays queued)
COMMIT_WAIT_S = 10.0
#: how long a stopping gateway keeps retrying what is still queued
FLUSH_S = 10.0


class UsageWriter:
    def __init__(self, store: Store, metrics: GatewayMetrics, max_batch: int = 256) -> None:
        self.store = store
        self.metrics = metrics
        self.max_batch = max_batch
        self._queue: asyncio.Queue[tuple[Settlement, asyncio.Future[None]]] = asyncio.Queue()
        #: a batch is being written (by the writer task or a caller's batch of one)
        self._writing = False
        #: the batch the writer task holds (being written or retried)
        self._current: list[tuple[Settlement, asyncio.Future[None]]] = []

    def submit(self, s: Settlement) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((s, fut))
        return fut

    async def commit(self, s: Settlement) -> None:
        if self._queue.empty() and not self._writing:
            # Nothing queued, nothing being written: this record is a batch of one — write it
            # now instead of waking the writer task and waiting for it to wake us back; at
            # once if the store can (no task, no wait: nothing to shield from cancellation).
            try:
                if self.store.settle_now([s]):
                    self.metrics.usage_batches.inc()
                    return
                await asyncio.shield(self._write_now([s]))
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("writing a usage record failed; the writer retries it", exc_info=True)
        await self._wait(self.submit(s))

    async def _wait(self, fut: asyncio.Future[None]) -> None:
        """Wait for a queued record at most COMMIT_WAIT_S (the writer keeps it until written)."""
        try:
            async with asyncio.timeout(COMMIT_WAIT_S):
                await asyncio.shield(fut)
        except TimeoutError:
            log.error(
                "the store has not taken a usage record for %.0f s; answering anyway (it stays "
                "queued and is written once the store is back)",
                COMMIT_WAIT_S,
            )

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
            self._current = batch  # if a stop cancels its retries, flush() writes it
            await self._write(batch)
            self._current = []

    async def _write(
        self, batch: list[tuple[Settlement, asyncio.Future[None]]], give_up_at: float | None = None
    ) -> None:
        """Write `batch`, retrying until the store takes it (or `give_up_at`, at shutdown)."""
        delay = RETRY_S
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self._write_now([s for s, _ in batch])
                break
            except Exception:
                if give_up_at is not None and loop.time() + delay > give_up_at:
                    for s, _ in batch:  # the operator's copy: every figure of every record
                        log.error(
                            "usage record NOT written (the store refused it at shutdown): %r", s
                        )
                    return
                log.exception(
                    "writing %d usage records failed; retrying in %.1f s", len(batch), delay
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_RETRY_S)
        for _, fut in batch:
            if not fut.done():
                fut.set_result(None)

    async def flush(self) -> None:
        """Write everything queued (at shutdown), retrying for FLUSH_S."""
        batch, self._current = self._current, []
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        if batch:
            await self._write(batch, give_up_at=asyncio.get_running_loop().time() + FLUSH_S)

    async def lifecycle(self) -> AsyncIterator[None]:
        task = asyncio.ensure_future(self.run())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self.flush()
