"""The pool of KV blocks: reference counts, the prefix cache, LRU eviction.

A block is free when no request references it (ref count 0). Free blocks stay in the prefix
cache (still findable by hash) until they are reused; `_free` is ordered least recently freed
first, and reuse takes from that end, so the blocks evicted first are the ones idle longest.
Requests free their blocks tail first, so a prompt's later blocks are evicted before its
earlier ones (a shared prefix outlives the suffixes hanging off it).

Each block may carry the content digest of its KV (protocol/kv_digest.py), set by the KV
manager when the block's KV is written and cleared when the block is handed out again; a block
found corrupt is `uncache`d (its hash forgotten, so the next request recomputes it).

Spill: with an `on_evict` hook, a cached block about to be reused is offered to it first (its id,
hash and digest, while its bytes are still intact); a hook that kept a copy (engine/kv_tiers.py)
records its own event, and only the blocks it did not keep are reported removed.

Retention: with a `retained` predicate (engine/retention.py), a free cached block whose hash a
client asked to keep is passed over while a free block that is not retained remains; when only
retained ones are left, the least recently freed goes (to the spill hook, like any other).

Invariants: a block id is in `_free` iff its ref count is 0; `_cached[h] == b` implies
`_hash[b] == h`; a digest belongs to the content of the block that holds it (reset on
allocation); every change to the set of cached hashes is appended to `events` (vLLM's
BlockStored/BlockRemoved, with their `medium`) for the node to forward to the coordinator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

#: (block id, block hash, digest or None) → True when a lower tier kept a copy
EvictHook = Callable[[int, int, "int | None"], bool]
#: block hash → whether a client asked to keep it now
Retained = Callable[[int], bool]


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    #: where the blocks now are: None for this pool, else a spill tier ("host", "disk")
    medium: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    #: the tier the blocks left (None: this pool); either way the node holds them no more
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        record_events: bool = False,
        on_evict: EvictHook | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.on_evict = on_evict
        self.retained: Retained | None = None
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._digest: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[int, int] = {}
        self.record_events = record_events
        self.events: list[KVEvent] = []

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def digest(self, block_id: int) -> int | None:
        """The content digest of the block's KV, if it was taken since the block was handed out."""
        return self._digest[block_id]

    def set_digest(self, block_id: int, digest: int) -> None:
        self._digest[block_id] = digest

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    # -- mutations -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (evicting the least recently freed cached ones)."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out = []
        removed = []
        for _ in range(n):
            b = self._take()
            h = self._hash[b]
            if h is not None:
                self._hash[b] = None
                if self._cached.get(h) == b:
                    del self._cached[h]
                    kept = self.on_evict is not None and self.on_evict(b, h, self._digest[b])
                    if not kept:
                        removed.append(h)
            self._digest[b] = None
            self._ref[b] = 1
            out.append(b)
        if removed and self.record_events:
            self.events.append(BlockRemoved(block_hashes=removed))
        return out

    def _take(self) -> int:
        """The least recently freed block, passing over retained cached ones (moved to the
        recent end) while a block that is not retained is free."""
        keep = self.retained
        if keep is not None:
            for _ in range(len(self._free)):
                b = next(iter(self._free))
                h = self._hash[b]
                if h is None or not keep(h):
                    del self._free[b]
                    return b
                self._free.move_to_end(b)
        return self._free.popitem(last=False)[0]

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix-cache hit on a block that may be free)."""
        for b in block_ids:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; pass them in the order they should be evicted."""
        for b in block_ids:
            r = self._ref[b] - 1
            if r < 0:
                raise AssertionError(f"block {b} freed more often than referenced")
            self._ref[b] = r
            if r == 0:
                self._free[b] = None

    def cache(
        self, block_id: int, block_hash: int, parent: int | None, token_ids: list[int]
    ) -> None:
        """Register a full block under its hash (a duplicate of an already cached hash is left
        uncached: the first copy keeps serving hits)."""
        if self._hash[block_id] is not None or block_hash in self._cached:
            return
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.record_events:
            stored = BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=parent,
                token_ids=token_ids,
                block_size=self.block_size,
            )
            self.events.append(stored)

    def uncache(self, block_id: int) -> bool:
        """Forget a cached block's hash and digest (its KV was found corrupt): the next request
        for that prefix recomputes it. False if the block was not cached."""
        h = self._hash[block_id]
        self._digest[block_id] = None
        if h is None:
            return False
        self._hash[block_id] = None
        if self._cached.get(h) == block_id:
            del self._cached[h]
            if self.record_events:
                self.events.append(BlockRemoved(block_hashes=[h]))
        return True

    def reset_cache(self) -> bool:
        """Forget every cached hash (only when nothing is in use, as vLLM does)."""
        if self.num_used:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        self._digest = [None] * self.num_blocks
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def record(self, event: KVEvent) -> None:
        """Append an event another part of the KV hierarchy made (a spill tier's move)."""
        if self.record_events:
            self.events.append(event)

    def drain_events(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out
