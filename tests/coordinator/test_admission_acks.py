"""Admission accounting against a node's own load frames: a route's reservation counts exactly
until the node's frame shows the request.

A real coordinator (its app on a free port, registered against the real etcd of
tests/conftest.py) follows a fake decode node over the real protocol: the node serves the real
`/kv/snapshot` and `/kv/events` handlers of node/kv_events.py, whose engine is a stand-in that
reports the free blocks the test sets. The test plays the node's engine: it "takes" a routed
request (`KVEventLog.took`, what node/leg_context.py calls once the engine queued it) and sets
the free blocks the request holds, then frees them when it finishes. Routes land between load
frames, and every step waits for a frame the coordinator has received (each carries a marker in
`kv_cache_usage_perc`), never for a clock.

Before the fix, a reservation counted until the first frame `pending_settle_s` after the route:
with frames lagging that long, the blocks of requests the node had already taken — and
finished — were subtracted again from frames that counted them (126 blocks pending with one
63-block request in flight; four such and a 256-block node refuses the fifth, "4 free blocks <
63", as CI's "-23 free blocks < 2"). The reverse also held: with a short settle time, a frame
that did not yet show a request ended its reservation anyway.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from coordinator.app import make_app
from coordinator.etcd_server import EtcdServer
from coordinator.etcd_store import EtcdStore
from coordinator.route_config import PolicyConfig
from coordinator.service import CoordinatorConfig
from node.engine_api import KVEventDrain
from node.kv_events import KV_EVENTS, KVEventLog, add_kv_event_routes
from node.metrics import NodeMetrics
from protocol.cluster import NodeInfo, node_key
from runtime.ports import free_port
from tests.wait import until

BLOCKS = 256
BLOCK = 16
#: a route of 500 prompt + 500 generated tokens needs 63 blocks of 16: four fit in 256, five not
PROMPT, MAX_TOKENS, NEED = 500, 500, 63
MODEL = "fake-model"


class FakeEngine:
    """The engine side the node's KV event log reads: no prefix-cache events, the load the test
    sets. `usage` is the frame marker the test waits on."""

    dead: BaseException | None = None

    def __init__(self) -> None:
        self.free = BLOCKS
        self.running = 0
        self.usage = 0.0

    async def drain_kv_events(self, snapshot: bool = False) -> KVEventDrain:
        return KVEventDrain(
            events=[], queued_prefill_tokens=0, block_hashes=[] if snapshot else None
        )

    def stats(self) -> dict[str, float]:
        return {
            "num_requests_waiting": 0,
            "num_requests_running": self.running,
            "kv_cache_usage_perc": self.usage,
            "kv_blocks_free": self.free,
            "kv_blocks_total": BLOCKS,
        }


@dataclass
class Cluster:
    engine: FakeEngine
    kv: KVEventLog
    coord_url: str
    session: aiohttp.ClientSession
    node_id: str
    marker: float = 0.0

    async def node_report(self) -> dict[str, Any]:
        n = await self.maybe_node_report()
        assert n is not None, f"{self.node_id} is not in the coordinator's /cluster"
        return n

    async def maybe_node_report(self) -> dict[str, Any] | None:
        async with self.session.get(self.coord_url + "/cluster") as r:
            body = await r.json()
        return next((n for n in body["nodes"] if n["node_id"] == self.node_id), None)

    async def frame_seen(self) -> dict[str, Any]:
        """Move the marker and wait until the coordinator holds a load frame built after this."""
        self.marker = round(self.marker + 0.001, 3)
        self.engine.usage = self.marker

        async def seen() -> dict[str, Any] | None:
            n = await self.node_report()
            return (
                n
                if n["load"] is not None and n["load"]["kv_cache_usage_perc"] == self.marker
                else None
            )

        return await until(seen, 20, f"a load frame with marker {self.marker} at the coordinator")

    async def route(self, rid: str) -> tuple[int, dict[str, Any]]:
        body = {
            "model": MODEL,
            "block_hashes": [],
            "num_prompt_tokens": PROMPT,
            "max_tokens": MAX_TOKENS,
            "request_id": rid,
        }
        async with self.session.post(self.coord_url + "/route", json=body) as r:
            return r.status, await r.json()


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@contextlib.asynccontextmanager
async def cluster(etcd_url: str, policy: PolicyConfig) -> AsyncIterator[Cluster]:
    engine = FakeEngine()
    node_port, coord_port = free_port(), free_port()
    state = SimpleNamespace(
        engine=engine,
        engine_id="engine-" + uuid.uuid4().hex[:8],
        metrics=NodeMetrics(dict, MODEL, "decode"),  # the load frames' measured latency
        config=SimpleNamespace(
            role="decode", engine=SimpleNamespace(block_size=BLOCK, record_kv_events=True)
        ),
    )
    node_app = web.Application()
    add_kv_event_routes(node_app, state)
    node_id = "decode-fake"
    info = NodeInfo(
        node_id=node_id,
        role="decode",
        url=f"http://127.0.0.1:{node_port}",
        model=MODEL,
        engine_id=state.engine_id,
        block_size=BLOCK,
        kv_layout_hash="fake",
        kv_capacity_blocks=BLOCKS,
        max_model_len=2048,
        started_at=time.time(),
    )
    store = EtcdStore(etcd_url)
    cfg = CoordinatorConfig(etcd=etcd_url, port=coord_port, policy=policy)
    runners: list[web.AppRunner] = []
    session = aiohttp.ClientSession()
    try:
        runners.append(await _serve(node_app, node_port))
        await store.put(node_key(cfg.cluster, "decode", node_id), msgspec.json.encode(info))
        runners.append(await _serve(make_app(cfg), coord_port))
        c = Cluster(engine, node_app[KV_EVENTS], f"http://127.0.0.1:{coord_port}", session, node_id)
        await until(lambda: _ready(c), 20, "the fake node ready at the coordinator")
        yield c
    finally:
        await session.close()
        for r in reversed(runners):
            await r.cleanup()
        await store.close()


async def _ready(c: Cluster) -> bool:
    n = await c.maybe_node_report()
    return n is not None and n["ready"]


def _policy(settle_s: float) -> PolicyConfig:
    # max age far beyond the test: only frames end reservations here
    return PolicyConfig(pending_settle_s=settle_s, pending_max_age_s=120.0, stale_load_s=10.0)


async def test_a_reservation_ends_on_the_frame_that_shows_its_request(etcd: EtcdServer) -> None:
    # A settle time of 30 s stands for frames that lag: the old rule held every reservation
    # that long, and subtracted requests the node had taken and finished from frames that
    # already counted them.
    async with cluster(etcd.url, _policy(30.0)) as c:
        for i in range(6):
            rid = f"req-{i}"
            status, body = await c.route(rid)
            assert status == 200, (i, body)
            assert body["decode"]["node_id"] == c.node_id
            assert (await c.node_report())["pending"]["blocks"] == NEED
            # The node takes the request: the frame shows its blocks and acknowledges the route.
            c.engine.free, c.engine.running = BLOCKS - NEED, 1
            c.kv.took(rid)
            n = await c.frame_seen()
            assert n["load"]["kv_blocks_free"] == BLOCKS - NEED
            # ... and finishes it; nothing of it is counted any more.
            c.engine.free, c.engine.running = BLOCKS, 0
            await c.frame_seen()
        assert (await c.node_report())["pending"] == {"seqs": 0, "prefill_tokens": 0, "blocks": 0}


async def test_a_reservation_outlives_frames_that_do_not_show_its_request(etcd: EtcdServer) -> None:
    # No settle time at all: the old rule dropped every reservation on the next frame, though
    # none of these requests had reached the node, and admitted a fifth that cannot fit.
    async with cluster(etcd.url, _policy(0.0)) as c:
        for i in range(4):
            status, body = await c.route(f"req-{i}")
            assert status == 200, (i, body)
        n = await c.frame_seen()
        assert n["pending"]["blocks"] == 4 * NEED
        status, body = await c.route("req-4")
        assert status == 503 and body["error"]["code"] == "no_capacity", body
        assert f"{BLOCKS - 4 * NEED} free blocks < {NEED}" in body["error"]["message"]
        # Two reach the node and finish between frames: their reservations end on the next frame.
        c.kv.took("req-0")
        c.kv.took("req-1")
        n = await c.frame_seen()
        assert n["pending"]["blocks"] == 2 * NEED and n["pending"]["seqs"] == 2
        status, body = await c.route("req-4")
        assert status == 200, body
