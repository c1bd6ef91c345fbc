"""Where spilled KV blocks live: a host-memory slab and a directory of files.

`HostStore` is one preallocated uint8 tensor of `slots × block_bytes` (pinned when the pool is
on a GPU, so copies back are fast); a slot holds one block. `DiskStore` keeps one file per block,
`<hash:016x>.kv` under its directory: a header (magic, format version, the block hash, the
payload's length) then the block's bytes, written to a temporary name and renamed, so a reader
never sees a torn file. Reading checks the header names the block asked for and the length the
layout says: a file holding another block (a stale name, a bug) is refused before any byte is
used, whatever its digest. The content digest is kept in memory by the tiers (engine/kv_tiers.py),
never trusted from the file.

The directory is this node's alone: at start every `*.kv` file left in it (by an earlier process,
whose index is gone) is removed.
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import torch

_MAGIC = b"DKVB"
_VERSION = 1
_HEADER = struct.Struct("<4sIQQ")


class StoreError(Exception):
    """A spilled block could not be read back as written (missing, torn, another block's)."""


class HostStore:
    def __init__(self, slots: int, block_bytes: int, pinned: bool = False) -> None:
        self.slots = slots
        self.block_bytes = block_bytes
        self._slab = torch.empty((max(slots, 0), block_bytes), dtype=torch.uint8)
        if pinned and slots:
            self._slab = self._slab.pin_memory()
        self._mv = self._slab.numpy().data.cast("B")
        self._free = list(range(slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def put(self, src: memoryview) -> int:
        """Copy a block's bytes into a free slot (a memcpy on this thread); returns the slot."""
        slot = self._free.pop()
        self.get(slot)[:] = src
        return slot

    def get(self, slot: int) -> memoryview:
        """The slot's bytes (a view: copy them out before the slot is freed)."""
        bb = self.block_bytes
        return self._mv[slot * bb : (slot + 1) * bb]

    def free(self, slot: int) -> None:
        self._free.append(slot)


class DiskStore:
    def __init__(self, directory: Path, block_bytes: int) -> None:
        self.dir = Path(directory)
        self.block_bytes = block_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("*.kv"):
            with contextlib.suppress(OSError):
                stale.unlink()

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}.kv"

    def write(self, block_hash: int, data: memoryview) -> None:
        """Store a block's bytes under its hash (raises OSError: disk full, unwritable)."""
        path = self.path(block_hash)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, _VERSION, block_hash, len(data)))
            f.write(data)
        os.replace(tmp, path)

    def read_into(self, block_hash: int, target: memoryview) -> None:
        """Read the block stored under `block_hash` into `target` (`block_bytes` long)."""
        try:
            with open(self.path(block_hash), "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    raise StoreError("the file is shorter than its header")
                magic, version, stored, n = _HEADER.unpack(head)
                if magic != _MAGIC or version != _VERSION:
                    raise StoreError("not a KV block file of this format")
                if stored != block_hash:
                    raise StoreError(f"the file holds block {stored:016x}")
                if n != self.block_bytes or f.readinto(target) != n:
                    raise StoreError(f"the file holds {n} bytes, the layout {self.block_bytes}")
        except OSError as e:
            raise StoreError(str(e)) from e

    def delete(self, block_hash: int) -> None:
        with contextlib.suppress(OSError):
            self.path(block_hash).unlink()
