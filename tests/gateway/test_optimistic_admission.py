"""Booking a quota reservation beside the request (gateway/headroom.py, gateway/booking.py).

Rules: `decide()` reports how many more requests like this one every limit admits (`spare`);
a team is optimistic only with room for twice its optimistic bookings in flight. Through a
real gateway and node: a team with room books beside its requests and every booking is
settled; when the store refuses a request that already started (its limit was lowered behind
the gateway's back), the client gets the usual 429 and nothing else, the node is freed, no
usage is recorded, and the team books first from then on."""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.headroom import MARGIN, Headroom
from gateway.store.base import RateState, Refusal, Reservation, ReserveRequest, Team
from gateway.store.rules import Counters, decide
from tests.gateway.helpers import (
    ADMIN_KEY,
    MODEL,
    gateway_proc,
    http,
    make_team,
    metric,
    tiny_model,
)
from tests.gateway.test_failures import nothing_held, wait_for
from tests.procs import Proc, duet_node, running

PROMPT = "book beside me"


def _counters(active: int = 0, window_requests: int = 0, window_tokens: int = 0, spent: float = 0.0) -> Counters:
    return Counters(active=active, active_cost=0.0, window_requests=window_requests, window_tokens=window_tokens,
                    window_oldest=None, spent_day=spent, spent_month=spent)  # fmt: skip


def _req(tokens: int = 100, cost: float = 0.01) -> ReserveRequest:
    return ReserveRequest(team_id="t", key_id="k", request_id="r", tokens=tokens, cost_usd=cost, ttl_s=60)


@pytest.mark.parametrize(("team", "counters", "spare"), [
    (Team(id="t"), _counters(), None),
    (Team(id="t", max_concurrent=5), _counters(active=2), 2),
    (Team(id="t", rpm=10), _counters(window_requests=3), 6),
    (Team(id="t", tpm=1000), _counters(window_tokens=450), 4),  # 550 left, 450 after, 4 more of 100
    (Team(id="t", daily_budget_usd=0.1), _counters(spent=0.045), 4),  # 0.055 left, 0.045 after
    (Team(id="t", rpm=100, tpm=1000, max_concurrent=1), _counters(), 0),  # the tightest limit wins
])  # fmt: skip
def test_decide_reports_the_spare_room_of_the_tightest_limit(team: Team, counters: Counters,
                                                             spare: int | None) -> None:  # fmt: skip
    state = decide(team, counters, _req())
    assert isinstance(state, RateState) and state.spare == spare


def _booked(spare: int | None) -> Reservation:
    return Reservation("rsv", RateState(spare=spare))


def test_headroom_starts_only_teams_with_room_for_their_bookings_in_flight() -> None:
    h = Headroom()
    assert not h.start("t"), "a team never seen books first"
    h.learn("t", _booked(2 * MARGIN))
    assert h.start("t") and h.start("t"), "room for two bookings in flight"
    assert not h.start("t"), "a third would eat into the margin"
    h.done("t", _booked(2 * MARGIN))
    assert h.optimistic_in_flight("t") == 1 and h.start("t")
    h.done("t", Refusal("tokens", "no", 1.0, RateState()))
    assert not h.start("t"), "refused: the team books first again"
    h.done("t", None)
    h.learn("u", _booked(None))
    assert all(h.start("u") for _ in range(100)), "a team with no limit is always optimistic"
    off = Headroom(enabled=False)
    off.learn("u", _booked(None))
    assert not off.start("u")


def test_headroom_is_bounded() -> None:
    h = Headroom(max_teams=3)
    for t in "abcd":
        h.learn(t, _booked(None))
    assert not h.start("a") and h.start("d")


@pytest.fixture(scope="module")
def gw(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Path]]:
    tmp = tmp_path_factory.mktemp("gw-optimistic")
    both = duet_node("both", tiny_llama, tmp, "--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")
    g = gateway_proc(tmp, {MODEL: tiny_model(tiny_llama, both=[both.url])})
    with running(both, g):
        yield g, both, tmp / "gateway.db"


def _body(stream: bool) -> dict[str, object]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None, "ignore_eos": True}  # fmt: skip


def _post(url: str, key: str, stream: bool) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(_body(stream)).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _optimistic(g: Proc, outcome: str) -> float:
    text = urllib.request.urlopen(g.url + "/metrics", timeout=5).read().decode()
    line = f'duet:gateway_optimistic_bookings_total{{outcome="{outcome}"}} '
    return next((float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line)), 0.0)


def _open_reservations(db: Path, team: str) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT count(*) FROM reservations WHERE team_id=?", (team,)).fetchone()[0]


def test_a_team_with_room_books_beside_its_requests(gw: tuple[Proc, Proc, Path]) -> None:
    g, _, db = gw
    key = make_team(g.url, "roomy", tpm=10**7)
    before = _optimistic(g, "admitted")
    tokens = 0
    for stream in (False, True, False, True):
        status, _, raw = _post(g.url, key, stream)
        assert status == 200, raw
        chunks = [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]
        usage = chunks[-1]["usage"] if stream else json.loads(raw)["usage"]
        tokens += usage["total_tokens"]
    assert _optimistic(g, "admitted") - before >= 3, "after the first booking, the team had room"
    assert _open_reservations(db, "roomy") == 0, "every booking was settled"
    usage = http(g.url + "/v1/usage", key=key)[2]["data"][0]
    assert usage["requests"] == 4 and usage["total_tokens"] == tokens


async def test_a_refusal_after_starting_is_the_usual_429_and_frees_the_node(gw: tuple[Proc, Proc, Path]) -> None:
    g, node, db = gw
    key = make_team(g.url, "shrinking", tpm=10**7)
    assert _post(g.url, key, False)[0] == 200  # the team's first booking: it has room
    with sqlite3.connect(db) as c:  # the limit is lowered behind this gateway's back
        c.execute("UPDATE teams SET tpm = 5 WHERE id = 'shrinking'")
    refused_before = _optimistic(g, "refused")
    status, headers, raw = _post(g.url, key, True)
    assert status == 429, raw
    err = json.loads(raw)["error"]  # a JSON error body, not an event stream that began
    assert err["code"] == "rate_limit_exceeded" and err["param"] == "tokens"
    assert headers["Content-Type"].startswith("application/json")
    assert int(headers["Retry-After"]) >= 1 and headers["x-ratelimit-limit-tokens"] == "5"
    assert _optimistic(g, "refused") == refused_before + 1, "it had started before the store said no"
    await wait_for(lambda: nothing_held(node), what="the node to drop the refused request")
    assert _open_reservations(db, "shrinking") == 0
    # refused once, the team books first: the next request never reaches the node
    prompt_before = metric(node.url, "duet:prompt_tokens_total")
    assert prompt_before > 0
    assert _post(g.url, key, False)[0] == 429
    assert _optimistic(g, "refused") == refused_before + 1
    assert metric(node.url, "duet:prompt_tokens_total") == prompt_before
    usage = http(g.url + "/v1/usage?team_id=shrinking", key=ADMIN_KEY)[2]["data"][0]
    assert usage["requests"] == 1, "a refused request has no usage record"
