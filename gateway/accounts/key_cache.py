"""API-key lookups without a store round trip per request: a bounded TTL cache of found keys.

Every request authenticates; asking the store each time put a database round trip (a worker
thread hop for SQLite, a network round trip for PostgreSQL) on every request's time to first
token. The cache keeps `(key, team)` for keys that were found, for `[server] key_cache_ttl_s`.

Invariants:
- only keys that exist are cached: an unknown key asks the store every time, so a key created
  by another gateway or the CLI works at once;
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

from gateway.accounts.store.base import ApiKey, Store, Team

Found = tuple[ApiKey, Team]


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
        #: bumped by every forget: a lookup started before one must not cache its answer
        self._generation = 0

    async def lookup(self, secret_hash: str) -> Found | None:
        if self.ttl_s <= 0:
            return await self.store.key_by_hash(secret_hash)
        now = self._clock()
        hit = self._entries.get(secret_hash)
        if hit is not None:
            if hit[0] > now:
                self._entries.move_to_end(secret_hash)
                return hit[1]
            del self._entries[secret_hash]
        generation = self._generation
        found = await self.store.key_by_hash(secret_hash)
        if found is not None and generation == self._generation:
            self._entries[secret_hash] = (now + self.ttl_s, found)
            if len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return found

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
