"""API-key lookups without a store round trip per request: a bounded TTL cache of found keys.

Every request authenticates; asking the store each time put a database round trip (a worker
thread hop for SQLite, a network round trip for PostgreSQL) on every request's time to first
token. The cache keeps `(key, team)` for keys that were found, for `[server] key_cache_ttl_s`.

Invariants:
- an unknown key's hash is remembered as unknown for the same TTL (at most `max_entries` of
  them): a client repeating a bad or revoked key asks the store once per TTL, not once per
  request. A key created anywhere still works at once: its secret is new random bytes, so no
  lookup of its hash can have come before its creation;
- a key revoked or a team deleted through *this* gateway stops working at once (`forget_key`,
  `forget_team`), and a lookup that was in flight during the revocation does not put the old
  answer back (the generation check);
- a key revoked elsewhere (another gateway, `duet keys revoke`) stops working within the TTL;
  `key_cache_ttl_s = 0` turns the cache off;
- at most `max_entries` keys are held (least recently used go first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from gateway.accounts.store.base import ApiKey, Store, Team

Found = tuple[ApiKey, Team]
V = TypeVar("V")


class KeyCache:
    def __init__(
        self,
        store: Store,
        ttl_s: float,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, Found]] = OrderedDict()
        #: hashes the store did not know, with when that answer expires
        self._unknown: OrderedDict[str, float] = OrderedDict()
        #: bumped by every forget: a lookup started before one must not cache its answer
        self._generation = 0

    def cached(self, secret_hash: str) -> Found | None:
        """The key's (key, team) if this cache holds it found and fresh; None otherwise (not
        known to be unknown: ask `lookup`)."""
        hit = self._entries.get(secret_hash)
        if hit is None:
            return None
        if hit[0] <= self._clock():
            del self._entries[secret_hash]
            return None
        self._entries.move_to_end(secret_hash)
        return hit[1]

    async def lookup(self, secret_hash: str) -> Found | None:
        if self.ttl_s <= 0:
            return await self.store.key_by_hash(secret_hash)
        hit = self.cached(secret_hash)
        if hit is not None:
            return hit
        now = self._clock()
        unknown_until = self._unknown.get(secret_hash)
        if unknown_until is not None:
            if unknown_until > now:
                return None
            del self._unknown[secret_hash]
        generation = self._generation
        found = await self.store.key_by_hash(secret_hash)
        if found is None:
            self._remember(self._unknown, secret_hash, now + self.ttl_s)
        elif generation == self._generation:
            self._remember(self._entries, secret_hash, (now + self.ttl_s, found))
        return found

    def _remember(self, entries: OrderedDict[str, V], secret_hash: str, value: V) -> None:
        entries[secret_hash] = value
        entries.move_to_end(secret_hash)
        if len(entries) > self.max_entries:
            entries.popitem(last=False)

    def forget_key(self, key_id: str) -> None:
        self._forget(lambda f: f[0].id == key_id)

    def forget_team(self, team_id: str) -> None:
        self._forget(lambda f: f[1].id == team_id)

    def _forget(self, match: Callable[[Found], bool]) -> None:
        self._generation += 1
        for h in [h for h, (_, f) in self._entries.items() if match(f)]:
            del self._entries[h]

    def __len__(self) -> int:
        return len(self._entries)
