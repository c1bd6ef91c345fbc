"""A node's undrain in etcd (node/registration.py::Registration.undrain), on a real etcd: the
node writes `status: active` and no `draining` event written before that write can drain it
again — a watch that delivers them late (a lagging or restarted watch replays history) sees
them superseded. A node that is exiting or stopping is never undrained.

The watch here is replayed from before the drain on purpose: the late delivery that a live
cluster produces only now and then, made certain."""

from __future__ import annotations

import asyncio

import msgspec
from prometheus_client import CollectorRegistry

from coordinator.drain import drain_node
from coordinator.etcd_server import EtcdServer
from coordinator.etcd_store import EtcdStore
from node.registration import DrainHooks, Registration
from protocol.cluster import NodeInfo, NodeStatus
from tests.wait import until

INFO = NodeInfo(
    node_id="n1",
    role="decode",
    url="http://127.0.0.1:9",
    model="m",
    engine_id="e1",
    block_size=16,
    kv_layout_hash="h",
    kv_capacity_blocks=64,
    max_model_len=256,
    started_at=0.0,
)


def test_an_undrain_is_not_undone_by_the_drain_events_it_superseded(etcd: EtcdServer) -> None:
    async def go() -> None:
        store = EtcdStore(etcd.url)
        node = {"requested": False, "stopping": False}
        hooks = DrainHooks(
            is_busy=lambda: False,
            shutting_down=lambda: node["stopping"],
            requested=lambda: node["requested"],
            on_drain=lambda: node.update(requested=True),
            on_undrain=lambda: node.update(requested=False),
        )
        reg = Registration(store, INFO, "t", 10, hooks, registry=CollectorRegistry())
        try:
            # one registration session by hand (LeaseHolder._session), its watcher run below
            reg.lease = await store.grant(10)
            for w in await reg.attach():
                w.close()
            reg.on_up()
            start = (await store.get(reg.key)).mod_revision + 1

            await drain_node(store, "t", "n1")  # `duet drain`
            watch = asyncio.create_task(reg._watch_own_key(start))
            await until(
                lambda: reg.drain_requested and node["requested"], 5, "the node to see its drain"
            )
            await reg.tick()  # publishes `draining` itself (its own write)
            watch.cancel()
            assert await reg.undrain()
            assert not reg.drain_requested and not node["requested"]
            status = lambda kv: msgspec.json.decode(kv.value, type=NodeInfo).status  # noqa: E731
            assert status(await store.get(reg.key)) == NodeStatus.ACTIVE

            # replay every event since before the drain, then a delete that ends the watch: the
            # two `draining` writes come first, superseded by the undrain's write
            replay = asyncio.create_task(reg._watch_own_key(start))
            await store.delete(reg.key)
            await asyncio.wait_for(replay, 10)
            assert not reg.drain_requested and not node["requested"], (
                "a superseded drain event drained it again"
            )
            await reg.tick()
            assert reg.status == NodeStatus.ACTIVE

            # a drain written after the undrain is a new drain: it counts
            reg.lease = await store.grant(10)
            for w in await reg.attach():
                w.close()
            since = (await store.get(reg.key)).mod_revision + 1
            await drain_node(store, "t", "n1")
            watch = asyncio.create_task(reg._watch_own_key(since))
            await until(lambda: reg.drain_requested, 5, "the new drain")
            watch.cancel()

            # exiting (drained with --exit-when-drained) or stopping: refused, nothing written
            reg.exiting = True
            assert not await reg.undrain() and reg.drain_requested
            reg.exiting, node["stopping"] = False, True
            assert not await reg.undrain() and reg.drain_requested
            assert status(await store.get(reg.key)) == NodeStatus.DRAINING
        finally:
            await reg.deregister()
            await store.close()

    asyncio.run(go())
