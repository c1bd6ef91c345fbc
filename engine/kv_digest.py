"""The bytes of a pool's blocks, for digests and for the spill tiers' copies.

`PoolBytes` sees the KV pool tensor as `num_blocks` byte rows of `block_bytes` each (the pool
is block-major: DESIGN §3), whatever the KV dtype: a block's size comes from the pool's layout,
never from a dtype assumed here, so an 8-bit KV pool (its scales inside its blocks) is digested
and spilled by the same code. On a host pool a block's view is zero-copy (a memoryview onto the
tensor's memory); on a device pool it is copied to the host first.

Invariant: a view is valid only until the block is written again; callers hash or copy it at
once (on the engine thread, between steps, when nothing writes the pool).
"""

from __future__ import annotations

import torch

from protocol.kv_digest import block_digest


class PoolBytes:
    def __init__(self, pool: torch.Tensor) -> None:
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be one contiguous tensor")
        self.num_blocks = pool.shape[0]
        self._raw = pool.view(torch.uint8).reshape(self.num_blocks, -1)
        self.block_bytes = self._raw.shape[1]
        self.on_host = pool.device.type == "cpu"

    def row(self, block_id: int) -> torch.Tensor:
        """The block as a uint8 tensor of `block_bytes` (a view into the pool)."""
        return self._raw[block_id]

    def view(self, block_id: int) -> memoryview:
        """The block's bytes (zero-copy on a host pool)."""
        row = self._raw[block_id]
        return (row if self.on_host else row.cpu()).numpy().data.cast("B")

    def write(self, block_id: int, data: memoryview) -> None:
        """Overwrite the block with `data` (`block_bytes` long). On a host pool a plain memcpy on
        this thread: a tensor copy would wake torch's thread pool for every block, which costs
        milliseconds on a busy machine."""
        if self.on_host:
            self._raw[block_id].numpy().data.cast("B")[:] = data
        else:
            self._raw[block_id].copy_(torch.frombuffer(data, dtype=torch.uint8))

    def digest(self, block_id: int, chain_hash: int, domain_root: int) -> int:
        return block_digest(self.view(block_id), chain_hash, domain_root)
