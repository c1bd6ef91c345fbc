"""The API-key cache against a real SQLite store: found keys are served from memory for the
TTL, revocations through this gateway take effect at once (even racing a lookup), revocations
elsewhere within the TTL, an unknown key asks the store once per TTL, and the cache is bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.accounts.key_cache import KeyCache
from gateway.accounts.keys import hash_secret, new_key
from gateway.accounts.store import open_store
from gateway.accounts.store.base import Store, Team


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def store(tmp_path: Path) -> Store:
    s = open_store(f"sqlite://{tmp_path / 'keys.db'}")
    await s.open()
    await s.create_team(Team(id="t"))
    await s.create_team(Team(id="u"))
    yield s
    await s.close()


async def _key(store: Store, team: str = "t") -> tuple[str, str]:
    key, secret, digest = new_key(team, "test")
    await store.create_key(key, digest)
    return key.id, hash_secret(secret)


async def test_a_key_revoked_elsewhere_works_until_the_ttl_then_fails(store: Store) -> None:
    clock = Clock()
    cache = KeyCache(store, ttl_s=5.0, clock=clock)
    kid, h = await _key(store)
    assert (await cache.lookup(h))[0].id == kid
    await store.revoke_key(kid)  # as `duet keys revoke` or another gateway would
    clock.t += 4.9
    assert (await cache.lookup(h)) is not None, "within the TTL the cached key is trusted"
    clock.t += 0.2
    assert await cache.lookup(h) is None, "past the TTL the store is asked again"
    assert len(cache) == 0


async def test_revoking_through_this_gateway_takes_effect_at_once(store: Store) -> None:
    cache = KeyCache(store, ttl_s=60.0, clock=Clock())
    kid, h = await _key(store)
    other_id, other = await _key(store)
    _, team_u = await _key(store, "u")
    assert await cache.lookup(h) and await cache.lookup(other) and await cache.lookup(team_u)
    await store.revoke_key(kid)
    cache.forget_key(kid)
    assert await cache.lookup(h) is None
    assert (await cache.lookup(other))[0].id == other_id
    await store.delete_team("u")
    cache.forget_team("u")
    assert await cache.lookup(team_u) is None
    assert (await cache.lookup(other))[0].id == other_id


class Gated:
    """The real store, with its key lookups held until `gate` opens (to land a revocation
    between a lookup's question and its answer, deterministically)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.gate = asyncio.Event()
        self.asked = asyncio.Event()

    async def key_by_hash(self, h: str) -> object:
        found = await self.store.key_by_hash(h)
        self.asked.set()
        await self.gate.wait()
        return found


async def test_a_lookup_racing_a_revocation_does_not_cache_the_old_answer(store: Store) -> None:
    gated = Gated(store)
    cache = KeyCache(gated, ttl_s=60.0, clock=Clock())  # type: ignore[arg-type]
    kid, h = await _key(store)
    lookup = asyncio.ensure_future(cache.lookup(h))
    await asyncio.wait_for(gated.asked.wait(), 10)  # the store has answered "found"…
    await store.revoke_key(kid)
    cache.forget_key(kid)  # …and the revocation lands before that answer reaches the cache
    gated.gate.set()
    assert await lookup is not None  # the in-flight answer predates the revocation
    assert len(cache) == 0, "the pre-revocation answer must not be cached"
    assert await cache.lookup(h) is None


class Counting:
    """The real store, counting its key lookups."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.asked = 0

    async def key_by_hash(self, h: str) -> object:
        self.asked += 1
        return await self.store.key_by_hash(h)


async def test_an_unknown_key_asks_the_store_once_per_ttl(store: Store) -> None:
    """A client repeating a bad key made one store query per request (the store's one worker
    thread, or a pool of 10 on PostgreSQL, shared with every reservation and heartbeat)."""
    counting, clock = Counting(store), Clock()
    cache = KeyCache(counting, ttl_s=5.0, max_entries=3, clock=clock)  # type: ignore[arg-type]
    bogus = hash_secret("sk-duet-not-a-key")
    for _ in range(100):
        assert await cache.lookup(bogus) is None
    assert counting.asked == 1
    clock.t += 5.1
    assert await cache.lookup(bogus) is None
    assert counting.asked == 2, "past the TTL the store is asked again"
    for i in range(10):  # bounded: other unknown keys push the oldest out
        await cache.lookup(hash_secret(f"sk-duet-other-{i}"))
    assert await cache.lookup(bogus) is None and counting.asked == 13


async def test_a_new_key_works_at_once_beside_remembered_unknown_keys(store: Store) -> None:
    cache = KeyCache(store, ttl_s=60.0, clock=Clock())
    assert await cache.lookup(hash_secret("sk-duet-not-a-key")) is None
    key, secret, digest = new_key("t", "later")
    await store.create_key(key, digest)  # created by the CLI or another gateway
    assert (await cache.lookup(hash_secret(secret)))[0].id == key.id


async def test_ttl_zero_asks_the_store_every_time(store: Store) -> None:
    cache = KeyCache(store, ttl_s=0.0)
    kid, h = await _key(store)
    assert await cache.lookup(h) is not None
    await store.revoke_key(kid)
    assert await cache.lookup(h) is None
    assert len(cache) == 0


async def test_the_cache_is_bounded_least_recently_used_first(store: Store) -> None:
    cache = KeyCache(store, ttl_s=60.0, max_entries=3, clock=Clock())
    keys = [await _key(store) for _ in range(4)]
    for _, h in keys[:3]:
        await cache.lookup(h)
    await cache.lookup(keys[0][1])  # used again: the least recently used is now keys[1]
    await cache.lookup(keys[3][1])
    assert len(cache) == 3
    await store.revoke_key(keys[1][0])
    await store.revoke_key(keys[0][0])
    assert await cache.lookup(keys[1][1]) is None, "evicted: asked the store, which says revoked"
    assert await cache.lookup(keys[0][1]) is not None, "kept: still served from memory"
