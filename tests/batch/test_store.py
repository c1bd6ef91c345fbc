"""The store's claim rules, driven with explicit clocks: leases keep a request with one runner,
a lapsed lease hands it to another, and a runner that lost its claim cannot write a result.
Every test runs on both stores: SQLite (one file, two connections) and PostgreSQL (a real
server from pgserver, two pools)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.models import RequestCounts
from gateway.batch.rows import BatchRow, NewRequest


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request: pytest.FixtureRequest) -> Callable[[Path], Any]:
    """Opens "the" store: each call is another process's connection to the same database."""
    if request.param == "sqlite":
        return SqliteBatchStore
    dsn = request.getfixturevalue("postgres_db")
    from gateway.accounts.store.postgres_batch import PostgresBatchStore

    return lambda _path: PostgresBatchStore(dsn)


def batch(id_: str, now: float, window: float = 100.0) -> BatchRow:
    return BatchRow(
        id=id_,
        team_id="t",
        kind="openai",
        endpoint="/v1/completions",
        input_file_id="file-x",
        completion_window="24h",
        status="in_progress",
        priority=1,
        metadata=None,
        errors=None,
        total=0,
        output_file_id=None,
        error_file_id=None,
        created_at=now,
        in_progress_at=now,
        expires_at=now + window,
        finalizing_at=None,
        completed_at=None,
        failed_at=None,
        expired_at=None,
        cancelling_at=None,
        cancelled_at=None,
        callback_url=None,
        callback_state=None,
        callback_attempts=0,
        counts=RequestCounts(),
    )


async def test_leases_and_claims(tmp_path: Path, open_store: Any) -> None:
    a = open_store(tmp_path / "db.sqlite3")
    b = open_store(tmp_path / "db.sqlite3")  # a second gateway on the same file
    try:
        reqs = [
            NewRequest(line=i + 1, custom_id=f"c{i}", body={"model": "m", "prompt": "x"})
            for i in range(3)
        ]
        await a.create_batch(batch("batch_1", 0.0), reqs)
        got = await a.claim_requests("A", 2, lease_s=10, now=1.0)
        assert [c.custom_id for c in got] == ["c0", "c1"] and got[0].attempts == 1
        # B sees only what A does not hold.
        got_b = await b.claim_requests("B", 5, lease_s=10, now=2.0)
        assert [c.custom_id for c in got_b] == ["c2"]
        assert await b.claim_requests("B", 5, lease_s=10, now=5.0) == []
        # A renews c0 but not c1; past c1's lease B takes c1 over.
        await a.renew_leases("A", [("batch_1", "c0")], until=30.0)
        taken = await b.claim_requests("B", 5, lease_s=10, now=12.0)
        assert [(c.custom_id, c.attempts) for c in taken] == [("c1", 2)]
        # A, late, cannot write c1; B can, exactly once.
        kw = {
            "status_code": 200,
            "request_id": "r",
            "response": {"x": 1},
            "error": None,
            "now": 13.0,
        }
        assert not await a.finish_request("A", "batch_1", "c1", ok=True, **kw)
        assert await b.finish_request("B", "batch_1", "c1", ok=True, **kw)
        assert not await b.finish_request("B", "batch_1", "c1", ok=True, **kw)
        assert await a.finish_request("A", "batch_1", "c0", ok=True, **kw)
        # Nothing to finalize while c2 is claimed; a restarted B releases it at once.
        assert await a.claim_finalizable("A", 10, now=14.0) == []
        assert await b.release_claims("B") == 1
        again = await a.claim_requests("A", 5, lease_s=10, now=14.0)
        assert [c.custom_id for c in again] == ["c2"]
        assert await a.finish_request("A", "batch_1", "c2", ok=False, **kw)
        assert await b.claim_finalizable("B", 10, now=15.0) == ["batch_1"]
        assert await a.claim_finalizable("A", 10, now=16.0) == []  # B holds the finalization
        row = await a.get_batch(None, "batch_1")
        assert row is not None and row.status == "finalizing"
        assert row.counts == RequestCounts(total=3, completed=2, failed=1)
        assert await a.get_batch("other-team", "batch_1") is None
    finally:
        a.close()
        b.close()


async def test_retry_waits_for_its_backoff_and_expiry_stops_claims(
    tmp_path: Path, open_store: Any
) -> None:
    s = open_store(tmp_path / "db.sqlite3")
    try:
        await s.create_batch(
            batch("batch_1", 0.0, window=50.0), [NewRequest(line=1, custom_id="c", body={})]
        )
        [c] = await s.claim_requests("A", 1, lease_s=10, now=1.0)
        first = c.request_id
        assert await s.retry_request("A", "batch_1", "c", not_before=20.0, error={"code": "x"})
        assert await s.claim_requests("A", 1, lease_s=10, now=19.0) == []
        [c] = await s.claim_requests("A", 1, lease_s=10, now=20.0)
        assert c.attempts == 2
        # the retry runs under the line's id: its usage record replaces the failed run's
        assert first and c.request_id == first
        # A deferred request never ran: its attempt is given back.
        assert await s.retry_request(
            "A", "batch_1", "c", not_before=20.5, error={"code": "deferred"}, spent=False
        )
        [c] = await s.claim_requests("A", 1, lease_s=10, now=20.5)
        assert c.attempts == 2
        assert await s.retry_request("A", "batch_1", "c", not_before=21.0, error={"code": "x"})
        # Past the window nothing is claimed, and the batch is ready to end (expired).
        assert await s.claim_requests("A", 1, lease_s=10, now=60.0) == []
        assert await s.claim_finalizable("A", 10, now=60.0) == ["batch_1"]
        assert (await s.get_batch(None, "batch_1")).status == "in_progress"  # type: ignore[union-attr]
    finally:
        s.close()
