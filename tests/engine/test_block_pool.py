"""BlockPool: reference counts, prefix cache lookups, LRU eviction order, KV events."""

import pytest

from engine.block_pool import BlockPool, BlockRemoved, BlockStored, NoFreeBlocksError


def test_allocate_free_and_refcounts() -> None:
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_count(b) == 1 for b in a)
    pool.touch([a[0]])
    pool.free(a)
    assert pool.ref_count(a[0]) == 1 and pool.num_free == 3
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(4)
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free([a[1]])


def test_cached_blocks_survive_until_reused_lru_first() -> None:
    pool = BlockPool(3, 2, record_events=True)
    b = pool.allocate(3)
    for i, blk in enumerate(b):
        pool.cache(blk, 100 + i, None, [i, i])
    pool.free([b[2], b[0], b[1]])  # freed in this order: b2 is the least recently freed
    assert pool.lookup(101) == b[1]
    # A hit on a free cached block takes it out of the free list.
    pool.touch([b[1]])
    assert pool.num_free == 2
    got = pool.allocate(1)
    assert got == [b[2]] and pool.lookup(102) is None and pool.lookup(100) == b[0]
    events = pool.drain_events()
    assert [type(e) for e in events] == [BlockStored] * 3 + [BlockRemoved]
    assert events[-1].block_hashes == [102]


def test_duplicate_hash_keeps_first_copy() -> None:
    pool = BlockPool(2, 2)
    a, b = pool.allocate(2)
    pool.cache(a, 7, None, [1, 2])
    pool.cache(b, 7, None, [1, 2])
    assert pool.lookup(7) == a and pool.num_cached == 1
