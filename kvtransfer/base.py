"""The `Transport` interface: one node's KV pool, its peers, block reads and notifications.

Every backend (nixl, ucx, tcp) implements the same semantics because the checks live here
and the backends only fill in `_register/_connect/_read/_notify/...`:

- `register_pool` once, before anything else; `metadata()` is then what the node serves at
  `GET /kv/metadata`.
- `add_peer` refuses a peer whose backend or KV layout differs *before* connecting (a
  `LayoutMismatch` names each differing field), and caches peers per engine id: the same
  metadata again returns the same `Peer`, new metadata for a known engine id (a restarted
  node) replaces it.
- `read` validates ids on both sides before any byte moves, then completes or raises a
  `TransferError` within `timeout` seconds, never hangs. With `landed`, the backend calls it
  with local block ids as their bytes are in place for good (each block once, in request order,
  possibly from the backend's posting thread), so a caller can work on the first blocks while
  the rest are still moving (kvtransfer/hashed_read.py hashes them); a backend that cannot tell
  calls it once, at the end. A peer-level failure (timeout,
  dead or misbehaving peer) drops the peer from the cache, so the next request re-fetches
  its metadata instead of reusing a broken connection.
- A failed `read` whose backend could not stop the copy in time (a NIXL transfer still in
  flight) says so: the `TransferError` carries `settled`, an awaitable that completes once no
  byte can land in the local blocks any more (None: nothing can). The caller must not reuse
  those blocks before (the decode node quarantines them).
- `notify` sends a small bytes message to a peer; the peer receives it with
  `next_notification()` / `drain_notifications()`. The queue is bounded
  (MAX_QUEUED_NOTIFICATIONS): when nobody reads it the oldest messages are dropped, logged.
- Bounded state: at most MAX_PEERS peers stay connected (least recently used dropped first),
  and per-peer connection locks live only while a connection is being set up.

All methods run on the caller's asyncio loop; backends move bytes without blocking it.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

from kvtransfer.errors import (
    LayoutMismatch,
    PeerError,
    TransferError,
    TransferTimeout,
)
from kvtransfer.memory import PoolMemory, PoolTensor, advise_hugepages, describe_pool
from kvtransfer.metadata import (
    Notification,
    TransportMetadata,
    decode_metadata,
    encode_metadata,
)
from kvtransfer.metrics import KVTransferMetrics
from kvtransfer.regions import ReadPlan, plan_read
from protocol.kv_layout import KVLayout

log = logging.getLogger(__name__)

#: Notifications are control messages ("release request r"), not a data path.
MAX_NOTIFICATION_BYTES = 64 * 1024

DEFAULT_TIMEOUT = 10.0
#: Notifications kept for a reader; older ones are dropped beyond this.
MAX_QUEUED_NOTIFICATIONS = 4096
#: Connected peers kept; the least recently used is disconnected beyond this.
MAX_PEERS = 256

#: `read`'s callback: these local blocks hold their final bytes (see the module docstring)
Landed = Callable[[Sequence[int]], None]


class Peer:
    """A remote pool this node can read from; returned by `Transport.add_peer`."""

    def __init__(self, metadata: TransportMetadata) -> None:
        self.metadata = metadata
        self.engine_id = metadata.engine_id
        self.layout = metadata.layout
        self.alive = True  # False once dropped from the cache (failure, replacement, close)

    def __repr__(self) -> str:
        state = "" if self.alive else ", dropped"
        return f"<{type(self).__name__} {self.engine_id!r} {self.metadata.backend}{state}>"


class Transport(abc.ABC):
    backend: ClassVar[str]

    def __init__(
        self,
        *,
        engine_id: str,
        metrics: KVTransferMetrics | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        hugepages: bool = True,
    ) -> None:
        if not engine_id:
            raise ValueError("engine_id must be a non-empty string")
        self.engine_id = engine_id
        self.metrics = metrics if metrics is not None else KVTransferMetrics()
        self.timeout = timeout
        self._hugepages = hugepages
        self._pool: PoolMemory | None = None
        self._peers: OrderedDict[str, Peer] = OrderedDict()
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._notifications: asyncio.Queue[Notification] = asyncio.Queue(MAX_QUEUED_NOTIFICATIONS)
        self.notifications_dropped = 0
        #: local block ids of a failed read → awaitable done when it can no longer write them
        self._late_writes: dict[tuple[int, ...], Awaitable[Any]] = {}
        self._closed = False

    # -- backend hooks ---------------------------------------------------------------

    @abc.abstractmethod
    async def _register(self, pool: PoolMemory) -> None: ...

    @abc.abstractmethod
    def _metadata_fields(self) -> dict[str, Any]:
        """Backend part of the metadata: `agent_metadata` or `host`/`port`."""

    @abc.abstractmethod
    async def _connect(self, metadata: TransportMetadata) -> Peer: ...

    @abc.abstractmethod
    async def _disconnect(self, peer: Peer) -> None:
        """Release what `_connect` set up; must not raise."""

    @abc.abstractmethod
    async def _read(self, peer: Peer, plan: ReadPlan, landed: Landed | None) -> None:
        """Move the blocks; on cancellation, stop writing into local blocks if possible. Call
        `landed` (when given) for every block once its bytes are final, before returning."""

    @abc.abstractmethod
    async def _notify(self, peer: Peer, message: bytes) -> None: ...

    @abc.abstractmethod
    async def _close(self) -> None: ...

    # -- pool ------------------------------------------------------------------------

    @property
    def pool(self) -> PoolMemory:
        if self._pool is None:
            raise TransferError("no KV pool registered yet: call register_pool() first")
        return self._pool

    @property
    def layout(self) -> KVLayout:
        return self.pool.layout

    async def register_pool(
        self, pool: int | PoolTensor, layout: KVLayout, device: str | None = None
    ) -> None:
        """Register this node's KV pool, once: a base address (int) or a contiguous tensor.

        `device` is "cpu" or "cuda:N" (taken from the tensor when one is given).
        """
        self._check_open()
        if self._pool is not None:
            raise TransferError("a KV pool is already registered with this transport")
        mem = describe_pool(pool, layout, device)
        if self._hugepages and not mem.is_cuda:
            # Collapsing touched pages copies them: seconds for a large pool, so off the loop.
            await asyncio.to_thread(advise_hugepages, mem.base, mem.nbytes)
        await self._register(mem)
        self._pool = mem

    def expect_reads(self, seconds: float) -> None:
        """Peers may read our blocks within `seconds` (a prefill node holding a lease). A backend
        whose progress comes from the event loop stays responsive meanwhile; others ignore it."""
        return None  # a hook, not an abstract method: most backends need nothing here

    def metadata(self) -> TransportMetadata:
        pool = self.pool
        return TransportMetadata(
            engine_id=self.engine_id,
            backend=self.backend,
            layout=pool.layout,
            compat_hash=pool.layout.compat_hash,
            device=pool.device,
            base_address=pool.base,
            **self._metadata_fields(),
        )

    def metadata_bytes(self) -> bytes:
        """The body of `GET /kv/metadata`."""
        return encode_metadata(self.metadata())

    # -- peers -----------------------------------------------------------------------

    def check_compatible(self, metadata: TransportMetadata) -> None:
        """Raise unless blocks can move between `metadata`'s pool and ours (no I/O)."""
        if metadata.backend != self.backend:
            raise PeerError(
                f"peer {metadata.engine_id!r} serves its KV pool over {metadata.backend!r}, "
                f"this node uses {self.backend!r}; configure both with the same backend"
            )
        differences = self.layout.differences(metadata.layout)
        if not differences and metadata.compat_hash != self.layout.compat_hash:
            differences = [f"compat_hash: {metadata.compat_hash} != {self.layout.compat_hash}"]
        if differences:
            raise LayoutMismatch(metadata.engine_id, differences)

    async def add_peer(
        self, metadata: TransportMetadata | bytes | str, *, timeout: float | None = None
    ) -> Peer:
        """Connect to a peer from its metadata (a struct, or the bytes of GET /kv/metadata)."""
        self._check_open()
        md = metadata if isinstance(metadata, TransportMetadata) else decode_metadata(metadata)
        if md.engine_id == self.engine_id:
            raise PeerError(f"engine id {md.engine_id!r} is this node's own; refusing to loop back")
        self.check_compatible(md)  # before any connection: nothing moves on a mismatch
        lock = self._peer_locks.setdefault(md.engine_id, asyncio.Lock())
        try:
            return await self._add_peer_locked(md, lock, timeout)
        finally:
            # Locks only live while someone connects: the dict stays as small as the traffic.
            if (
                not lock.locked()
                and not lock._waiters
                and self._peer_locks.get(md.engine_id) is lock
            ):
                del self._peer_locks[md.engine_id]

    async def _add_peer_locked(
        self, md: TransportMetadata, lock: asyncio.Lock, timeout: float | None
    ) -> Peer:
        async with lock:
            cached = self._peers.get(md.engine_id)
            if cached is not None and cached.metadata == md:
                self._peers.move_to_end(md.engine_id)
                return cached
            if cached is not None:
                log.info("peer %r published new metadata; reconnecting", md.engine_id)
                await self._drop(cached)
            limit = self.timeout if timeout is None else timeout
            try:
                async with asyncio.timeout(limit):
                    peer = await self._connect(md)
            except TransferError:
                raise
            except TimeoutError:
                raise TransferTimeout(
                    f"connecting to peer {md.engine_id!r} timed out after {limit:g} s"
                ) from None
            except Exception as e:
                raise PeerError(f"cannot connect to peer {md.engine_id!r}: {e}") from e
            self._peers[md.engine_id] = peer
            while len(self._peers) > MAX_PEERS:
                oldest = next(iter(self._peers.values()))
                log.info(
                    "more than %d peers: disconnecting the least recently used, %r",
                    MAX_PEERS,
                    oldest.engine_id,
                )
                await self._drop(oldest)
            return peer

    def get_peer(self, engine_id: str) -> Peer | None:
        return self._peers.get(engine_id)

    @property
    def peers(self) -> dict[str, Peer]:
        return dict(self._peers)

    async def remove_peer(self, peer: Peer | str) -> None:
        """Forget a peer (e.g. its node left the cluster); later reads need add_peer again."""
        engine_id = peer if isinstance(peer, str) else peer.engine_id
        cached = self._peers.get(engine_id)
        if cached is not None:
            await self._drop(cached)

    async def _drop(self, peer: Peer) -> None:
        if self._peers.get(peer.engine_id) is peer:
            del self._peers[peer.engine_id]
        if peer.alive:
            peer.alive = False
            await self._disconnect(peer)

    def _resolve(self, peer: Peer | str) -> Peer:
        self._check_open()
        if isinstance(peer, str):
            found = self._peers.get(peer)
            if found is None:
                raise PeerError(f"unknown peer {peer!r}: add_peer() it from its metadata first")
            return found
        if not peer.alive:
            raise PeerError(
                f"peer {peer.engine_id!r} was dropped (after a failure or new metadata); "
                "fetch its metadata and add_peer() it again"
            )
        return peer

    # -- data ------------------------------------------------------------------------

    def plan(
        self, peer: Peer | str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]
    ) -> ReadPlan:
        """Validate and coalesce a read without performing it (raises BlockRangeError)."""
        return plan_read(
            remote_block_ids,
            local_block_ids,
            remote_layout=self._resolve(peer).layout,
            local_layout=self.layout,
        )

    async def read(
        self,
        peer: Peer | str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        *,
        timeout: float | None = None,
        landed: Landed | None = None,
    ) -> None:
        """Copy the peer's blocks `remote_block_ids[i]` into local `local_block_ids[i]`.

        Completes when every byte is in place, or raises a `TransferError` (after `timeout`
        seconds at most, default `self.timeout`, plus what a local copy already under way
        needs to stop: nothing writes the local blocks once this returns or raises); after an
        error the local blocks' content is undefined. `landed`: see the module docstring (a
        failed read may have called it for some blocks; their bytes are then worth nothing).
        """
        p = self._resolve(peer)
        plan = self.plan(p, remote_block_ids, local_block_ids)
        if plan.num_blocks == 0:
            return
        limit = self.timeout if timeout is None else timeout
        t0 = time.perf_counter()
        try:
            await self._guarded(
                p, self._read(p, plan, landed), limit, f"reading {plan.num_blocks} blocks"
            )
        except TransferError as e:
            e.settled = self._late_writes.pop(plan.local_ids, None)
            raise
        finally:
            self._late_writes.pop(plan.local_ids, None)
        self.metrics.record(plan.nbytes, time.perf_counter() - t0, plan.num_blocks)

    def _late_write(self, plan: ReadPlan, settled: Awaitable[Any]) -> None:
        """Backends: the read of `plan` failed but may still write its local blocks until
        `settled` completes (surfaced as the TransferError's `settled`)."""
        self._late_writes[plan.local_ids] = settled

    async def notify(
        self, peer: Peer | str, message: bytes, *, timeout: float | None = None
    ) -> None:
        """Send a small message to the peer; it arrives in the peer's notification queue."""
        p = self._resolve(peer)
        if len(message) > MAX_NOTIFICATION_BYTES:
            raise TransferError(
                f"notification of {len(message)} bytes exceeds {MAX_NOTIFICATION_BYTES}"
            )
        limit = self.timeout if timeout is None else timeout
        await self._guarded(p, self._notify(p, bytes(message)), limit, "notifying")

    async def _guarded(self, peer: Peer, work: Any, limit: float, what: str) -> None:
        try:
            async with asyncio.timeout(limit):
                await work
        except asyncio.CancelledError:
            raise
        except TransferError as e:
            self.metrics.record_failure("peer" if isinstance(e, PeerError) else "error")
            await self._drop(peer)
            raise
        except TimeoutError:
            self.metrics.record_failure("timeout")
            await self._drop(peer)
            raise TransferTimeout(
                f"{what} from/to peer {peer.engine_id!r} timed out after {limit:g} s"
            ) from None
        except Exception as e:
            self.metrics.record_failure("peer")
            await self._drop(peer)
            raise PeerError(f"{what} from/to peer {peer.engine_id!r} failed: {e}") from e

    # -- notifications ---------------------------------------------------------------

    def _deliver(self, notification: Notification) -> None:
        if self._notifications.full():  # nobody reads: keep the newest, count what is lost
            self._notifications.get_nowait()
            self.notifications_dropped += 1
            if self.notifications_dropped in (1, 10, 100) or self.notifications_dropped % 1000 == 0:
                log.warning(
                    "notification queue full (%d): dropped %d so far",
                    MAX_QUEUED_NOTIFICATIONS,
                    self.notifications_dropped,
                )
        self._notifications.put_nowait(notification)

    async def next_notification(self, timeout: float | None = None) -> Notification:
        """The next message a peer sent us; raises TimeoutError after `timeout` seconds."""
        if timeout is None:
            return await self._notifications.get()
        try:
            async with asyncio.timeout(timeout):
                return await self._notifications.get()
        except TimeoutError:  # a distinct class before Python 3.11
            raise TimeoutError(f"no notification within {timeout:g} s") from None

    def drain_notifications(self) -> list[Notification]:
        out = []
        while not self._notifications.empty():
            out.append(self._notifications.get_nowait())
        return out

    # -- lifecycle -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("transport is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Disconnect every peer and release the pool registration; idempotent."""
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            await self._drop(peer)
        await self._close()

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
