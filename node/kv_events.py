"""The node's KV event log: `GET /kv/events?since=SEQ` and `GET /kv/snapshot` (DESIGN §4).

A poller drains the engine's BlockPool events (recorded when EngineConfig.record_kv_events)
on the engine thread every `POLL_INTERVAL_S`, numbers each non-empty drain as one
`EventBatch` (seq 1, 2, ...) and keeps the last `ring_size` batches. Stream readers get the
batches after their `since`, then new ones as they come, and a `LoadFrame` at least every
`LOAD_INTERVAL_S` (protocol/kv_events.py documents the wire format). Each load frame names the
requests the engine took since the stream's previous one (`taken`, from a ring of the last
`TAKEN_RING` ids; a new stream starts with the whole ring, so a reconnect loses no ack), and
coordinators drop their pending reservations for those routes on it. Load frames also carry
the node's measured TTFT / ITL P90 over its recent window, with the window's histogram
(`latency`: node/latency_window.py; TTFT on prefill and colocated nodes, ITL on decode and
colocated ones — a decode leg's first token waits on a KV pull, which is not the client's TTFT),
and the engine's busy fraction over the same window where it reports busy seconds
(node/busy_window.py; the planner's n − 1 test for prefill pools).

Invariants: seq numbers have no gaps; the snapshot is taken on the engine thread in the same
call that drains pending events, under the same lock as the poller, so "snapshot at seq S"
means exactly "all batches ≤ S applied" and the reader continues with `since=S`. A reader
that falls behind the ring has its stream closed, so it reconnects and resyncs. A node whose
engine failed ends every stream and refuses new ones (503), so coordinators stop routing to it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypedDict

import msgspec
from aiohttp import web

from node.busy_window import BusyWindow
from node.engine_api import KVEventDrain
from node.metrics import NodeMetrics
from protocol.kv_events import (
    CONTENT_TYPE,
    LOAD_INTERVAL_S,
    EventBatch,
    KVReuse,
    KVSnapshot,
    LoadFrame,
    encode_frame,
)
from protocol.latency_hist import LatencyHistogram
from protocol.openai import APIError

log = logging.getLogger("duet.node")
POLL_INTERVAL_S = 0.1
RING_SIZE = 4096
#: X-Request-Ids kept for load frames' `taken` (a stream further behind misses some: those
#: reservations expire at the coordinator's pending_max_age_s instead)
TAKEN_RING = 1024


class LatencyFields(TypedDict, total=False):
    """A load frame's measured-latency fields (LoadFrame's names): TTFT ones on a node that
    makes first tokens, ITL ones on a node that decodes."""

    latency_window_s: float
    ttft_p90_s: float
    ttft_samples: int
    ttft_hist: LatencyHistogram
    itl_p90_s: float
    itl_samples: int
    itl_hist: LatencyHistogram


class ResidencyFields(TypedDict):
    """A load frame's LoRA adapters and sleep state (None: an engine without them)."""

    lora_adapters: list[str] | None
    sleeping: bool | None


class KVEventLog:
    def __init__(
        self,
        engine: Any,
        engine_id: str,
        block_size: int,
        recording: bool,
        ring_size: int = RING_SIZE,
        latency: Callable[[], LatencyFields] | None = None,
    ) -> None:
        self.engine = engine
        #: the measured-latency fields of a load frame (LoadFrame's ttft_* / itl_* names)
        self.latency = latency
        self.engine_id = engine_id
        self.block_size = block_size
        self.recording = recording
        self.seq = 0
        self.queued_prefill_tokens = 0
        self._ring: collections.deque[EventBatch] = collections.deque(maxlen=ring_size)
        self._lock = asyncio.Lock()
        self._new = asyncio.Event()
        self.closed = False
        self._taken: collections.deque[str] = collections.deque(maxlen=TAKEN_RING)
        #: ids ever passed to took(): a stream's position in the `taken` ring
        self.taken_n = 0
        self.busy = BusyWindow()

    # -- engine side -----------------------------------------------------------------------
    async def _pull(self, snapshot: bool) -> KVEventDrain:
        async with self._lock:
            drained = await self.engine.drain_kv_events(snapshot)
            self.queued_prefill_tokens = drained.queued_prefill_tokens
            if drained.events:
                self.seq += 1
                self._ring.append(EventBatch(seq=self.seq, ts=time.time(), events=drained.events))
                self._new.set()
                self._new = asyncio.Event()
            return drained

    async def poll(self) -> None:
        await self._pull(snapshot=False)

    async def snapshot(self) -> KVSnapshot:
        drained = await self._pull(snapshot=True)
        assert drained.block_hashes is not None
        tiered = drained.tiered_hashes or {}
        return KVSnapshot(
            engine_id=self.engine_id,
            block_size=self.block_size,
            seq=self.seq,
            block_hashes=drained.block_hashes,
            host_block_hashes=tiered.get("host", []),
            disk_block_hashes=tiered.get("disk", []),
        )

    def took(self, request_id: str) -> None:
        """The engine took (queued, or refused) the request `request_id`: called on the loop once
        `add_request` returned, so every load frame built after this counts it."""
        self._taken.append(request_id)
        self.taken_n += 1

    def taken_since(self, n: int) -> list[str]:
        """The ids taken after the first `n` (as much of them as the ring still holds)."""
        k = min(self.taken_n - n, len(self._taken))
        return list(self._taken)[len(self._taken) - k :] if k > 0 else []

    # -- reader side -----------------------------------------------------------------------
    def after(self, since: int) -> list[EventBatch] | None:
        """Batches with seq > since, or None when the ring no longer holds seq since+1."""
        if since > self.seq:
            return None
        if since == self.seq:
            return []
        first = self._ring[0].seq if self._ring else self.seq + 1
        if since + 1 < first:
            return None
        return list(self._ring)[since + 1 - first :]

    def close(self) -> None:
        """The node is shutting down: end every stream, so shutdown does not wait on them."""
        self.closed = True
        self._new.set()

    async def wait_new(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._new.wait()

    def load(self, stats: dict[str, float], seq: int, taken: list[str]) -> LoadFrame:
        # the engine thread's time in steps and in the node's own work between steps that left
        # work (engine/async_engine.py StepTiming); an engine without them (vLLM) reports none
        busy_s = stats.get("engine_step_seconds")
        if busy_s is not None:
            busy_s += stats.get("engine_step_gap_seconds", 0.0)
        return LoadFrame(
            seq=seq,
            ts=time.time(),
            taken=taken,
            busy=self.busy.observe(float(busy_s)) if busy_s is not None else None,
            num_requests_waiting=int(stats.get("num_requests_waiting", 0)),
            num_requests_running=int(stats.get("num_requests_running", 0)),
            kv_cache_usage_perc=float(stats.get("kv_cache_usage_perc", 0.0)),
            # the engine's own snapshot when it has one (native: as of its last step
            # or added request, so a frame that acks a request counts its tokens);
            # else the last drain's (up to POLL_INTERVAL_S and a step old)
            queued_prefill_tokens=int(
                stats.get("queued_prefill_tokens", self.queued_prefill_tokens)
            ),
            kv_blocks_free=int(stats.get("kv_blocks_free", 0)),
            kv_blocks_total=int(stats.get("kv_blocks_total", 0)),
            reuse=_reuse(stats),
            **(self.latency() if self.latency is not None else LatencyFields()),
            **residency(self.engine),
        )


def _reuse(stats: dict[str, float]) -> KVReuse | None:
    """The engine's reuse counters for a load frame (None when it keeps none)."""
    if "kv_reuse_queries" not in stats:
        return None
    return KVReuse(
        prompt_tokens=int(stats["kv_reuse_queries"]),
        **{t: int(stats.get(f"kv_reused_tokens_{t}", 0)) for t in ("pool", "host", "disk", "peer")},
    )


KV_EVENTS = web.AppKey("kv_events", KVEventLog)


def residency(engine: Any) -> ResidencyFields:
    """A load frame's LoRA adapters and sleep state (node/lora.py, node/sleep.py)."""
    from node.lora import lora_engine
    from node.sleep import sleeping_engine

    lora, sleeper = lora_engine(engine), sleeping_engine(engine)
    return ResidencyFields(
        lora_adapters=None if lora is None else lora.lora_names(),
        sleeping=None if sleeper is None else sleeper.is_sleeping,
    )


def measured_latency(metrics: NodeMetrics, role: str) -> Callable[[], LatencyFields]:
    """The load frame's measured figures for a node of `role`: TTFT where it makes first tokens
    for clients (prefill, both), ITL where it decodes (decode, both) — each a P90, its sample
    count and the window's histogram (the planner merges the histograms over a pool)."""

    def figures() -> LatencyFields:
        out = LatencyFields(latency_window_s=metrics.recent_ttft.window_s)
        if role in ("prefill", "both"):
            w = metrics.recent_ttft.window()
            out.update(LatencyFields(ttft_p90_s=w.p90_s, ttft_samples=w.samples, ttft_hist=w.hist))
        if role in ("decode", "both"):
            w = metrics.recent_itl.window()
            out.update(LatencyFields(itl_p90_s=w.p90_s, itl_samples=w.samples, itl_hist=w.hist))
        return out

    return figures


def _since(request: web.Request) -> int:
    raw = request.query.get("since")
    if raw is None:
        raise APIError(
            400,
            "query parameter 'since' is required (the last event batch seq you "
            "applied; 0 after a snapshot at seq 0)",
            param="since",
        )
    try:
        since = int(raw)
    except ValueError:
        raise APIError(
            400, f"'since' must be a non-negative integer, got {raw[:40]!r}", param="since"
        ) from None
    if since < 0:
        raise APIError(400, f"'since' must be a non-negative integer, got {since}", param="since")
    return since


async def _events(request: web.Request) -> web.StreamResponse:
    kv = request.app[KV_EVENTS]
    since = _since(request)
    if not kv.recording:
        raise APIError(
            409,
            "this node does not record KV events (it records them when it runs with --etcd)",
            code="kv_events_disabled",
        )
    if kv.engine.dead is not None:  # a failed engine must stop being routed to
        raise APIError(503, f"engine failed: {kv.engine.dead!r}", type_="service_unavailable")
    if kv.after(since) is None:
        raise APIError(
            410,
            f"since={since} is outside this node's event log (last seq {kv.seq}, "
            f"{len(kv._ring)} batches kept): resync from GET /kv/snapshot",
            param="since",
            code="resync_required",
        )
    resp = web.StreamResponse(
        headers={"Content-Type": CONTENT_TYPE, "X-Duet-Engine-Id": kv.engine_id}
    )
    await resp.prepare(request)
    enc = msgspec.msgpack.Encoder()
    pos, last_load = since, 0.0
    taken_pos = kv.taken_n - len(kv._taken)  # the whole ring: acks made while this reader was away
    while not kv.closed and kv.engine.dead is None:
        batches = kv.after(pos)
        if batches is None:  # this reader fell behind the ring: close, it reconnects and resyncs
            log.warning(
                "KV event reader %s fell behind the event log; closing its stream", request.remote
            )
            break
        for b in batches:
            await resp.write(encode_frame(enc, b))
            pos = b.seq
        now = time.monotonic()
        if now - last_load >= LOAD_INTERVAL_S:
            # the ids first: one taken after this line is in the next frame, never lost
            taken, taken_pos = kv.taken_since(taken_pos), kv.taken_n
            await resp.write(encode_frame(enc, kv.load(kv.engine.stats(), pos, taken)))
            last_load = now
        await kv.wait_new(LOAD_INTERVAL_S - (time.monotonic() - last_load))
    return resp


async def _snapshot(request: web.Request) -> web.Response:
    snap = await request.app[KV_EVENTS].snapshot()
    return web.Response(body=msgspec.json.encode(snap), content_type="application/json")


def add_kv_event_routes(app: web.Application, state: Any) -> None:
    """Serve `/kv/events` and `/kv/snapshot` from `state.engine`; the poller starts with the app
    (register after the cleanup context that starts the engine)."""
    recording = bool(state.config.engine.record_kv_events)
    kv = KVEventLog(
        state.engine,
        state.engine_id,
        state.config.engine.block_size,
        recording,
        latency=measured_latency(state.metrics, state.config.role),
    )
    app[KV_EVENTS] = kv
    app.router.add_get("/kv/events", _events)
    app.router.add_get("/kv/snapshot", _snapshot)

    async def close_streams(_: web.Application) -> None:
        kv.close()

    app.on_shutdown.append(close_streams)
    if not recording:  # a standalone node: nobody reads the stream, keep the engine thread idle
        return

    async def poller(_: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            failed = False
            while True:
                try:
                    await kv.poll()
                    failed = False
                except Exception as e:  # an engine failure shows in /health; keep the log quiet
                    if not failed:
                        log.warning("cannot read KV events from the engine: %r", e)
                    failed = True
                await asyncio.sleep(POLL_INTERVAL_S)

        task = asyncio.create_task(loop(), name="kv-events-poller")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(poller)
