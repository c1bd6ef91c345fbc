"""A gateway frozen (SIGSTOP) long enough to look dead, then resumed: each of its requests is
billed once.

The other gateway on the store rightly takes the frozen one for dead and bills its bookings
`expired` (a killed gateway must not give requests away). Before, the frozen gateway, once
resumed, finished those requests and billed each again in full beside its `expired` record
(the chaos run's "billed twice": 15 requests). Now the settlement of a booking that is gone
replaces its `expired` record (and that record's spend) by the real one.

Real parts: two `duet gateway` processes on one SQLite store, the official openai client, the
local fake provider holding the streams until the test lets them go; SIGSTOP and SIGCONT.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.helpers import gateway_proc, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running
from tests.providers.fakes import API_KEY, Fault
from tests.wait import wait_for

#: a gateway silent for 2.5 heartbeats (2.5 s) is dead
HEARTBEAT_S = 1.0
STREAMS = 3


def _query(db: Path, sql: str, *args: object) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute(sql, args).fetchall()


def test_a_frozen_gateways_requests_are_billed_once_when_it_resumes(
    fake: FakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    models = {"gpt": external(fake.fakes["gpt"], {"in": 10.0, "out": 20.0}, 2)}
    quotas = {"heartbeat_s": HEARTBEAT_S}
    frozen, other = (
        gateway_proc(tmp_path, models, quotas=quotas),
        gateway_proc(tmp_path, models, quotas=quotas),
    )
    db, gpt = tmp_path / "gateway.db", fake.fakes["gpt"]
    with running(frozen), running(other):
        key = make_team(frozen.url, "t")
        client = openai.OpenAI(base_url=frozen.url + "/v1", api_key=key, max_retries=0, timeout=120)
        for _ in range(STREAMS):  # each stream sends two events, then holds until released
            fake.loop.call_soon_threadsafe(gpt.faults.append, Fault.stall_after(2))

        def stream() -> str:
            s = client.chat.completions.create(
                model="gpt",
                stream=True,
                max_tokens=8,
                messages=[{"role": "user", "content": "hold on " * 50}],
            )
            return "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)

        with ThreadPoolExecutor(STREAMS) as pool:
            streams = [pool.submit(stream) for _ in range(STREAMS)]
            stopped = False
            try:
                wait_for(
                    lambda: (
                        _query(db, "SELECT count(*) FROM reservations") == [(STREAMS,)]
                        and not gpt.faults
                    ),
                    30,
                    "every stream booked and held by the provider",
                )
                os.kill(frozen.proc.pid, signal.SIGSTOP)
                stopped = True
                # the other gateway takes the frozen one for dead and bills its bookings
                wait_for(
                    lambda: (
                        _query(db, "SELECT count(*) FROM usage WHERE status = 'expired'")
                        == [(STREAMS,)]
                    ),
                    30,
                    "the frozen gateway's bookings reclaimed",
                )
            finally:
                if stopped:
                    os.kill(frozen.proc.pid, signal.SIGCONT)
                fake.loop.call_soon_threadsafe(gpt.released.set)
            texts = [f.result(timeout=60) for f in streams]
        records = _query(db, "SELECT request_id, status, completion_tokens, cost_usd FROM usage")
        spend = _query(db, "SELECT cost_usd FROM spend WHERE team_id = 't' AND period LIKE 'd:%'")
    assert texts == ["echo: hold on hold on hold on hold"] * STREAMS
    # one record per request, the real one (before: an `expired` one beside each)
    assert sorted(Counter(r[0] for r in records).values()) == [1] * STREAMS, records
    assert [(r[1], r[2]) for r in records] == [("ok", 8)] * STREAMS, records
    # and the team's spend is what those records bill, once
    assert spend[0][0] == pytest.approx(sum(r[3] for r in records)), (spend, records)
