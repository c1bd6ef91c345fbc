"""Leader election on a real etcd: one leader among replicas, and a leader cut off from etcd
long enough to lose its keepalive takes its own key back instead of following itself until
its old lease expires."""

from __future__ import annotations

import asyncio

from coordinator.election import Election
from coordinator.etcd_server import EtcdServer
from coordinator.etcd_store import EtcdStore
from protocol.cluster import leader_key
from tests.wait import until


async def test_single_leader_and_takeover_of_own_key(etcd: EtcdServer) -> None:
    ttl = 20
    stores = [EtcdStore(etcd.url) for _ in range(2)]
    a, b = (
        Election(s, "c", name, f"http://{name}", ttl) for s, name in zip(stores, "ab", strict=True)
    )
    tasks = [asyncio.create_task(a.run())]
    try:
        await until(lambda: a.is_leader, 30, "a to lead")
        tasks.append(asyncio.create_task(b.run()))
        await until(lambda: b.leader == "a", 30, "b to follow a")
        assert not b.is_leader

        etcd.stop()
        await until(lambda: not a.is_leader, ttl, "a to step down (its keepalive failed)")
        etcd.restart()  # same data: a's old lease and key are still there, for up to `ttl`
        # Half the TTL: a takes the key over under its new lease rather than waiting it out.
        await until(lambda: a.is_leader, ttl / 2, "a to lead again")
        kv = await stores[0].get(leader_key("c"))
        assert kv is not None and kv.value == b"a" and kv.lease == a.lease
        await until(lambda: b.leader == "a", 30, "b to follow a again")
        assert not b.is_leader
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in stores:
            await s.close()
