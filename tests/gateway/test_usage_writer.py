"""A usage batch the store refuses is retried, never dropped: the writer keeps the
batch and retries it with a backoff until the store takes it, a request waits for its record
(bounded), and a stop flushes what is still held. The store is the real SQLite store; only
its first settles are made to fail, as a database that is briefly gone would."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from gateway.accounts import usage_writer
from gateway.accounts.store.base import Settlement, StoreError, Team, UsageRecord
from gateway.accounts.store.sqlite import SqliteStore
from gateway.accounts.usage_writer import UsageWriter
from gateway.metrics import GatewayMetrics
from tests.wait import until


class FlakyStore(SqliteStore):
    """SQLite, refusing its first `failures` settles (and never settling on the loop's fast
    path)."""

    def __init__(self, path: Path, failures: int) -> None:
        super().__init__(path)
        self.failures = failures
        self.calls = 0

    def settle_now(self, batch: list[Settlement]) -> bool:
        return False

    async def settle(self, batch: list[Settlement]) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise StoreError(503, "the database is gone for a moment")
        await super().settle(batch)


def _settlement(i: int) -> Settlement:
    return Settlement(
        None,
        UsageRecord(
            request_id=f"r{i}",
            team_id="t",
            key_id="k",
            model_requested="m",
            model_used="m",
            tier="interactive",
            status="ok",
            prompt_tokens=3,
        ),
    )


async def _records(store: SqliteStore) -> list[str]:
    return sorted(r.request_id for r in await store.usage_records("t", 0, 1e12))


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usage_writer, "RETRY_S", 0.01, raising=False)
    monkeypatch.setattr(usage_writer, "MAX_RETRY_S", 0.02, raising=False)


async def test_a_refused_batch_is_retried_until_written(tmp_path: Path) -> None:
    store = FlakyStore(tmp_path / "g.db", failures=3)
    await store.open()
    await store.create_team(Team(id="t"))
    writer = UsageWriter(store, GatewayMetrics())
    life = writer.lifecycle()
    await life.__anext__()
    await asyncio.wait_for(asyncio.gather(*(writer.commit(_settlement(i)) for i in range(5))), 30)
    assert await _records(store) == [f"r{i}" for i in range(5)] and store.calls >= 4
    with pytest.raises(StopAsyncIteration):
        await life.__anext__()
    await store.close()


async def test_a_stop_flushes_the_batch_being_retried(tmp_path: Path) -> None:
    store = FlakyStore(tmp_path / "g.db", failures=10)
    await store.open()
    await store.create_team(Team(id="t"))
    writer = UsageWriter(store, GatewayMetrics())
    life = writer.lifecycle()
    await life.__anext__()
    writer.submit(_settlement(0))  # a client that left: nobody awaits it
    await until(lambda: store.calls >= 3, 10, "the writer to retry the refused batch")
    store.failures = 0  # the database is back as the gateway stops
    with pytest.raises(StopAsyncIteration):
        await life.__anext__()
    assert await _records(store) == ["r0"]
    await store.close()


async def test_what_the_store_still_refuses_at_shutdown_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(usage_writer, "FLUSH_S", 0.1, raising=False)
    store = FlakyStore(tmp_path / "g.db", failures=10_000)
    await store.open()
    writer = UsageWriter(store, GatewayMetrics())
    writer.submit(_settlement(7))
    with caplog.at_level(logging.ERROR, logger="duet.gateway.usage"):
        await writer.flush()
    assert any("NOT written" in r.getMessage() and "r7" in r.getMessage() for r in caplog.records)
    await store.close()
