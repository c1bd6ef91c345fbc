"""A client's retry under its `Idempotency-Key` is billed once, and only for that team.

The fault (the 600 s chaos run: 17 requests billed twice): a request's attempt reached a
gateway, which booked it and died before answering; the client sent the request again, to
the gateway that took over; the restarted gateway billed the dead attempt `expired` (its
prompt) and the retry `ok` — two records for one answer. Now every attempt under one
`Idempotency-Key` runs under one request id derived from the team and the key, and the settled
attempt's record replaces the `expired` one (or, settled first, is never joined by it). The key
is no free pass: once a request under it was answered, the same key again is billed again.
Another team's same key is another id: its records are its own.

Real parts: both gateway stores (SQLite, and PostgreSQL from pgserver), driven directly for
each order of the two records; and a `duet gateway` process SIGKILLed while the attempt waits on
the model (the local fake provider, which answers when the test lets it), restarted under the
same instance name (it reclaims its dead life's bookings at once), with the official openai
client sending the header as a caller does (`extra_headers`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import pytest

from gateway.accounts.idempotency import HEADER, keyed_request_id
from gateway.accounts.ledger import UsageStatus
from gateway.accounts.store.base import Settlement, Store, UsageKey
from gateway.accounts.store.usage_keys import GAVE_NOTHING, WINDOW_S, Earlier, Verdict, verdict
from tests.gateway.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.gateway.helpers import gateway_proc, http, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running
from tests.providers.fakes import API_KEY
from tests.security.test_batch_billed_once import (  # noqa: F401  (fixtures: both stores)
    Gate,
    _billed,
    _book,
    _record,
    _room,
    _usage,
    fake,
    store,
    store_url,
)
from tests.wait import wait_for

RETRY = UsageKey.RETRY


# -- the store: each order of the dead attempt's record and the retry's ----------------------
async def test_the_retry_replaces_its_dead_attempts_expired_record(
    store: Store,  # noqa: F811  (the fixture imported above)
) -> None:
    rid = keyed_request_id("t", "order-1")
    await _book(store, rid, gateway="gw-dead")
    await store.heartbeat("gw-dead", 60, now=time.time() - 100)
    assert await store.reclaim(dead_after_s=10) == 1
    assert await _billed(store) == [(rid, "expired", 0.1)]
    retry = await _book(store, rid)
    await store.settle([Settlement(retry, _record(rid, 0.3), key=RETRY)])
    assert await _billed(store) == [(rid, "ok", 0.3)]
    assert await _room(store, 0.65) and not await _room(store, 0.75)  # spent 0.3, not 0.4


async def test_the_dead_attempts_expiry_never_joins_the_retrys_record(
    store: Store,  # noqa: F811  (the fixture imported above)
) -> None:
    rid = keyed_request_id("t", "order-2")
    await _book(store, rid, gateway="gw-dead")  # not yet reclaimed
    retry = await _book(store, rid)
    await store.settle([Settlement(retry, _record(rid, 0.3), key=RETRY)])
    await store.heartbeat("gw-dead", 60, now=time.time() - 100)
    assert await store.reclaim(dead_after_s=10) == 1
    assert await _billed(store) == [(rid, "ok", 0.3)]


async def test_a_key_whose_request_was_answered_is_no_free_pass(
    store: Store,  # noqa: F811  (the fixture imported above)
) -> None:
    rid = keyed_request_id("t", "order-3")
    await store.settle([Settlement(None, _record(rid, 0.2), key=RETRY)])
    await store.settle([Settlement(None, _record(rid, 0.3), key=RETRY)])
    assert sorted(await _billed(store)) == [(rid, "ok", 0.2), (rid, "ok", 0.3)]
    assert await _room(store, 0.45) and not await _room(store, 0.55)  # spent 0.5


async def test_an_attempt_refused_before_its_first_token_is_replaced_by_its_retry(
    store: Store,  # noqa: F811  (the fixture imported above)
) -> None:
    """A 503 `no_capacity` (or a 502 before the first token) sent again after its Retry-After
    under its key: one record, the answered one (the chaos run found two: `error` and `ok`)."""
    rid = keyed_request_id("t", "order-4")
    await store.settle([Settlement(None, _record(rid, 0.0, status="error"), key=RETRY)])
    await store.settle([Settlement(None, _record(rid, 0.3), key=RETRY)])
    assert await _billed(store) == [(rid, "ok", 0.3)]
    # a record that delivered something stays beside its retry's
    rid = keyed_request_id("t", "order-5")
    await store.settle([Settlement(None, _record(rid, 0.1, status="error_midstream"), key=RETRY)])
    await store.settle([Settlement(None, _record(rid, 0.3), key=RETRY)])
    got = sorted(b for b in await _billed(store) if b[0] == rid)
    assert got == [(rid, "error_midstream", 0.1), (rid, "ok", 0.3)]


def test_the_refusal_statuses_are_the_ledgers() -> None:
    assert {UsageStatus.ERROR.value, UsageStatus.SHED.value} < GAVE_NOTHING


def test_only_a_recent_expired_record_of_the_same_team_is_replaced() -> None:
    now = 1e9
    dead = Earlier(team_id="t", billed_at=now - 60, status="expired")
    assert verdict(RETRY, "t", "ok", dead, now) is Verdict.REPLACE
    assert verdict(RETRY, "t", "expired", dead, now) is Verdict.SKIP
    old = Earlier(team_id="t", billed_at=now - WINDOW_S - 1, status="expired")
    assert verdict(RETRY, "t", "ok", old, now) is Verdict.BESIDE
    assert verdict(RETRY, "u", "ok", dead, now) is Verdict.BESIDE  # never another team's
    answered = Earlier(team_id="t", billed_at=now - 60, status="ok")
    assert verdict(RETRY, "t", "ok", answered, now) is Verdict.BESIDE
    refused = Earlier(team_id="t", billed_at=now - 60, status="error")
    assert verdict(RETRY, "t", "ok", refused, now) is Verdict.REPLACE
    cut = Earlier(team_id="t", billed_at=now - 60, status="client_disconnected")
    assert verdict(RETRY, "t", "ok", cut, now) is Verdict.BESIDE
    assert verdict(UsageKey.RERUN, "t", "ok", answered, now) is Verdict.REPLACE
    assert verdict(RETRY, "t", "ok", None, now) is Verdict.WRITE
    assert keyed_request_id("t", "k") != keyed_request_id("u", "k")


# -- the gateway dies mid-attempt, with real processes ---------------------------------------
CHAT: dict[str, Any] = {
    "model": "gpt",
    "messages": [{"role": "user", "content": "bill me once"}],
    "max_tokens": 8,
}


def _ask(url: str, key: str, idempotency_key: str) -> str:
    """One attempt with the header; the answer's X-Request-Id."""
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    raw = c.chat.completions.with_raw_response.create(
        **CHAT, extra_headers={HEADER: idempotency_key}
    )
    assert raw.parse().choices[0].message.content
    return raw.headers["x-request-id"]


def test_a_retry_after_its_gateway_died_is_billed_once(
    fake: tuple[FakeServers, Gate],  # noqa: F811  (the fixture imported above)
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    store_url: str,  # noqa: F811
) -> None:
    servers, gate = fake
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    models = {"gpt": external(servers.fakes["gpt"], {"in": 10.0, "out": 20.0}, 2)}
    server = {"instance": "gw-a"}  # a restart under its name reclaims its dead life at once
    first = gateway_proc(tmp_path, models, store=store_url, server=server)
    died: list[BaseException] = []

    def attempt() -> None:
        try:
            _ask(first.url, kx, "order-7")
        except openai.APIConnectionError as e:
            died.append(e)

    with running(first):
        kx, ky = make_team(first.url, "x"), make_team(first.url, "y")
        t = threading.Thread(target=attempt)
        t.start()
        gpt = servers.fakes["gpt"]
        wait_for(lambda: len(gpt.requests) == 1, 60, "the attempt to reach the model")
        first.kill()  # SIGKILL mid-attempt: booked, never answered
    t.join(60)
    assert died, "the first attempt must have died with its gateway"
    second = gateway_proc(tmp_path, models, port=first.port, store=store_url, server=server)
    with running(second):
        url = second.url
        wait_for(
            lambda: [r["status"] for r in _usage(url, kx)] == ["expired"],
            60,
            "the dead attempt billed expired",
        )
        gate.open.set()
        rid = _ask(url, kx, "order-7")  # the client's retry, same key
        assert rid == keyed_request_id("x", "order-7")
        # Old code (no key): [expired, ok] — the team paid the prompt twice.
        assert [(r["status"], r["request_id"]) for r in _usage(url, kx)] == [("ok", rid)]
        # Another team's same key is its own request: its own record, team x's untouched.
        rid_y = _ask(url, ky, "order-7")
        assert rid_y != rid
        assert [(r["status"], r["request_id"]) for r in _usage(url, ky)] == [("ok", rid_y)]
        assert [r["status"] for r in _usage(url, kx)] == ["ok"]
        # Once answered, the same key again is billed again.
        assert _ask(url, kx, "order-7") == rid
        assert [r["status"] for r in _usage(url, kx)] == ["ok", "ok"]
        status, _, body = http(
            f"{url}/v1/chat/completions", "POST", CHAT, key=kx, headers={HEADER: "é" * 3}
        )
        assert status == 400 and body["error"]["code"] == "invalid_idempotency_key", body
