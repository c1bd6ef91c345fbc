"""Test pools: host memory filled with a pattern unique per (owner seed, byte position).

Word `i` of a pool (as uint64) is `seed << 48 | i`, so a block read from the wrong peer,
the wrong block or at the wrong offset never compares equal, and `block_words` says what
any block of any seeded pool must hold. numpy only: peer processes start without torch.
"""

from __future__ import annotations

import mmap

import numpy as np

from protocol.kv_layout import KVLayout

#: Small blocks keep two-process tests fast: 2·2·16·2·64·2 B = 16 KiB per block.
TEST_LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16", num_blocks=600
)


class HostPool:
    """An mmap'd pool (page aligned, like an engine's) viewed as uint8 blocks."""

    def __init__(self, layout: KVLayout, seed: int) -> None:
        self.layout = layout
        self.seed = seed
        # Private anonymous memory, like a torch allocation (huge-page advice applies to it).
        self._mm = mmap.mmap(-1, layout.pool_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.bytes = np.frombuffer(self._mm, dtype=np.uint8)
        words = self.bytes.view(np.uint64)
        words[:] = np.arange(words.size, dtype=np.uint64) | (np.uint64(seed) << np.uint64(48))
        self.blocks = self.bytes.reshape(layout.num_blocks, layout.block_bytes)

    @property
    def base(self) -> int:
        return int(self.bytes.ctypes.data)


def block_words(layout: KVLayout, seed: int, block_id: int) -> np.ndarray:
    """The pattern block `block_id` of a pool filled with `seed` holds, as uint8."""
    n = layout.block_bytes // 8
    words = np.arange(block_id * n, (block_id + 1) * n, dtype=np.uint64)
    return (words | (np.uint64(seed) << np.uint64(48))).view(np.uint8)


def assert_blocks(pool: HostPool, local_ids: list[int], seed: int, remote_ids: list[int]) -> None:
    """Local blocks hold the seeded owner's remote blocks, byte for byte."""
    for local, remote in zip(local_ids, remote_ids, strict=True):
        expected = block_words(pool.layout, seed, remote)
        if not np.array_equal(pool.blocks[local], expected):
            raise AssertionError(f"local block {local} does not hold block {remote} of seed {seed}")


def assert_untouched(pool: HostPool, skip: set[int]) -> None:
    """Every block not in `skip` still holds this pool's own pattern."""
    for b in range(pool.layout.num_blocks):
        if b not in skip and not np.array_equal(
            pool.blocks[b], block_words(pool.layout, pool.seed, b)
        ):
            raise AssertionError(f"block {b} was written though no read targeted it")
