"""Block ids → byte ranges of a block-major pool, in one place for every backend.

The pool is `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, so block `b`
is the one range `[base + b * block_bytes, base + (b + 1) * block_bytes)` (KVLayout).

`plan_read` validates a read request before any byte moves (equal lengths, every id in
range on its side, no destination block twice; a source block may repeat) and turns it into
`Run`s: maximal stretches where both the remote and the local ids go up by one, so a
transfer of N blocks is usually far fewer than N memory regions. Backends that move one
stream per side (tcp) can instead coalesce each side on its own (`side_runs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvtransfer.errors import BlockRangeError
from protocol.kv_layout import KVLayout


class Run(NamedTuple):
    """`num_blocks` consecutive blocks from `remote_start` on the peer to `local_start` here.
    (Not `count`: that field would hide the tuple's own `count` method.)"""

    remote_start: int
    local_start: int
    num_blocks: int


class Span(NamedTuple):
    """`num_blocks` consecutive blocks from `start`, on one side."""

    start: int
    num_blocks: int


class ReadPlan(NamedTuple):
    remote_ids: tuple[int, ...]
    local_ids: tuple[int, ...]
    block_bytes: int
    runs: tuple[Run, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.local_ids)

    @property
    def nbytes(self) -> int:
        return len(self.local_ids) * self.block_bytes

    def part(self, start: int, stop: int | None = None) -> ReadPlan:
        """The read of blocks `start:stop` of this one (in request order)."""
        remote, local = self.remote_ids[start:stop], self.local_ids[start:stop]
        return ReadPlan(remote, local, self.block_bytes, coalesce(remote, local))

    def tapering(self, tail_blocks: int) -> list[ReadPlan]:
        """The same read as consecutive plans, in order, each as large as all those after it,
        the last two of `tail_blocks` (16 blocks, tail 1: 8, 4, 2, 1, 1): a few parts, the last
        one small, and each part about twice the next, whose copy takes about as long as
        hashing it does."""
        sizes: list[int] = []
        left, size = self.num_blocks, max(1, tail_blocks)
        while left > 0:
            sizes.append(min(size, left))
            left -= sizes[-1]
            size = sum(sizes)
        parts, start = [], 0
        for n in reversed(sizes):
            parts.append(self.part(start, start + n))
            start += n
        return parts


def _check_ids(ids: Sequence[int], num_blocks: int, side: str) -> tuple[int, ...]:
    out = []
    for b in ids:
        # bool is an int subclass; a True slipping through as block 1 would be a silent bug.
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise BlockRangeError(f"{side} block id {b!r} is not an integer")
        if not 0 <= b < num_blocks:
            raise BlockRangeError(
                f"{side} block id {b} is out of range [0, {num_blocks}) of the {side} pool"
            )
        out.append(int(b))
    return tuple(out)


def plan_read(
    remote_ids: Sequence[int],
    local_ids: Sequence[int],
    *,
    remote_layout: KVLayout,
    local_layout: KVLayout,
) -> ReadPlan:
    """Validate a read of `remote_ids` (peer) into `local_ids` (here) and coalesce it."""
    if len(remote_ids) != len(local_ids):
        raise BlockRangeError(
            f"remote_block_ids has {len(remote_ids)} ids but local_block_ids has "
            f"{len(local_ids)}; they must pair up one to one"
        )
    if remote_layout.block_bytes != local_layout.block_bytes:
        raise BlockRangeError(
            f"block sizes differ: remote {remote_layout.block_bytes} B, "
            f"local {local_layout.block_bytes} B"
        )
    remote = _check_ids(remote_ids, remote_layout.num_blocks, "remote")
    local = _check_ids(local_ids, local_layout.num_blocks, "local")
    seen: set[int] = set()
    for b in local:
        if b in seen:
            raise BlockRangeError(
                f"local block id {b} appears more than once; two sources would race into it"
            )
        seen.add(b)
    return ReadPlan(remote, local, local_layout.block_bytes, coalesce(remote, local))


def coalesce(remote: Sequence[int], local: Sequence[int]) -> tuple[Run, ...]:
    """Pair runs where both sides are consecutive, in request order."""
    runs: list[Run] = []
    i, n = 0, len(remote)
    while i < n:
        j = i + 1
        while j < n and remote[j] == remote[j - 1] + 1 and local[j] == local[j - 1] + 1:
            j += 1
        runs.append(Run(remote[i], local[i], j - i))
        i = j
    return tuple(runs)


def side_runs(ids: Sequence[int]) -> tuple[Span, ...]:
    """Coalesce one side alone (in request order): for backends that stream each side."""
    spans: list[Span] = []
    i, n = 0, len(ids)
    while i < n:
        j = i + 1
        while j < n and ids[j] == ids[j - 1] + 1:
            j += 1
        spans.append(Span(ids[i], j - i))
        i = j
    return tuple(spans)


def block_range(layout: KVLayout, start: int, count: int = 1) -> tuple[int, int]:
    """(offset, length) in bytes of `count` blocks from `start`, relative to the pool base."""
    if count < 1 or start < 0 or start + count > layout.num_blocks:
        raise BlockRangeError(
            f"blocks [{start}, {start + count}) are outside the pool [0, {layout.num_blocks})"
        )
    return start * layout.block_bytes, count * layout.block_bytes


def block_descriptors(base: int, layout: KVLayout, device_id: int = 0) -> np.ndarray:
    """One `(address, length, device_id)` row per block, for NIXL descriptor lists.

    Row `b` is block `b`, so a list of block ids indexes the prepared list directly.
    """
    bb = layout.block_bytes
    rows = np.empty((layout.num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(layout.num_blocks, dtype=np.uint64) * np.uint64(bb)
    rows[:, 1] = bb
    rows[:, 2] = device_id
    return rows
