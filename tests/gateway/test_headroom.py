"""Headroom in a saturated tier: a team beyond its fair share leaves a few slots free while
another active team holds less than its own, and takes every slot when alone. The policy's
decision exactly (`Headroom.grant`, a stepped clock), tier admission with it (`Admission`), and
a real gateway in front of a real node. Orders and counts only, no timing bounds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.config import ConfigError, TierConfig, parse_config
from gateway.metrics import GatewayMetrics
from gateway.serving.fair_queue import Claim
from gateway.serving.headroom import Grant, Headroom
from gateway.serving.tiers import Admission
from tests.gateway.conftest import GatewayOnNode, gateway_on_node
from tests.gateway.helpers import MODEL, http, make_team
from tests.wait import until


def test_a_team_alone_may_take_every_slot() -> None:
    h = Headroom(slots=4, headroom=1, active_s=5.0)
    h.asked("a", 1.0, now=0.0)
    for held in range(4):
        assert h.grant("a", 4 - held, {"a": held}, (), now=0.0).starts
    # no other team has room to hold: the last slot is spare
    assert h.grant("a", 1, {"a": 3}, (), now=0.0) is Grant.SPARE


def test_slots_are_held_for_an_active_team_under_its_share() -> None:
    """Teams a and b of weight 1 on 32 slots (shares 16): b asked a second ago and holds 4, a
    holds 26. a may take free slots while more than 2 stay free, not the last 2; b takes any."""
    h = Headroom(slots=32, headroom=2, active_s=5.0)
    h.asked("b", 1.0, now=0.0)
    h.asked("a", 1.0, now=1.0)
    running = {"a": 26, "b": 4}
    assert h.grant("a", 3, running, (), now=1.0) is Grant.SPARE
    assert h.grant("a", 2, running, (), now=1.0) is Grant.HELD
    assert h.grant("a", 1, running, (), now=1.0) is Grant.HELD
    assert h.grant("b", 1, running, (), now=1.0).starts  # nothing is held against b
    # a waiting a is held the same: waiting does not make a team's share larger
    assert h.grant("a", 2, running, ("a",), now=1.0) is Grant.HELD


def test_the_headroom_held_is_at_most_the_others_room() -> None:
    """b holds 15 of its 16: one slot more is all it may take within its share, so one is held
    against a, not two."""
    h = Headroom(slots=32, headroom=2, active_s=5.0)
    h.asked("b", 1.0, now=0.0)
    h.asked("a", 1.0, now=0.0)
    # the one slot free is b's room, but a is under its share too: a may take it
    assert h.grant("a", 1, {"a": 15, "b": 15}, (), now=0.0) is Grant.WITHIN_SHARE
    running = {"a": 16, "b": 15}
    assert h.grant("a", 1, running, (), now=0.0) is Grant.HELD
    assert h.grant("a", 2, running, (), now=0.0) is Grant.SPARE
    # at its share, b is held for nobody: a takes the last slot
    assert h.grant("a", 1, {"a": 15, "b": 16}, (), now=0.0) is Grant.SPARE


def test_a_team_gone_quiet_is_no_longer_held_for() -> None:
    h = Headroom(slots=4, headroom=1, active_s=5.0)
    h.asked("b", 1.0, now=0.0)
    h.asked("a", 1.0, now=3.0)
    running = {"a": 3}
    assert h.grant("a", 1, running, (), now=4.9) is Grant.HELD
    assert h.lapses((), now=4.9) == 5.0  # b's, the first to lapse of the teams not waiting
    assert h.grant("a", 1, running, (), now=5.0) is Grant.SPARE  # a is alone now
    assert h.lapses((), now=5.0) == 8.0  # b has lapsed
    assert h.lapses((), now=8.0) is None  # and a too


def test_a_waiting_team_stays_active() -> None:
    """b asked long ago and still waits for a slot: it is active, and not a team to lapse."""
    h = Headroom(slots=4, headroom=1, active_s=5.0)
    h.asked("b", 1.0, now=0.0)
    h.asked("a", 1.0, now=60.0)
    assert h.grant("a", 1, {"a": 3}, ("b",), now=60.0) is Grant.HELD
    assert h.lapses(("b",), now=60.0) == 65.0


def test_shares_follow_the_weights() -> None:
    """b of weight 3 against a of weight 1 on 8 slots: shares 6 and 2. b holding 5 still has
    room (one slot is held against a); holding 6, none."""
    h = Headroom(slots=8, headroom=2, active_s=5.0)
    h.asked("a", 1.0, now=0.0)
    h.asked("b", 3.0, now=0.0)
    assert h.grant("a", 1, {"a": 2, "b": 5}, (), now=0.0) is Grant.HELD
    assert h.grant("a", 2, {"a": 1, "b": 5}, (), now=0.0) is Grant.SPARE
    assert h.grant("a", 2, {"a": 1}, (), now=0.0) is Grant.WITHIN_SHARE  # a's 2nd, within 2
    assert h.grant("a", 1, {"a": 1, "b": 6}, (), now=0.0) is Grant.SPARE
    assert h.grant("b", 1, {"a": 1, "b": 6}, (), now=0.0) is Grant.HELD  # b at its share


def test_no_headroom_holds_nothing() -> None:
    h = Headroom(slots=4, headroom=0, active_s=5.0)
    h.asked("b", 1.0, now=0.0)
    h.asked("a", 1.0, now=0.0)
    assert h.grant("a", 1, {"a": 3}, (), now=0.0) is Grant.SPARE
    assert h.lapses((), now=0.0) is None  # nothing recorded: no bookkeeping without headroom


def test_the_settings_and_their_default() -> None:
    model = {"kind": "cluster", "tokenizer": "t", "static": {"both": ["http://127.0.0.1:9"]}}
    base = {"store": {"url": "sqlite:///tmp/x.db"}, "models": {"m": model}}
    assert parse_config(base).tiers.headroom == 2  # 256 slots
    assert TierConfig(max_inflight=64).headroom == 2
    assert TierConfig(max_inflight=32).headroom == 1
    assert TierConfig(max_inflight=8).headroom == 1
    assert TierConfig(max_inflight=7).headroom == 0
    assert TierConfig(max_inflight=8, fair_headroom=3).headroom == 3
    assert TierConfig(fair_share=False).headroom == 0  # first come first served holds nothing
    for bad in (-1, 1.5, True, 257):
        with pytest.raises(ConfigError, match="fair_headroom"):
            parse_config({**base, "tiers": {"fair_headroom": bad}})
    for bad in (0, -1, "5"):
        with pytest.raises(ConfigError, match="fair_active_s"):
            parse_config({**base, "tiers": {"fair_active_s": bad}})


class Clock:
    """A clock the test steps (the activity window's)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def admission(clock: Clock | None = None, **tiers: object) -> Admission:
    cfg = TierConfig(**{"max_inflight": 4, "interactive_queue": 16, "fair_headroom": 1, **tiers})  # type: ignore[arg-type]
    if clock is None:
        return Admission(cfg, GatewayMetrics())
    return Admission(cfg, GatewayMetrics(), clock=clock)


A, B = Claim(team="a", tokens=10), Claim(team="b", tokens=10)


class Holders:
    """Requests that hold their slot until released; the order they got it in."""

    def __init__(self, a: Admission) -> None:
        self.a = a
        self.order: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def ask(self, name: str, claim: Claim) -> None:
        self.gates[name] = asyncio.Event()
        self.tasks[name] = asyncio.ensure_future(self._hold(name, claim))

    async def _hold(self, name: str, claim: Claim) -> None:
        async with self.a.slot("interactive", claim):
            self.order.append(name)
            await self.gates[name].wait()

    async def release(self, *names: str) -> None:
        for n in names:
            self.gates[n].set()
        await asyncio.gather(*(self.tasks[n] for n in names))

    async def release_all(self) -> None:
        await self.release(*self.gates)


async def test_a_flood_leaves_the_headroom_to_an_active_team() -> None:
    """4 slots, headroom 1, b active (it asked once): a's flood takes 3 and waits; b's request
    starts at once, ahead of a's waiters. A slot b frees is held again; a slot a frees goes to
    a's next waiter (two are free then, one held)."""
    clock = Clock()
    a = admission(clock)
    h = Holders(a)
    h.ask("b0", B)
    await until(lambda: h.order == ["b0"])
    await h.release("b0")  # b asked, and holds nothing now
    for i in range(5):
        h.ask(f"a{i}", A)
    await until(lambda: a.depth("interactive") == 2)
    assert h.order == ["b0", "a0", "a1", "a2"] and a.running == 3
    h.ask("b1", B)
    await until(lambda: len(h.order) == 5)
    assert h.order[-1] == "b1" and a.running == 4 and a.depth("interactive") == 2
    await h.release("b1")
    assert a.running == 3 and a.depth("interactive") == 2  # held for b again
    await h.release("a0")
    await until(lambda: len(h.order) == 6)
    assert h.order[-1] == "a3" and a.running == 3 and a.depth("interactive") == 1
    await h.release_all()
    assert a.running == 0 and a.depth("interactive") == 0


async def test_a_team_alone_takes_every_slot_then_leaves_room_once_another_asks() -> None:
    """Only a active: its flood takes all 4. Then b asks (and waits, every slot is taken): the
    next freed slot is b's, and a's waiters take no more than 3 while b is active."""
    clock = Clock()
    a = admission(clock)
    h = Holders(a)
    for i in range(6):
        h.ask(f"a{i}", A)
    await until(lambda: a.depth("interactive") == 2)
    assert h.order == ["a0", "a1", "a2", "a3"] and a.running == 4
    h.ask("b0", B)
    await until(lambda: a.depth("interactive") == 3)
    await h.release("a0")
    await until(lambda: len(h.order) == 5)
    assert h.order[-1] == "b0"
    await h.release("b0", "a1")
    # two slots free: a4 takes one, the last is held for b, which is still active
    await until(lambda: len(h.order) == 6)
    assert h.order[-1] == "a4" and a.running == 3 and a.depth("interactive") == 1
    await h.release_all()
    assert a.running == 0


async def test_a_slot_held_for_a_team_gone_quiet_is_given_back() -> None:
    """b's activity lapses while a's waiter is held and no slot frees: the held slot goes to a
    without waiting for one to free. The window is short (0.2 s), and the clock the policy
    reads is stepped past it by the test: the timer set for the lapse keeps checking until it
    has."""
    clock = Clock()
    a = admission(clock, fair_active_s=0.2)
    h = Holders(a)
    h.ask("b0", B)
    await until(lambda: h.order == ["b0"])
    await h.release("b0")
    for i in range(4):
        h.ask(f"a{i}", A)
    await until(lambda: a.depth("interactive") == 1)
    assert a.running == 3  # held for b
    clock.now = 1.0
    await until(lambda: len(h.order) == 5, what="a3 given b's headroom")
    assert h.order[-1] == "a3" and a.running == 4 and a.depth("interactive") == 0
    await h.release_all()


async def test_fair_shares_off_hold_nothing() -> None:
    a = admission(Clock(), fair_share=False)
    h = Holders(a)
    h.ask("b0", B)
    await until(lambda: h.order == ["b0"])
    await h.release("b0")
    for i in range(4):
        h.ask(f"a{i}", A)
    await until(lambda: a.running == 4)
    await h.release_all()


@pytest.fixture
def four_slots(tiny_llama: Path, tmp_path: Path) -> Iterator[GatewayOnNode]:
    """A real gateway with 4 slots, headroom 1 and an activity window longer than any test, in
    front of one real node."""
    with gateway_on_node(
        tiny_llama, tmp_path, max_inflight=4, fair_headroom=1, fair_active_s=600
    ) as pair:
        yield pair


async def test_the_gateway_starts_an_active_teams_request_while_a_flood_waits(
    four_slots: GatewayOnNode,
) -> None:
    """Through a real gateway (4 slots, headroom 1) and a real node, paused while the slots
    fill so that an admitted request holds its slot: team a alone takes all 4. Once b has
    asked, a's flood takes 3 and waits, and b's request is admitted at once beside a's waiters;
    every request is answered."""
    g = four_slots.gateway.url
    auth = {t: {"Authorization": f"Bearer {make_team(g, t)}"} for t in ("a", "b")}
    url = g + "/v1/completions"
    body = {"model": MODEL, "prompt": "hold", "max_tokens": 8, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:

        async def ask(team: str) -> int:
            async with s.post(url, json=body, headers=auth[team]) as r:
                await r.read()
                return r.status

        async def flood(n: int, running: int, waiting: int) -> list[asyncio.Task[int]]:
            sent = [asyncio.ensure_future(ask("a")) for _ in range(n)]
            await until(lambda: _load(g) == (running, waiting), timeout=60, what="a's flood")
            return sent

        with four_slots.node_paused():
            alone = await flood(5, running=4, waiting=1)
        assert await asyncio.wait_for(asyncio.gather(*alone), 300) == [200] * 5
        assert await ask("b") == 200  # b is active from here on
        with four_slots.node_paused():
            sent = await flood(5, running=3, waiting=2)
            b = asyncio.ensure_future(ask("b"))
            await until(lambda: _load(g) == (4, 2), timeout=60, what="b admitted")
        assert await asyncio.wait_for(asyncio.gather(b, *sent), 300) == [200] * 6
    assert _load(g) == (0, 0)


def _load(url: str) -> tuple[int, int]:
    """The gateway's (running, interactive waiting)."""
    health = http(url + "/health")[2]
    return int(health["running"]), int(health["waiting"]["interactive"])
