"""A usage record the store refuses is retried until written, never dropped:
a request that finished while the database was unavailable is billed once it is
back. Before, the one failed write raised out of the request and its record was lost: the
booking was later billed as 'expired' at its prompt, never for the answer the tenant got.

Real parts: a `duet gateway` process on SQLite, the official openai client, and a second
SQLite connection in the test that holds the database's write lock — what a stuck writer, a
backup or a full disk does to the gateway — for longer than the gateway's busy timeout (30 s).
The provider is the local fake, which holds the stream until the lock is taken.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path

import openai
import pytest

from tests.gateway.helpers import gateway_proc, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running
from tests.providers.fakes import API_KEY, Fault
from tests.wait import wait_for

#: the gateway's SQLite busy timeout is 30 s: its first write fails after that
FIRST_FAILURE_WITHIN_S = 120.0


def _usage(db: Path) -> list[tuple[object, ...]]:
    # WAL: a reader is never blocked by the write lock
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute(
            "SELECT status, completion_tokens FROM usage WHERE team_id = 'billed'"
        ).fetchall()


def test_a_usage_record_the_store_refused_is_written_once_it_is_back(
    fake: FakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    gw = gateway_proc(tmp_path, {"gpt": external(fake.fakes["gpt"], {"in": 10.0, "out": 20.0}, 2)})
    db = tmp_path / "gateway.db"
    gpt = fake.fakes["gpt"]
    with running(gw):
        key = make_team(gw.url, "billed")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120)
        # two events, then silence until released
        fake.loop.call_soon_threadsafe(gpt.faults.append, Fault.stall_after(2))
        seen = len(gpt.requests)
        text: list[str] = []

        def answer() -> None:
            try:
                stream = client.chat.completions.create(
                    model="gpt",
                    stream=True,
                    max_tokens=16,
                    messages=[{"role": "user", "content": "one two three"}],
                )
                text.extend(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            except openai.APIError as e:  # what the old gateway's failed write became
                text.append(f"<{type(e).__name__}: {e}>")

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        lock = sqlite3.connect(db, isolation_level=None, timeout=30)
        try:
            wait_for(lambda: len(gpt.requests) > seen, 30, "the provider to hold the request")
            # the write lock: every write of the gateway waits for it, then fails
            lock.execute("BEGIN IMMEDIATE")
            # the answer ends now; its record cannot be written
            fake.loop.call_soon_threadsafe(gpt.released.set)
            # The gateway waits out its busy timeout, fails the write, waits (bounded) for the
            # retries, and answers: the client's answer ends while the lock is still held.
            wait_for(lambda: not t.is_alive(), FIRST_FAILURE_WITHIN_S, "the answer to end")
            assert "writing a usage record failed; the writer retries it" in gw.log()
            assert _usage(db) == []
        finally:
            lock.close()  # rolls back: the lock is gone
        # The store is back: the record the gateway kept is written, once.
        wait_for(lambda: _usage(db), 60, "the usage record to be written")
        assert _usage(db) == [("ok", 4)]
    assert "".join(text) == "echo: one two three"
