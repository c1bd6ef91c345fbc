"""The spill tiers below a node's KV pool: host memory, then disk (DESIGN §9, the KV hierarchy).

A cached block the pool is about to reuse (its least recently freed) is offered to `spill`
first: its bytes are copied to the host tier, whose least recently used unpinned entry moves to
the disk tier when the host is full, whose own least recently used entry is dropped when the
disk is full. With no host budget a spill goes straight to disk; with neither, blocks are
dropped as before. A request whose prefix continues in a tier after its pool hit gets those
blocks back (`load`, into pool blocks its KV manager allocated, before the request computes);
the KV manager checks each against its digest before it counts.

Tiers are exclusive: a hash lives in at most one of pool, host, disk. `load` takes the entry out
(the pool holds the block again); `discard` forgets one the pool computed anew. Pins (`pin` /
`unpin`) keep entries a request is about to load from being moved or dropped meanwhile (the
allocations for that load can spill other blocks). Retained blocks (a client's `cache_control`,
engine/retention.py, through the `retained` predicate) are never chosen to make room while
another entry can go: a retained host entry only moves down to disk, and a disk tier full of
retained entries keeps no new block rather than drop one of them.

Events: every change of where a block is goes to `emit` (the pool's event list): a spill or a
demotion is a `BlockStored` with its new `medium`, a drop a `BlockRemoved` with the medium it
left. A load records nothing here: the pool's `BlockStored` of the block moves it back. Plain
Python over two stores (engine/kv_stores.py), so its bookkeeping is tested exactly.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.block_pool import BlockPool, BlockRemoved, BlockStored, KVEvent, Retained
from engine.config import EngineConfig, parse_size
from engine.kv_digest import PoolBytes
from engine.kv_stores import DiskStore, HostStore, StoreError

log = logging.getLogger("duet.engine")


class Medium(enum.StrEnum):
    HOST = "host"
    DISK = "disk"


@dataclass
class _Entry:
    digest: int
    #: host slot (host tier only)
    slot: int = -1
    pins: int = 0


class KVTiers:
    def __init__(
        self,
        pool: PoolBytes,
        block_size: int,
        host: HostStore | None = None,
        disk: DiskStore | None = None,
        disk_blocks: int = 0,
        emit: Callable[[KVEvent], None] | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.host = host if host is not None and host.slots > 0 else None
        self.disk = disk if disk is not None and disk_blocks > 0 else None
        self.disk_blocks = disk_blocks if self.disk is not None else 0
        self.emit = emit
        #: oldest first (the LRU end) in each
        self._host: OrderedDict[int, _Entry] = OrderedDict()
        self._disk: OrderedDict[int, _Entry] = OrderedDict()
        #: blocks moved, by kind: spilled / demoted / dropped / loaded, "<kind>_<medium>"
        self.moves: Counter[str] = Counter()
        #: block hash → a client asked to keep it now (None: nothing is retained)
        self.retained: Retained | None = None

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def __len__(self) -> int:
        return len(self._host) + len(self._disk)

    def where(self, block_hash: int) -> Medium | None:
        if block_hash in self._host:
            return Medium.HOST
        if block_hash in self._disk:
            return Medium.DISK
        return None

    def hashes(self, medium: Medium) -> list[int]:
        return list(self._host if medium is Medium.HOST else self._disk)

    def _event(self, ev: KVEvent) -> None:
        if self.emit is not None:
            self.emit(ev)

    def _stored(self, h: int, medium: Medium) -> None:
        self._event(BlockStored([h], None, [], self.block_size, medium=medium.value))

    def _removed(self, h: int, medium: Medium) -> None:
        self.moves[f"dropped_{medium}"] += 1
        self._event(BlockRemoved([h], medium=medium.value))

    # -- spilling --------------------------------------------------------------------------
    def spill(self, block_id: int, block_hash: int, digest: int | None) -> bool:
        """The pool's eviction hook: keep a copy of the block in the highest tier with room.
        A block without a digest is not kept (it could not be checked when it comes back)."""
        if digest is None or not self.enabled or self.where(block_hash) is not None:
            return False
        if self.host is not None and self._room_on_host():
            slot = self.host.put(self.pool.view(block_id))
            self._host[block_hash] = _Entry(digest, slot)
            self.moves["spilled_host"] += 1
            self._stored(block_hash, Medium.HOST)
            return True
        if self._to_disk(block_hash, digest, self.pool.view(block_id)):
            self.moves["spilled_disk"] += 1
            return True
        return False

    def _room_on_host(self) -> bool:
        """A free host slot, after moving the least recently used unpinned entry down."""
        assert self.host is not None
        if self.host.num_free:
            return True
        victim = self._victim(self._host, retained_too=self.disk is not None)
        if victim is None:
            return False
        e = self._host.pop(victim)
        if self._to_disk(victim, e.digest, self.host.get(e.slot)):
            self.moves["demoted_disk"] += 1
        elif self._keeps(victim):  # retained: stays on the host rather than be dropped
            self._host[victim] = e
            self._host.move_to_end(victim, last=False)
            return False
        else:
            self._removed(victim, Medium.HOST)
        self.host.free(e.slot)
        return True

    def _keeps(self, block_hash: int) -> bool:
        return self.retained is not None and self.retained(block_hash)

    def _victim(self, tier: OrderedDict[int, _Entry], retained_too: bool = False) -> int | None:
        """The least recently used entry that may make room: unpinned, and not retained while
        another can go (`retained_too`: one retained may go when none else can)."""
        fallback = None
        for h, e in tier.items():
            if e.pins:
                continue
            if not self._keeps(h):
                return h
            if fallback is None:
                fallback = h
        return fallback if retained_too else None

    def _to_disk(self, block_hash: int, digest: int, data: memoryview) -> bool:
        """Write a block to the disk tier (dropping its LRU unpinned entry when full)."""
        if self.disk is None:
            return False
        if len(self._disk) >= self.disk_blocks:
            victim = self._victim(self._disk)
            if victim is None:
                return False
            del self._disk[victim]
            self.disk.delete(victim)
            self._removed(victim, Medium.DISK)
        try:
            self.disk.write(block_hash, data)
        except OSError as e:
            log.warning("could not spill a KV block to %s: %s", self.disk.dir, e)
            return False
        self._disk[block_hash] = _Entry(digest)
        self._stored(block_hash, Medium.DISK)
        return True

    # -- loading ---------------------------------------------------------------------------
    def pin(self, block_hash: int) -> None:
        e = self._host.get(block_hash) or self._disk.get(block_hash)
        if e is not None:
            e.pins += 1

    def unpin(self, block_hash: int) -> None:
        e = self._host.get(block_hash) or self._disk.get(block_hash)
        if e is not None and e.pins:
            e.pins -= 1

    def load(self, block_hash: int, block_id: int) -> tuple[Medium, int] | None:
        """Copy a spilled block into pool block `block_id` and take it out of its tier.
        Returns its medium and the digest it was spilled with (the caller checks the bytes
        against it), or None when the block cannot be read back (then it is dropped)."""
        if (e := self._host.pop(block_hash, None)) is not None:
            assert self.host is not None
            self.pool.write(block_id, self.host.get(e.slot))
            self.host.free(e.slot)
            self.moves["loaded_host"] += 1
            return Medium.HOST, e.digest
        if (e := self._disk.pop(block_hash, None)) is not None:
            assert self.disk is not None
            try:
                self._read_disk(block_hash, block_id)
            except StoreError as err:
                log.warning("dropping spilled KV block %016x: %s", block_hash, err)
                self._removed(block_hash, Medium.DISK)
                return None
            finally:
                self.disk.delete(block_hash)
            self.moves["loaded_disk"] += 1
            return Medium.DISK, e.digest
        return None

    def _read_disk(self, block_hash: int, block_id: int) -> None:
        assert self.disk is not None
        if self.pool.on_host:
            self.disk.read_into(block_hash, self.pool.row(block_id).numpy().data)
            return
        staged = bytearray(self.pool.block_bytes)
        self.disk.read_into(block_hash, memoryview(staged))
        self.pool.write(block_id, memoryview(staged))

    def drop(self, block_hash: int, medium: Medium) -> None:
        """Report a loaded block that failed its digest as gone from this node."""
        self._removed(block_hash, medium)

    def discard(self, block_hash: int) -> None:
        """The pool holds `block_hash` again (computed anew): forget the spilled copy (the
        pool's own BlockStored already moved it)."""
        if (e := self._host.pop(block_hash, None)) is not None:
            assert self.host is not None
            self.host.free(e.slot)
        elif block_hash in self._disk:
            del self._disk[block_hash]
            assert self.disk is not None
            self.disk.delete(block_hash)

    def clear(self) -> None:
        """Forget every spilled block (the pool's prefix cache was reset: its AllBlocksCleared
        event tells the coordinator). No entry may be pinned: a reset runs with no request."""
        for e in self._host.values():
            assert self.host is not None
            self.host.free(e.slot)
        for h in self._disk:
            assert self.disk is not None
            self.disk.delete(h)
        self._host.clear()
        self._disk.clear()

    def stats(self) -> dict[str, float]:
        bb = self.pool.block_bytes
        return {
            "kv_host_blocks": len(self._host),
            "kv_host_bytes": len(self._host) * bb,
            "kv_disk_blocks": len(self._disk),
            "kv_disk_bytes": len(self._disk) * bb,
            **{f"kv_tier_{k}": v for k, v in self.moves.items()},
        }


def build_tiers(config: EngineConfig, pool: PoolBytes, blocks: BlockPool) -> KVTiers | None:
    """The engine's spill tiers from its config (None when both budgets are 0), hooked into
    the pool's evictions and event list."""
    host_slots = parse_size(config.kv_host_bytes) // pool.block_bytes
    disk_blocks = parse_size(config.kv_disk_bytes) // pool.block_bytes
    if parse_size(config.kv_host_bytes) and not host_slots:
        raise ValueError(
            f"kv_host_bytes {config.kv_host_bytes} holds no block of {pool.block_bytes} bytes"
        )
    if parse_size(config.kv_disk_bytes) and not disk_blocks:
        raise ValueError(
            f"kv_disk_bytes {config.kv_disk_bytes} holds no block of {pool.block_bytes} bytes"
        )
    if disk_blocks and not config.kv_disk_dir:
        raise ValueError("a disk tier (kv_disk_bytes) needs its directory (kv_disk_dir)")
    if not host_slots and not disk_blocks:
        return None
    host = HostStore(host_slots, pool.block_bytes, pinned=not pool.on_host) if host_slots else None
    disk = DiskStore(Path(config.kv_disk_dir or ""), pool.block_bytes) if disk_blocks else None
    tiers = KVTiers(pool, blocks.block_size, host, disk, disk_blocks, emit=blocks.record)
    blocks.on_evict = tiers.spill
    log.info(
        "KV spill tiers: host %d blocks (%.0f MiB), disk %d blocks (%.0f MiB)%s",
        host_slots,
        host_slots * pool.block_bytes / 2**20,
        disk_blocks,
        disk_blocks * pool.block_bytes / 2**20,
        f" under {config.kv_disk_dir}" if disk_blocks else "",
    )
    return tiers
