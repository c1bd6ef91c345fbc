"""Fair shares of a saturated tier through tier admission: a team flooding the tier waits behind
its own requests, another team's request is served at its own turn; waits and refusals are
counted per team, and the answer says its wait (`x-duet-queue-ms`). Orders and counters only,
no timing bounds."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.config import ConfigError, TierConfig, parse_config
from gateway.metrics import GatewayMetrics
from gateway.serving.fair_queue import Claim
from gateway.serving.tiers import Admission, Shed
from tests.gateway.conftest import GatewayOnNode
from tests.gateway.helpers import MODEL, http, make_team, scrape
from tests.wait import until

A, B = Claim(team="a", tokens=10), Claim(team="b", tokens=10)


def admission(fair_share: bool = True) -> Admission:
    cfg = TierConfig(max_inflight=1, interactive_queue=5, fair_share=fair_share)
    return Admission(cfg, GatewayMetrics())


async def _hold(
    a: Admission, claim: Claim, order: list[str], name: str, go: asyncio.Event, output: int
) -> None:
    async with a.slot("interactive", claim) as turn:
        order.append(name)
        assert int(turn.queue_ms) >= 0
        await go.wait()
        turn.output(output)


async def _flood_then_b(a: Admission) -> list[str]:
    """Team a holds the one slot and queues four more; then team b asks for one. The order the
    slot goes round in."""
    order: list[str] = []
    hold, go = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.ensure_future(_hold(a, A, order, "hold", hold, 100))]
    await until(lambda: order == ["hold"])
    for i in range(4):
        tasks.append(asyncio.ensure_future(_hold(a, A, order, f"a{i}", go, 10)))
        await until(lambda i=i: a.depth("interactive") == i + 1)
    tasks.append(asyncio.ensure_future(_hold(a, B, order, "b0", go, 10)))
    await until(lambda: a.depth("interactive") == 5)
    with pytest.raises(Shed) as e:  # the queue is full: refused, counted for its team
        async with a.slot("interactive", A):
            pass
    assert e.value.headers["x-duet-shed-reason"] == "queue_full"
    go.set()
    hold.set()
    await asyncio.gather(*tasks)
    assert a.running == 0 and a.depth("interactive") == 0
    return order


async def test_a_flooding_team_waits_behind_its_own_requests() -> None:
    a = admission()
    # b is served at the first freed slot: a's holder was charged its output first
    assert await _flood_then_b(a) == ["hold", "b0", "a0", "a1", "a2", "a3"]
    sample = a.metrics.registry.get_sample_value
    waits = "duet:gateway_queue_wait_seconds_count"
    assert sample(waits, {"team": "a", "tier": "interactive"}) == 5
    assert sample(waits, {"team": "b", "tier": "interactive"}) == 1
    refused = "duet:gateway_admission_refusals_total"
    assert sample(refused, {"team": "a", "tier": "interactive", "reason": "queue_full"}) == 1
    assert sample(refused, {"team": "b", "tier": "interactive", "reason": "queue_full"}) is None


async def test_a_full_queue_refuses_the_flooding_team_not_the_newcomer() -> None:
    """Team a fills the queue; team b's request takes the place of a's newest waiter, which is
    refused (503 queue_full, counted for a), and is served at its turn."""
    a = Admission(TierConfig(max_inflight=1, interactive_queue=3), GatewayMetrics())
    order: list[str] = []
    hold, go = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.ensure_future(_hold(a, A, order, "hold", hold, 100))]
    await until(lambda: order == ["hold"])
    for i in range(3):
        tasks.append(asyncio.ensure_future(_hold(a, A, order, f"a{i}", go, 0)))
        await until(lambda i=i: a.depth("interactive") == i + 1)
    b = asyncio.ensure_future(_hold(a, B, order, "b0", go, 0))
    await until(lambda: tasks[-1].done())  # a2 made room
    with pytest.raises(Shed) as e:
        await tasks.pop()
    assert e.value.headers["x-duet-shed-reason"] == "queue_full"
    assert a.depth("interactive") == 3
    with pytest.raises(Shed):  # a itself, arriving at the full queue, is refused
        async with a.slot("interactive", A):
            pass
    go.set()
    hold.set()
    await asyncio.gather(*tasks, b)
    assert order == ["hold", "b0", "a0", "a1"] and a.running == 0
    refused = a.metrics.registry.get_sample_value
    labels = {"team": "a", "tier": "interactive", "reason": "queue_full"}
    assert refused("duet:gateway_admission_refusals_total", labels) == 2
    assert refused("duet:gateway_admission_refusals_total", {**labels, "team": "b"}) is None


async def test_fair_shares_off_serves_first_come_first_served() -> None:
    assert await _flood_then_b(admission(fair_share=False)) == [
        "hold",
        *(f"a{i}" for i in range(4)),
        "b0",
    ]


def test_team_weight_is_checked() -> None:
    model = {"kind": "cluster", "tokenizer": "t", "static": {"both": ["http://127.0.0.1:9"]}}
    base = {"store": {"url": "sqlite:///tmp/x.db"}, "models": {"m": model}}
    cfg = parse_config({**base, "teams": {"big": {"weight": 3}}})
    assert cfg.team_policy("big").weight == 3 and cfg.team_policy("other").weight == 1.0
    for bad in (0, -1, "2", True):
        with pytest.raises(ConfigError, match=r"\[teams.big\] weight"):
            parse_config({**base, "teams": {"big": {"weight": bad}}})
    with pytest.raises(ConfigError, match="fair_output_weight"):
        parse_config({**base, "tiers": {"fair_output_weight": -1}})


async def test_a_flood_does_not_delay_another_team_beyond_its_turn(one_slot: GatewayOnNode) -> None:
    """Through a real gateway (one slot) and a real node: team a holds the slot with a long
    stream and queues three long requests; team b's one request, sent last, is served next —
    it has finished before any of a's queued ones has. The node is paused while the queue forms,
    so the holder keeps the slot however fast the node would have finished it."""
    g = one_slot.gateway
    auth = {t: {"Authorization": f"Bearer {make_team(g.url, t)}"} for t in ("a", "b")}
    long = {"model": MODEL, "prompt": "hold", "max_tokens": 400, "ignore_eos": True}
    url = g.url + "/v1/completions"
    async with aiohttp.ClientSession() as s:

        async def ask(team: str, body: dict[str, object]) -> tuple[int, str]:
            async with s.post(url, json=body, headers=auth[team]) as r:
                await r.read()
                return r.status, r.headers.get("x-duet-queue-ms", "")

        queued = []
        with one_slot.node_paused():
            holding = asyncio.ensure_future(
                s.post(url, json={**long, "stream": True}, headers=auth["a"])
            )
            await until(lambda: _running(g.url) == 1, timeout=60)
            for i in range(3):
                queued.append(asyncio.ensure_future(ask("a", {**long, "max_tokens": 200})))
                await until(lambda i=i: _waiting(g.url) == i + 1, timeout=60)
            b = asyncio.ensure_future(ask("b", {"model": MODEL, "prompt": "b", "max_tokens": 4}))
            await until(lambda: _waiting(g.url) == 4, timeout=60)
        holder = await asyncio.wait_for(holding, 120)
        assert holder.status == 200 and holder.headers["x-duet-queue-ms"] == "0"
        async for _ in holder.content:
            pass
        holder.close()
        status, waited = await asyncio.wait_for(b, 120)
        assert status == 200 and int(waited) >= 0
        assert not any(t.done() for t in queued)  # b went ahead of a's whole backlog
        done = await asyncio.wait_for(asyncio.gather(*queued), 300)
        assert [st for st, _ in done] == [200] * 3
    # each served request's usage record holds its wait for the slot
    status, _, body = http(g.url + "/v1/usage?group_by=record&team_id=b")
    assert status == 200, body
    [row] = body["data"]
    assert row["status"] == "ok" and row["queue_s"] is not None and row["queue_s"] >= 0
    text = scrape(g.url)
    assert 'duet:gateway_queue_wait_seconds_count{team="b",tier="interactive"} 1.0' in text
    assert 'duet:gateway_queue_wait_seconds_count{team="a",tier="interactive"} 4.0' in text


def _waiting(url: str) -> int:
    return int(http(url + "/health")[2]["waiting"]["interactive"])


def _running(url: str) -> int:
    return int(http(url + "/health")[2]["running"])
