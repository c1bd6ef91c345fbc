"""A forced event gap: a lossy proxy between a real node and a coordinator drops one KV event
batch; the coordinator sees the sequence gap, resyncs from the node's snapshot, and its index
then equals the node's real cache.

The coordinator runs in this process (the real app on a real port) so the test can compare
its index with the node's snapshot exactly. The node registers in cluster "default"; the
test registers the proxy's URL for it in cluster "gap", which the coordinator watches."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

from coordinator.app import COORDINATOR, make_app
from coordinator.cluster_view import ClusterView, NodeRecord
from coordinator.etcd_server import EtcdServer
from coordinator.etcd_store import EtcdStore
from coordinator.service import CoordinatorConfig
from protocol.cluster import node_key
from protocol.kv_events import CONTENT_TYPE, EventBatch, FrameDecoder, encode_frame
from tests.coordinator.conftest import node
from tests.procs import free_port, running
from tests.wait import until


class LossyProxy:
    """Forwards /kv/snapshot and /kv/events to the node; drops one event batch when armed."""

    def __init__(self, target: str, session: aiohttp.ClientSession) -> None:
        self.target = target
        self.session = session
        self.drop_next_batch = False
        self.dropped: list[int] = []
        self.snapshots = 0

    async def snapshot(self, request: web.Request) -> web.Response:
        self.snapshots += 1
        async with self.session.get(self.target + "/kv/snapshot") as r:
            return web.Response(
                body=await r.read(), status=r.status, content_type="application/json"
            )

    async def events(self, request: web.Request) -> web.StreamResponse:
        async with self.session.get(self.target + "/kv/events", params=request.query) as r:
            if r.status != 200:
                return web.Response(
                    body=await r.read(), status=r.status, content_type="application/json"
                )
            resp = web.StreamResponse(
                headers={
                    "Content-Type": CONTENT_TYPE,
                    "X-Duet-Engine-Id": r.headers["X-Duet-Engine-Id"],
                }
            )
            await resp.prepare(request)
            dec, enc = FrameDecoder(), msgspec.msgpack.Encoder()
            async for chunk in r.content.iter_any():
                for frame in dec.feed(chunk):
                    if isinstance(frame, EventBatch) and self.drop_next_batch:
                        self.drop_next_batch = False
                        self.dropped.append(frame.seq)
                        continue
                    await resp.write(encode_frame(enc, frame))
            return resp


async def wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)  # polling interval of the condition


async def scenario(etcd_url: str, node_url: str) -> None:
    store = EtcdStore(etcd_url)
    async with aiohttp.ClientSession() as session:
        proxy = LossyProxy(node_url, session)
        papp = web.Application()
        papp.router.add_get("/kv/snapshot", proxy.snapshot)
        papp.router.add_get("/kv/events", proxy.events)
        prunner = web.AppRunner(papp, handler_cancellation=True, shutdown_timeout=1)
        await prunner.setup()
        pport = free_port()
        await web.TCPSite(prunner, "127.0.0.1", pport).start()

        async def registered() -> tuple[NodeRecord, ...]:
            return (await ClusterView(store, "default").nodes())[0]

        # The node answers /health before its registration task has written its key.
        info = (await until(registered, 30, "the node's registration in etcd"))[0].info
        fake = msgspec.structs.replace(info, url=f"http://127.0.0.1:{pport}")
        await store.put(node_key("gap", info.role, info.node_id), msgspec.json.encode(fake))

        app = make_app(
            CoordinatorConfig(etcd=etcd_url, cluster="gap", port=free_port(), replica_id="t")
        )
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", app[COORDINATOR].config.port).start()
        coord = app[COORDINATOR]
        try:
            await wait(
                lambda: info.node_id in coord.views and coord.views[info.node_id].connected,
                30,
                "subscription",
            )

            async def complete(prompt: list[int]) -> None:
                async with session.post(
                    node_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}
                ) as r:
                    assert r.status == 200, await r.text()

            async def node_cache() -> set[int]:
                async with session.get(node_url + "/kv/snapshot") as r:
                    return set((await r.json())["block_hashes"])

            await complete([(i * 7) % 380 + 1 for i in range(160)])
            real = await node_cache()
            assert len(real) == 10
            await wait(
                lambda: coord.index.node_blocks(info.node_id) == real,
                30,
                "the first blocks in the index",
            )
            assert proxy.snapshots == 1

            proxy.drop_next_batch = True
            await complete([(i * 11) % 380 + 1 for i in range(96)])
            await wait(lambda: proxy.dropped, 30, "a dropped batch")
            real = await node_cache()
            assert len(real) == 16
            await wait(lambda: proxy.snapshots == 2, 30, "a resync from the snapshot")
            await wait(
                lambda: coord.index.node_blocks(info.node_id) == real,
                30,
                "the index to equal the cache",
            )
            assert coord.metrics.resyncs.labels("gap")._value.get() == 1
            assert coord.views[info.node_id].seq == proxy.dropped[0]
        finally:
            await runner.cleanup()
            await prunner.cleanup()
            await store.close()


def test_forced_gap_resyncs_from_snapshot(
    tiny_llama: Path, tmp_path: Path, etcd: EtcdServer
) -> None:
    n = node("both", tiny_llama, tmp_path, etcd.url)
    with running(n):
        asyncio.run(scenario(etcd.url, n.url))
