"""Retained blocks: prompt prefixes a client asked the node to keep (protocol/retention.py).

A retention is a set of block hashes (salted by the request's cache domain and adapter, as the
KV manager salts them: two teams never retain each other's blocks) with an expiry; asking again
for a hash renews it to the later of the two. Retained blocks are not referenced: a request may
still take their pool blocks, but only when no free block that is not retained is left
(engine/block_pool.py `allocate`), and then the block spills to a tier, where it is never
dropped while retained (engine/kv_tiers.py). A hash may be retained before it is cached (the
request that computes it is still queued): the retention covers it once it is.

Owned by the engine thread, like the pool; `tick` forgets what ran out, at most once a second
(the predicate reads the clock itself, so a stale entry never counts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from protocol.block_hash import block_hashes, domain_root
from protocol.sampling import SamplingParams

#: seconds between two sweeps of expired retentions
_SWEEP_S = 1.0


class Retention:
    def __init__(
        self, block_size: int, hash_seed: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._until: dict[int, float] = {}
        self._clock = clock
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._until)

    def retain_prompt(self, ids: Sequence[int], params: SamplingParams) -> int:
        """Retain the full blocks of the prompt prefix `params.retain` names (none: nothing);
        returns how many blocks."""
        r = params.retain
        if r is None:
            return 0
        n = min(r.tokens, len(ids)) // self.block_size * self.block_size
        root = domain_root(params.cache_salt, self.hash_seed, params.lora_name)
        return self.retain(block_hashes(ids[:n], self.block_size, self.hash_seed, root), r.ttl_s)

    def retain(self, hashes: Sequence[int], ttl_s: float) -> int:
        """Retain each of `hashes` for at least `ttl_s` from now; returns how many."""
        until = self._clock() + ttl_s
        for h in hashes:
            if self._until.get(h, 0.0) < until:
                self._until[h] = until
        return len(hashes)

    def __call__(self, block_hash: int) -> bool:
        """Whether `block_hash` is retained now (the pool's and the tiers' predicate)."""
        until = self._until.get(block_hash)
        return until is not None and until > self._clock()

    def tick(self) -> int:
        """Forget the retentions that ran out (at most once per `_SWEEP_S`); returns how many."""
        now = self._clock()
        if now < self._next_sweep:
            return 0
        self._next_sweep = now + _SWEEP_S
        gone = [h for h, u in self._until.items() if u <= now]
        for h in gone:
            del self._until[h]
        return len(gone)
