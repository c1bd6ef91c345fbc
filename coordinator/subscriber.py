"""Follows one node's KV event stream into the prefix index and the node's load.

Loop: take `GET /kv/snapshot` (every block the node holds, as of batch S), replace the node's
entries in the index, then read `GET /kv/events?since=S`. Event batches must arrive with
seq = last + 1; a gap, a 410 (since outside the node's ring), an engine id that changed (the
node restarted) or any reconnect starts over from a fresh snapshot, so the index converges to
the node's real cache. A stream silent for `read_timeout` (no load frame) counts as broken.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import msgspec

from coordinator.index import PrefixIndex
from coordinator.nodes import NodeView
from protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    FrameDecoder,
    KVSnapshot,
    LoadFrame,
)

log = logging.getLogger("duet.coordinator")


class Resync(Exception):
    """The stream cannot continue from where the index is; take a snapshot."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def apply_batch(index: PrefixIndex, node_id: str, batch: EventBatch) -> None:
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            index.store(node_id, ev.block_hashes, ev.medium)
        elif isinstance(ev, BlockRemoved):
            index.remove(node_id, ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            index.clear_node(node_id)


class Subscriber:
    def __init__(
        self,
        view: NodeView,
        session: aiohttp.ClientSession,
        index: PrefixIndex,
        *,
        settle_s: float,
        read_timeout: float = 5.0,
        on_resync: Callable[[str], None] = lambda reason: None,
        on_lag: Callable[[float], None] = lambda lag: None,
    ) -> None:
        self.view = view
        self.session = session
        self.index = index
        self.settle_s = settle_s
        self.read_timeout = read_timeout
        self.on_resync = on_resync
        self.on_lag = on_lag
        self._snapshot_decoder = msgspec.json.Decoder(KVSnapshot)

    async def _snapshot(self) -> int:
        url = self.view.info.url + "/kv/snapshot"
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=3)
        async with self.session.get(url, timeout=timeout) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(
                    r.request_info, (), status=r.status, message=(await r.text())[:300]
                )
            snap = self._snapshot_decoder.decode(await r.read())
        self.index.replace_node(
            self.view.node_id,
            snap.block_hashes,
            [("host", snap.host_block_hashes), ("disk", snap.disk_block_hashes)],
        )
        self.view.seq, self.view.engine_id = snap.seq, snap.engine_id
        return snap.seq

    async def _stream(self) -> None:
        v = self.view
        url = f"{v.info.url}/kv/events?since={v.seq}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=self.read_timeout)
        async with self.session.get(url, timeout=timeout) as r:
            if r.status == 410:
                raise Resync("since_outside_ring")
            if r.status != 200:
                raise aiohttp.ClientResponseError(
                    r.request_info, (), status=r.status, message=(await r.text())[:300]
                )
            if r.headers.get("X-Duet-Engine-Id") != v.engine_id:
                raise Resync("engine_changed")
            dec = FrameDecoder()
            async for chunk in r.content.iter_any():
                for frame in dec.feed(chunk):
                    now = time.monotonic()
                    if isinstance(frame, EventBatch):
                        if frame.seq != v.seq + 1:
                            raise Resync("gap")
                        apply_batch(self.index, v.node_id, frame)
                        v.seq = frame.seq
                        v.last_event_lag_s = max(0.0, time.time() - frame.ts)
                        self.on_lag(v.last_event_lag_s)
                    elif isinstance(frame, LoadFrame):
                        if frame.seq != v.seq:  # a load frame always follows the batches it counts
                            raise Resync("gap")
                        v.connected = True
                        v.on_load(frame, now, self.settle_s)
        raise Resync("stream_ended")

    async def run(self) -> None:
        v = self.view
        backoff, reason, failing, last_resync = 0.2, "connect", False, 0.0
        while True:
            try:
                await self._snapshot()
                if failing:
                    log.info("node %s: KV event stream back", v.node_id)
                failing = False
                v.resyncs += 1
                self.on_resync(reason)
                await self._stream()
            except Resync as e:
                reason = e.reason
                v.connected = False
                log.info("node %s: KV index resync (%s)", v.node_id, reason)
                backoff = 0.2
                if time.monotonic() - last_resync < 1.0:  # resyncing in a loop: do not spin
                    await asyncio.sleep(0.2)
                last_resync = time.monotonic()
                continue
            except (TimeoutError, aiohttp.ClientError, ValueError, msgspec.DecodeError) as e:
                v.connected = False
                reason = "reconnect"
                if not failing:
                    log.warning(
                        "node %s (%s): KV event stream failed: %r; retrying",
                        v.node_id,
                        v.info.url,
                        e,
                    )
                failing = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            except Exception:  # a bug must not silently stop this node's updates
                v.connected = False
                reason = "error"
                log.exception("node %s: KV event stream handling failed; resyncing", v.node_id)
                await asyncio.sleep(1.0)
