"""A batch line is billed exactly once, however often a crash makes it run.

The fault: the runner ran a line (its usage record committed in the gateway store), then its
gateway died before the line's result reached the batch store. The claim lapsed, the line ran
again under a new request id, and the team paid twice for one output line. Now the line's
request id is written with its claim and kept until an outcome is recorded, and the usage
record of a batch line is keyed by it: the store keeps one record per key (the later settled
run replaces the earlier one, whose spend is taken back; a dead run's expired booking never
replaces one).

Real parts: both gateway stores (SQLite, and PostgreSQL from pgserver) driven directly; and a
`duet gateway` process SIGKILLed exactly between the two writes (the batch store held locked
by the test while the line settles), then restarted, with the official openai client; the
model is the local fake provider, which answers when the test lets it.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.accounts.store import open_store
from gateway.accounts.store.base import (
    Booked,
    Reservation,
    ReserveRequest,
    Settlement,
    Store,
    Team,
    UsageKey,
    UsageRecord,
)
from tests.batch.conftest import jsonl
from tests.gateway.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.gateway.helpers import gateway_proc, http, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running
from tests.providers.fakes import API_KEY
from tests.wait import wait_for

DAY = 86400.0


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return (
        f"sqlite://{tmp_path / 'gw.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_db")
    )


@pytest.fixture
async def store(store_url: str) -> Any:
    s = open_store(store_url)
    await s.open()
    await s.create_team(Team(id="t", daily_budget_usd=1.0))
    try:
        yield s
    finally:
        await s.close()


def _record(rid: str, cost: float, status: str = "ok") -> UsageRecord:
    return UsageRecord(
        request_id=rid,
        team_id="t",
        key_id="batch",
        model_requested="m",
        model_used="m",
        tier="batch",
        status=status,
        prompt_tokens=10,
        completion_tokens=5,
        cost_usd=cost,
    )


async def _book(s: Store, rid: str, gateway: str = "gw-a") -> str:
    booked = Booked(
        model="m",
        tier="batch",
        endpoint="chat",
        prompt_tokens=10,
        prompt_cost_usd=0.1,
        idempotent=True,
    )
    res = await s.reserve(
        ReserveRequest(
            team_id="t",
            key_id="batch",
            request_id=rid,
            tokens=15,
            cost_usd=0.2,
            ttl_s=60,
            gateway_id=gateway,
            booked=booked,
        )
    )
    assert isinstance(res, Reservation), res
    return res.id


async def _billed(s: Store) -> list[tuple[str, str, float]]:
    now = time.time()
    return [
        (r.request_id, r.status, r.cost_usd)
        for r in await s.usage_records("t", now - DAY, now + DAY)
    ]


async def _room(s: Store, cost: float) -> bool:
    """Whether the team's $1 day still has room for `cost` (its spend, as reservations see it)."""
    res = await s.reserve(
        ReserveRequest(
            team_id="t", key_id="k", request_id="probe", tokens=1, cost_usd=cost, ttl_s=60
        )
    )
    if isinstance(res, Reservation):
        await s.settle([Settlement(res.id, _record("probe", 0.0), window_tokens=0)])
        return True
    return False


async def test_a_rerun_replaces_the_first_runs_record(store: Store) -> None:
    first = await _book(store, "batch-line-1")
    await store.settle([Settlement(first, _record("batch-line-1", 0.5), key=UsageKey.RERUN)])
    # the gateway died before the result was recorded; the line runs again under its key
    again = await _book(store, "batch-line-1")
    await store.settle([Settlement(again, _record("batch-line-1", 0.6), key=UsageKey.RERUN)])
    assert await _billed(store) == [("batch-line-1", "ok", 0.6)]
    assert await _room(store, 0.35)  # spent 0.6, not 1.1
    assert not await _room(store, 0.45)
    # Requests without a key are not touched by it.
    await store.settle(
        [Settlement(None, _record("req-x", 0.01)), Settlement(None, _record("req-x", 0.01))]
    )
    assert [b for b in await _billed(store) if b[0] == "req-x"] == [("req-x", "ok", 0.01)] * 2


async def test_a_dead_runs_booking_is_billed_until_the_rerun_settles(store: Store) -> None:
    await _book(store, "batch-line-2", gateway="gw-dead")
    await store.heartbeat("gw-dead", 60, now=time.time() - 100)
    assert (
        await store.reclaim(dead_after_s=10) == 1
    )  # its prompt is billed: the run may have computed it
    assert await _billed(store) == [("batch-line-2", "expired", 0.1)]
    rerun = await _book(store, "batch-line-2")
    await store.settle([Settlement(rerun, _record("batch-line-2", 0.3), key=UsageKey.RERUN)])
    assert await _billed(store) == [("batch-line-2", "ok", 0.3)]
    assert await _room(store, 0.65) and not await _room(store, 0.75)


async def test_an_expired_booking_never_replaces_the_reruns_record(store: Store) -> None:
    await _book(store, "batch-line-3", gateway="gw-dead")  # the dead run, not yet reclaimed
    rerun = await _book(store, "batch-line-3")
    await store.settle([Settlement(rerun, _record("batch-line-3", 0.3), key=UsageKey.RERUN)])
    await store.heartbeat("gw-dead", 60, now=time.time() - 100)
    assert await store.reclaim(dead_after_s=10) == 1
    assert await _billed(store) == [("batch-line-3", "ok", 0.3)]
    assert await _room(store, 0.65) and not await _room(store, 0.75)


async def test_runs_settled_together_or_at_once_leave_one_record(
    store: Store, store_url: str
) -> None:
    # both runs in one usage batch (one transaction)
    await store.settle(
        [
            Settlement(None, _record("batch-line-4", 0.2), key=UsageKey.RERUN),
            Settlement(None, _record("batch-line-4", 0.3), key=UsageKey.RERUN),
        ]
    )
    assert await _billed(store) == [("batch-line-4", "ok", 0.3)]
    # two gateways settling the same key at once
    other = open_store(store_url)
    await other.open()
    try:
        await asyncio.gather(
            *(
                s.settle([Settlement(None, _record("batch-line-5", 0.1), key=UsageKey.RERUN)])
                for s in (store, other, store, other)
            )
        )
    finally:
        await other.close()
    assert [b for b in await _billed(store) if b[0] == "batch-line-5"] == [
        ("batch-line-5", "ok", 0.1)
    ]
    assert await _room(store, 0.55) and not await _room(store, 0.65)  # spent 0.3 + 0.1


# -- the crash, with real processes -----------------------------------------------------------
class Gate:
    """The fake provider's answer waits until the test opens the gate (it blocks the fake's own
    loop, which serves only this test)."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def reply(self, body: dict[str, Any]) -> str:
        assert self.open.wait(120), "the test never opened the gate"
        return "billed once please"


@pytest.fixture
def fake() -> Iterator[tuple[FakeServers, Gate]]:
    servers = FakeServers({"gpt": "openai"})
    gate = Gate()
    servers.fakes["gpt"].reply = gate.reply
    try:
        yield servers, gate
    finally:
        gate.open.set()
        servers.close()


class BatchLock:
    """The test holds the batch store's write lock: the runner's write of the line's result
    waits on it, while the gateway store (another file, or other tables) takes the usage."""

    def __init__(self, store_url: str, batch_db: Path) -> None:
        self.pg = store_url.startswith("postgresql")
        self.store_url, self.batch_db = store_url, batch_db
        self._loop = asyncio.new_event_loop()
        self._con: Any = None

    def take(self) -> None:
        if self.pg:
            import asyncpg

            async def lock() -> Any:
                con = await asyncpg.connect(self.store_url)
                await con.execute("BEGIN; LOCK TABLE batch_requests IN EXCLUSIVE MODE")
                return con

            self._con = self._loop.run_until_complete(lock())
        else:
            self._con = sqlite3.connect(self.batch_db, isolation_level=None)
            self._con.execute("BEGIN IMMEDIATE")

    def release_after_death(self) -> None:
        """The killed gateway's sessions end (PostgreSQL drops a dead client's at its next
        read; here at once, so its blocked write never commits), then the lock goes."""
        if self.pg:

            async def release() -> None:
                await self._con.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                    "datname = current_database() AND pid <> pg_backend_pid()"
                )
                await self._con.execute("ROLLBACK")
                await self._con.close()

            self._loop.run_until_complete(release())
        else:
            self._con.execute("ROLLBACK")
            self._con.close()
        self._loop.close()


def _usage(url: str, key: str) -> list[dict[str, Any]]:
    status, _, body = http(f"{url}/v1/usage?group_by=record", key=key)
    assert status == 200, body
    return body["data"]


def _line_state(lock: BatchLock, batch_id: str) -> str:
    if lock.pg:
        import asyncpg

        async def q() -> str:
            con = await asyncpg.connect(lock.store_url)
            try:
                return await con.fetchval(
                    "SELECT state FROM batch_requests WHERE batch_id=$1", batch_id
                )
            finally:
                await con.close()

        return asyncio.run(q())
    with sqlite3.connect(f"file:{lock.batch_db}?mode=ro", uri=True) as conn:
        return conn.execute(
            "SELECT state FROM batch_requests WHERE batch_id=?", (batch_id,)
        ).fetchone()[0]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_gateway_killed_between_billing_and_result_bills_once(
    fake: tuple[FakeServers, Gate],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    backend: str,
) -> None:
    servers, gate = fake
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    store_url = (
        request.getfixturevalue("postgres_db")
        if backend == "postgres"
        else f"sqlite://{tmp_path}/gateway.db"
    )
    models = {"gpt": external(servers.fakes["gpt"], {"in": 10.0, "out": 20.0}, 2)}
    batch = {
        "data_dir": str(tmp_path / "batch"),
        "concurrency": 1,
        "lease_s": 3.0,
        "poll_s": 0.05,
        "discount": 0.5,
    }
    first = gateway_proc(tmp_path, models, store=store_url, batch=batch)
    lock = BatchLock(store_url, tmp_path / "batch" / "batch.sqlite3")
    line = {
        "custom_id": "only",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt",
            "messages": [{"role": "user", "content": "bill me once"}],
            "max_tokens": 8,
        },
    }
    with running(first):
        key = make_team(first.url, "once")
        c = openai.OpenAI(base_url=first.url + "/v1", api_key=key, max_retries=0, timeout=60)
        f = c.files.create(file=("in.jsonl", jsonl([line])), purpose="batch")
        b = c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        gpt = servers.fakes["gpt"]
        wait_for(lambda: len(gpt.requests) == 1, 60, "the line to reach the provider")
        lock.take()
        try:
            gate.open.set()  # the line is answered and billed; its result waits for the lock
            wait_for(lambda: len(_usage(first.url, key)) == 1, 60, "the line's usage record")
            first.kill()  # SIGKILL between the usage record and the line's result
        finally:
            lock.release_after_death()
    assert _line_state(lock, b.id) == "running", (
        "the result must not have been written for this test to mean anything"
    )
    second = gateway_proc(
        tmp_path, models, port=first.port, store=store_url, batch=batch
    )  # same worker id
    with running(second):
        c = openai.OpenAI(base_url=second.url + "/v1", api_key=key, max_retries=0, timeout=60)
        wait_for(
            lambda: c.batches.retrieve(b.id).status == "completed", 120, "the batch to complete"
        )
        done = c.batches.retrieve(b.id)
        out = [x for x in c.files.content(done.output_file_id).text.splitlines() if x.strip()]
        records = _usage(second.url, key)
    assert len(gpt.requests) == 2  # it really ran twice
    assert len(out) == 1 and done.request_counts.completed == 1
    # Old code: two records (two request ids), the team paid twice for one output line.
    assert [(r["status"], r["tier"]) for r in records] == [("ok", "batch")], records
    assert json.loads(out[0])["response"]["request_id"] == records[0]["request_id"]
    r = records[0]
    assert r["completion_tokens"] == 3 and r["cost_usd"] == pytest.approx(
        (r["prompt_tokens"] * 10.0 + 3 * 20.0) / 1e6 * 0.5
    ), r  # at the batch discount
