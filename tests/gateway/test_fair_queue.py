"""The fair queue's order, exactly: least attained service first (token-weighted, divided by the
team's weight), first come first served within a team, and no banking of idle time."""

from __future__ import annotations

from gateway.serving.fair_queue import Claim, FairQueue


def _drain(q: FairQueue[str], n: int | None = None) -> list[str]:
    out: list[str] = []
    while (n is None or len(out) < n) and (w := q.pop()) is not None:
        out.append(w.item)
    return out


def test_a_burst_waits_behind_its_own_requests() -> None:
    q: FairQueue[str] = FairQueue()
    a, b = Claim(team="a", tokens=10), Claim(team="b", tokens=10)
    for i in range(10):
        q.push(a, f"a{i}")
    q.push(b, "b0")
    q.push(b, "b1")
    # b arrives after a's whole burst, and is served at its own turn: every other slot
    assert _drain(q) == ["a0", "b0", "a1", "b1", *(f"a{i}" for i in range(2, 10))]
    assert len(q) == 0 and q.counter("a") == 100 and q.counter("b") == 20


def test_first_come_first_served_within_a_team() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push(Claim(team="a", tokens=100 - i), f"a{i}")
    assert _drain(q) == [f"a{i}" for i in range(5)]


def test_service_is_counted_in_tokens() -> None:
    """A team of long prompts gets fewer requests through than one of short prompts: one
    1000-token request is worth ten 100-token ones."""
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push(Claim(team="long", tokens=1000), f"L{i}")
    for i in range(30):
        q.push(Claim(team="short", tokens=100), f"s{i}")
    order = _drain(q, 13)
    assert order[0] == "L0" and order[1:11] == [f"s{i}" for i in range(10)]
    assert order[11:] == ["L1", *[f"s{i}" for i in range(10, 11)]]


def test_output_tokens_count_at_their_weight() -> None:
    q: FairQueue[str] = FairQueue(output_weight=2.0)
    a = Claim(team="a", tokens=10)
    q.admitted(a)
    q.done(a, output_tokens=5)
    assert q.counter("a") == 10 + 2 * 5
    heavy = Claim(team="h", weight=4.0, tokens=40)
    q.admitted(heavy)
    q.done(heavy, output_tokens=8)
    assert q.counter("h") == (40 + 16) / 4


def test_weights_share_the_tier_in_proportion() -> None:
    q: FairQueue[str] = FairQueue()
    for _ in range(20):
        q.push(Claim(team="two", weight=2.0, tokens=10), "two")
        q.push(Claim(team="one", weight=1.0, tokens=10), "one")
    order = _drain(q, 12)
    assert order.count("two") == 8 and order.count("one") == 4


def test_idle_time_is_not_banked() -> None:
    """A team that was quiet while another was served starts level with the waiting teams (it
    is not owed the other's past service): it gets every other slot, not a long run."""
    q: FairQueue[str] = FairQueue()
    busy = Claim(team="busy", tokens=10)
    for _ in range(100):  # served without waiting (admitted at once), all charged
        q.admitted(busy)
        q.done(busy, 0)
    for i in range(4):
        q.push(busy, f"busy{i}")
    q.push(Claim(team="quiet", tokens=10), "quiet0")
    q.push(Claim(team="quiet", tokens=10), "quiet1")
    assert q.counter("quiet") == q.counter("busy") == 1000
    assert _drain(q) == ["busy0", "quiet0", "busy1", "quiet1", "busy2", "busy3"]


def test_a_newly_backlogged_team_is_lifted_to_the_last_served_when_none_waits() -> None:
    q: FairQueue[str] = FairQueue()
    a = Claim(team="a", tokens=50)
    q.push(a, "a0")
    assert _drain(q) == ["a0"]
    q.push(Claim(team="b", tokens=1), "b0")  # nobody waits: b starts at a's counter
    assert q.counter("b") == q.counter("a") == 50


def test_a_waiter_that_gives_up_leaves_its_place() -> None:
    q: FairQueue[str] = FairQueue()
    a = Claim(team="a", tokens=10)
    first = q.push(a, "a0")
    q.push(a, "a1")
    q.push(Claim(team="b", tokens=10), "b0")
    assert q.remove(first) and not q.remove(first)
    assert len(q) == 2 and q.waiting("a") == 1
    assert _drain(q) == ["a1", "b0"]
    assert q.counter("a") == 10  # the one that left was never charged
    q.refund(a)
    assert q.counter("a") == 0


def test_fair_shares_off_is_first_come_first_served() -> None:
    q: FairQueue[str] = FairQueue(by_team=False)
    for i in range(3):
        q.push(Claim(team="a", tokens=10), f"a{i}")
    q.push(Claim(team="b", tokens=1), "b0")
    assert _drain(q) == ["a0", "a1", "a2", "b0"]


def test_a_tie_goes_to_the_team_with_fewer_running() -> None:
    """A team lifted to the waiting team's counter is level in past service only: the team
    already holding slots loses the tie, so the newcomer gets the next slot."""
    q: FairQueue[str] = FairQueue()
    a = Claim(team="a", tokens=10)
    for _ in range(3):
        q.admitted(a)  # three of a's requests hold slots
    q.push(a, "a0")
    q.push(Claim(team="b", tokens=10), "b0")
    assert q.counter("a") == q.counter("b") == 30
    assert _drain(q) == ["b0", "a0"]


def test_a_full_queue_makes_room_from_the_team_that_fills_it() -> None:
    q: FairQueue[str] = FairQueue()
    a = Claim(team="a", tokens=10)
    for i in range(4):
        q.push(a, f"a{i}")
    evicted = q.make_room(Claim(team="b", tokens=10))
    assert evicted is not None and evicted.item == "a3"  # a's newest
    assert len(q) == 3 and q.waiting("a") == 3
    assert q.make_room(a) is None  # a itself is refused, it fills the queue
    q.push(Claim(team="b", tokens=10), "b0")
    q.push(Claim(team="b", tokens=10), "b1")
    # b waits 2, a 3: one beyond b's own is not enough to refuse a for b
    assert q.make_room(Claim(team="b", tokens=10)) is None
    assert q.make_room(Claim(team="c", tokens=10)).item == "a2"  # type: ignore[union-attr]
