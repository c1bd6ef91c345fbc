"""The gateway's store stalls for 20 s under load, then resumes: every request is billed exactly
once, no team is locked out, and each team's `max_concurrent` and budget hold.

Before, the heartbeat that waited out the stall landed with the time it was called at, 20 s
stale, and the reclaim that followed took the gateway's own bookings for a dead gateway's: every
in-flight stream was billed `expired`, its team's slots freed under it (a third request
admitted under `max_concurrent=2`), and when the streams finished each was billed again beside
its `expired` record — enough, here, to push each team over a budget its real spend fits in.

The stall: the issue asks to SIGSTOP the store worker, but it is a thread, and SIGSTOP stops a
whole process. What stalls it here is what stalls it in production: another connection holds
the SQLite file's write lock for 20 s (a long transaction of another process — a backup, a
migration, another gateway's big write), so the worker thread, and every call queued behind it,
waits inside SQLite for 20 s. The gateway runs its default heartbeat (5 s: a gateway silent for
12.5 s is dead).

Real parts: a `duet gateway` process on SQLite, the official openai client, the local fake
provider (which holds the streams open until the test lets them go).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.helpers import gateway_proc, http, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running
from tests.providers.fakes import API_KEY, Fault
from tests.wait import wait_for

STALL_S = 20.0
TEAMS = ("a", "b", "c")
STREAMS_PER_TEAM = 2
#: a long prompt: an `expired` record bills it, far more than a follow-up request books
PROMPT = " ".join(f"word{i}" for i in range(300))


def _query(db: Path, sql: str, *args: object) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute(sql, args).fetchall()


def _hold_write_lock(db: Path, seconds: float, held: threading.Event, freed: list[float]) -> None:
    conn = sqlite3.connect(db, isolation_level=None, timeout=30)
    try:
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        time.sleep(seconds)  # the stall itself: what the test is about
        conn.execute("COMMIT")
        freed.append(time.time())
    finally:
        conn.close()


def _chat(client: openai.OpenAI, content: str, max_tokens: int) -> str:
    try:
        client.chat.completions.create(
            model="gpt", max_tokens=max_tokens, messages=[{"role": "user", "content": content}]
        )
        return "ok"
    except openai.RateLimitError as e:
        return f"429 {e.body['param']}"  # type: ignore[index]


def test_a_20s_store_stall_under_load_bills_each_request_once(
    fake: FakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    models = {"gpt": external(fake.fakes["gpt"], {"in": 10.0, "out": 20.0}, 2)}
    # two gateways on one store, as `duet up --gateways 2` runs them: the streams go through the
    # first, and the second's requests are bounded by the store's counts alone (a gateway's own
    # team gate sees only its own requests)
    gw, gw2 = gateway_proc(tmp_path, models), gateway_proc(tmp_path, models)
    db, gpt = tmp_path / "gateway.db", fake.fakes["gpt"]
    n_streams = len(TEAMS) * STREAMS_PER_TEAM
    with running(gw), running(gw2):
        keys = {t: make_team(gw.url, t, max_concurrent=STREAMS_PER_TEAM) for t in TEAMS}
        keys["steady"] = make_team(gw.url, "steady")
        clients = {
            t: openai.OpenAI(base_url=gw.url + "/v1", api_key=k, max_retries=0, timeout=120)
            for t, k in keys.items()
        }
        second = {
            t: openai.OpenAI(base_url=gw2.url + "/v1", api_key=k, max_retries=0, timeout=120)
            for t, k in keys.items()
        }
        for _ in range(n_streams):  # each stream sends two events, then holds until released
            fake.loop.call_soon_threadsafe(gpt.faults.append, Fault.stall_after(2))
        texts: dict[str, str] = {}

        def stream(team: str, i: int) -> None:
            s = clients[team].chat.completions.create(
                model="gpt",
                stream=True,
                max_tokens=8,
                messages=[{"role": "user", "content": PROMPT}],
            )
            texts[f"{team}{i}"] = "".join(
                ch.choices[0].delta.content or "" for ch in s if ch.choices
            )

        pool = ThreadPoolExecutor(n_streams + 8)
        streams = [pool.submit(stream, t, i) for t in TEAMS for i in range(STREAMS_PER_TEAM)]
        try:
            wait_for(
                lambda: (
                    _query(db, "SELECT count(*) FROM reservations") == [(n_streams,)]
                    and not gpt.faults
                ),
                30,
                "every stream booked and held by the provider",
            )
            held, freed = threading.Event(), []
            locker = threading.Thread(target=_hold_write_lock, args=(db, STALL_S, held, freed))
            locker.start()
            assert held.wait(30)
            # load during the stall: another team's requests wait for the store, then run
            steady = [
                pool.submit(_chat, (clients, second)[i % 2]["steady"], "steady load", 4)
                for i in range(4)
            ]
            locker.join()
            # both gateways' first heartbeats after the stall (and, before, the reclaims that
            # followed them)
            wait_for(
                lambda: (
                    _query(db, "SELECT count(*) FROM gateways WHERE heartbeat_at >= ?", freed[0])
                    == [(2,)]
                ),
                30,
                "both gateways' heartbeats after the stall",
            )
            # the streams still run: each team's two slots are still taken, on every gateway
            third = [_chat(c[t], "one more", 4) for t in TEAMS for c in (clients, second)]
        finally:
            fake.loop.call_soon_threadsafe(gpt.released.set)
            for f in streams:
                f.result(timeout=60)
        steady_out = [f.result(timeout=60) for f in steady]
        pool.shutdown()
        records = _query(db, "SELECT request_id, team_id, status, cost_usd FROM usage")
        per_request = Counter(r[0] for r in records)
        real_spend = {
            t: sum(r[3] for r in records if r[1] == t and r[2] != "expired") for t in TEAMS
        }
        day = time.strftime("d:%Y-%m-%d", time.gmtime())
        spend = dict(_query(db, "SELECT team_id, cost_usd FROM spend WHERE period = ?", day))
        # a budget the team's real spend fits in with room for one small request, and not for
        # its streams' prompts billed a second time
        for t in TEAMS:
            status, _, body = http(
                f"{gw.url}/admin/teams/{t}",
                "PUT",
                {"max_concurrent": STREAMS_PER_TEAM, "daily_budget_usd": real_spend[t] + 0.002},
            )
            assert status == 200, body
        follow_up = [_chat(clients[t], "after", 1) for t in TEAMS]
    summary = {
        "requests refused while the streams ran": third,
        "steady load": steady_out,
        "streams answered": sorted(texts.values()),
        "records per request": sorted(Counter(per_request.values()).items()),
        "statuses": sorted({r[2] for r in records}),
        "spend equals the records": all(spend[t] == pytest.approx(real_spend[t]) for t in TEAMS),
        "follow-up requests": follow_up,
    }
    n_records = n_streams + len(steady_out)  # (before the follow-ups)
    assert summary == {
        "requests refused while the streams ran": ["429 concurrency"] * 2 * len(TEAMS),
        "steady load": ["ok"] * 4,
        "streams answered": [" ".join(f"echo: {PROMPT}".split()[:8])] * n_streams,
        "records per request": [(1, n_records)],
        "statuses": ["ok"],
        "spend equals the records": True,
        "follow-up requests": ["ok"] * len(TEAMS),
    }, summary
    assert _query(db, "SELECT count(*) FROM reservations") == [(0,)]
