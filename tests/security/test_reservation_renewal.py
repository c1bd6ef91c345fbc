"""A request that outlives `[quotas] reservation_ttl_s` still counts: its
gateway's heartbeat renews the reservation while the request runs. Before, the booking lapsed
at the TTL while the request was still streaming: the sweeper expired it (billing its prompt as
'expired'), the team's concurrency slot came free under a running request, and its spend no
longer counted against the budget.

Real parts: a `duet gateway` process on SQLite, the official openai client; the provider is
the local fake, which holds the stream open until the test lets it go.
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

TTL_S = 1.5
HEARTBEAT_S = 0.5  # the shortest heartbeat the TTL allows (3 beats)


def _query(db: Path, sql: str, *args: object) -> list[tuple[object, ...]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute(sql, args).fetchall()


def _booking(db: Path, team: str) -> tuple[float, float] | None:
    """(created_at, expires_at) of the team's reservation, None when it has none."""
    rows = _query(db, "SELECT created_at, expires_at FROM reservations WHERE team_id = ?", team)
    return None if not rows else (float(rows[0][0]), float(rows[0][1]))  # type: ignore[arg-type]


def test_a_request_outliving_the_reservation_ttl_still_counts(
    fake: FakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    gw = gateway_proc(
        tmp_path,
        {"gpt": external(fake.fakes["gpt"], {"in": 10.0, "out": 20.0}, 2)},
        quotas={"reservation_ttl_s": TTL_S, "heartbeat_s": HEARTBEAT_S},
    )
    db = tmp_path / "gateway.db"
    gpt = fake.fakes["gpt"]
    with running(gw):
        key = make_team(gw.url, "long", max_concurrent=1)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
        # two events, then silence until the test releases it
        fake.loop.call_soon_threadsafe(gpt.faults.append, Fault.stall_after(2))
        text: list[str] = []

        def long_stream() -> None:
            stream = client.chat.completions.create(
                model="gpt",
                stream=True,
                max_tokens=16,
                messages=[{"role": "user", "content": "one two three"}],
            )
            text.extend(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

        t = threading.Thread(target=long_stream, daemon=True)
        t.start()
        try:
            first = wait_for(lambda: _booking(db, "long"), 30, "the request's reservation")
            # The heartbeat carries the booking well past its first TTL while the stream is held.
            # (Without renewal it lapses at created_at + TTL and the sweeper deletes it.)
            wait_for(
                lambda: (b := _booking(db, "long")) is not None and b[1] > first[0] + 3 * TTL_S,
                30,
                "the reservation to be renewed past three TTLs",
            )
            # It still counts: the team's one slot is taken, and nothing was billed as expired.
            with pytest.raises(openai.RateLimitError) as e:
                client.chat.completions.create(
                    model="gpt", max_tokens=4, messages=[{"role": "user", "content": "again"}]
                )
            assert e.value.body["param"] == "concurrency", e.value.body
            assert _query(db, "SELECT status FROM usage WHERE team_id = 'long'") == []
        finally:
            fake.loop.call_soon_threadsafe(gpt.released.set)
            t.join(30)
    assert "".join(text) == "echo: one two three"
    rows = _query(db, "SELECT status, completion_tokens FROM usage WHERE team_id = 'long'")
    assert rows == [("ok", 4)], rows  # billed once, for what it streamed
    assert _query(db, "SELECT count(*) FROM reservations") == [(0,)]
