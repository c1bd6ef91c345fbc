"""A gateway's death does not lock a team out, nor give it a free request.

The attack (or the accident): a team with `max_concurrent = 1` has a request in flight when its
gateway is SIGKILLed. The reservation stayed in the store, unsettled, for the 900 s TTL: the team
got 429 for a quarter of an hour, and the killed request (whose prompt a provider was already
computing) was never billed. Now every gateway beats in the store; a restarted gateway reclaims
the dead instance's reservations once it has been silent for 2.5 heartbeats, billing each
booked prompt with an `expired` usage record — and, for a stream, the completion tokens it had
sent as of the dead gateway's last heartbeat (each heartbeat reports them).

Real parts: two gateway processes in turn on one SQLite store, SIGKILL, the official openai
client; the provider is the local fake (it holds the request until the test ends).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.gateway.helpers import gateway_proc, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import Proc, running
from tests.providers.fakes import API_KEY, Fault
from tests.wait import wait_for

HEARTBEAT_S = 1.0


def kill_while_holding(fake: FakeServers, gw: Proc, content: str) -> tuple[str, threading.Thread]:
    """Start `gw`, give team `solo` (max_concurrent 1) a request the fake provider holds, and
    SIGKILL the gateway under it: the team's key and the client's thread."""
    with running(gw):
        key = make_team(gw.url, "solo", max_concurrent=1)
        gpt = fake.fakes["gpt"]
        fake.loop.call_soon_threadsafe(gpt.faults.append, Fault.hang())
        seen = len(gpt.requests)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)

        def in_flight() -> None:
            with contextlib.suppress(openai.APIError):  # its gateway is killed under it
                client.chat.completions.create(
                    model="gpt", messages=[{"role": "user", "content": content}], max_tokens=8
                )

        t = threading.Thread(target=in_flight, daemon=True)
        t.start()
        wait_for(lambda: len(gpt.requests) > seen, 30, "the provider to hold the request")
        gw.proc.kill()
        gw.proc.wait(10)
    return key, t


def test_a_killed_gateways_reservation_is_reclaimed_and_billed(
    fake: FakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    models = {"gpt": external(fake.fakes["gpt"], {"in": 10.0, "out": 20.0}, 2)}
    quotas = {"heartbeat_s": HEARTBEAT_S}
    key, t = kill_while_holding(
        fake, gateway_proc(tmp_path, models, quotas=quotas), "hold on " * 50
    )
    killed_at = time.monotonic()
    second = gateway_proc(tmp_path, models, quotas=quotas)
    with running(second):
        client = openai.OpenAI(base_url=second.url + "/v1", api_key=key, max_retries=0, timeout=60)

        def sends() -> bool:
            try:
                client.chat.completions.create(
                    model="gpt", messages=[{"role": "user", "content": "again"}], max_tokens=4
                )
                return True
            except openai.RateLimitError as e:
                assert (
                    e.body["code"] == "rate_limit_exceeded" and e.body["param"] == "concurrency"
                ), e.body
                return False

        wait_for(sends, 60, "the team to send again after its gateway's death")
        back_after = time.monotonic() - killed_at
    t.join(10)
    with sqlite3.connect(tmp_path / "gateway.db") as conn:
        rows = conn.execute(
            "SELECT status, prompt_tokens, cost_usd FROM usage WHERE team_id = 'solo' "
            "ORDER BY created_at"
        ).fetchall()
    statuses = [r[0] for r in rows]
    assert statuses == ["expired", "ok"], rows
    assert rows[0][1] > 0 and rows[0][2] == pytest.approx(rows[0][1] * 10.0 / 1e6), rows[0]
    # reclaimed within the second gateway's start plus 2.5 silent heartbeats (and a sweep),
    # not 900 s
    assert back_after < 60, back_after


def test_a_killed_gateways_stream_bills_what_it_had_sent(
    fake: FakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The killed request is a stream that has already delivered tokens to its client: the
    `expired` record bills them (as of the dead gateway's last heartbeat) besides the prompt."""
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    models = {"gpt": external(fake.fakes["gpt"], {"in": 10.0, "out": 20.0}, 2)}
    quotas = {"heartbeat_s": HEARTBEAT_S}
    db = tmp_path / "gateway.db"
    streamed = 5
    first = gateway_proc(tmp_path, models, quotas=quotas)
    with running(first):
        key = make_team(first.url, "solo", max_concurrent=1)
        gpt = fake.fakes["gpt"]
        # the role event, then `streamed` words (one token each), then silence until the test ends
        fake.loop.call_soon_threadsafe(gpt.faults.append, Fault.stall_after(1 + streamed))
        client = openai.OpenAI(base_url=first.url + "/v1", api_key=key, max_retries=0, timeout=60)
        received: list[str] = []

        def in_flight() -> None:
            with contextlib.suppress(openai.APIError):  # its gateway is killed under it
                for chunk in client.chat.completions.create(
                    model="gpt",
                    messages=[
                        {"role": "user", "content": "one two three four five six seven eight"}
                    ],
                    max_tokens=32,
                    stream=True,
                ):
                    if chunk.choices and chunk.choices[0].delta.content:
                        received.append(chunk.choices[0].delta.content)

        t = threading.Thread(target=in_flight, daemon=True)
        t.start()
        wait_for(
            lambda: len(received) >= streamed, 30, f"the client to read {streamed} streamed tokens"
        )

        def reported() -> int:  # the gateway's heartbeat told the store what the stream sent
            with contextlib.closing(sqlite3.connect(db)) as conn:
                row = conn.execute(
                    "SELECT max(streamed_tokens) FROM reservations WHERE team_id = 'solo'"
                ).fetchone()
            return row[0] or 0

        wait_for(lambda: reported() >= streamed, 30, "a heartbeat to report the streamed tokens")
        first.proc.kill()
        first.proc.wait(10)
    second = gateway_proc(tmp_path, models, quotas=quotas)
    with running(second):
        key_client = openai.OpenAI(
            base_url=second.url + "/v1", api_key=key, max_retries=0, timeout=60
        )

        def sends() -> bool:
            try:
                key_client.chat.completions.create(
                    model="gpt", messages=[{"role": "user", "content": "again"}], max_tokens=4
                )
                return True
            except openai.RateLimitError:
                return False

        wait_for(sends, 60, "the team to send again after its gateway's death")
    t.join(10)
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT status, prompt_tokens, completion_tokens, cost_usd FROM usage "
            "WHERE team_id = 'solo' ORDER BY created_at"
        ).fetchall()
    assert [r[0] for r in rows] == ["expired", "ok"], rows
    _, prompt, completion, cost = rows[0]
    assert prompt > 0 and completion >= streamed, rows[0]
    assert cost == pytest.approx((prompt * 10.0 + completion * 20.0) / 1e6), rows[0]


def test_a_restarted_gateway_frees_its_teams_slot_as_it_starts(
    fake: FakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The case exactly: SIGKILL a gateway with a `max_concurrent = 1` team's request in
    flight and restart it (`[server] instance`, which `duet up` sets to the process's name): the
    team sends again at once — the restarted gateway reclaims its previous life's reservation as
    it starts, billed `expired` — however long the heartbeat. Here it is 30 s, so waiting for
    2.5 silent heartbeats (the reclaim of an unnamed gateway, and before, of this one) would
    refuse the first request after the restart."""
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    models = {"gpt": external(fake.fakes["gpt"], {"in": 10.0, "out": 20.0}, 2)}
    quotas, server = {"heartbeat_s": 30.0}, {"instance": "gateway"}
    first = gateway_proc(tmp_path, models, quotas=quotas, server=server)
    key, t = kill_while_holding(fake, first, "hold on")
    second = gateway_proc(tmp_path, models, quotas=quotas, server=server, port=first.port)
    with running(second):
        client = openai.OpenAI(base_url=second.url + "/v1", api_key=key, max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model="gpt", messages=[{"role": "user", "content": "again"}], max_tokens=4
        )
        assert r.choices[0].message.content
    t.join(10)
    with sqlite3.connect(tmp_path / "gateway.db") as conn:
        statuses = [
            r[0]
            for r in conn.execute(
                "SELECT status FROM usage WHERE team_id = 'solo' ORDER BY created_at"
            )
        ]
    assert statuses == ["expired", "ok"], statuses
