"""Coordinator replica membership and leader election over etcd.

Each replica holds one lease (TTL `ttl`, refreshed every TTL/3) and writes its URL under
`/duet/<cluster>/coordinators/<replica_id>` with it, so gateways can find every replica. The
leader is whoever created `/duet/<cluster>/coordinator/leader` (a create-if-absent
transaction) with its lease; the others watch that key and campaign when it is deleted, so a
dead leader is replaced within its lease TTL. All replicas serve `/route`; only the leader
runs cluster-wide actions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from coordinator.store import Store, StoreError
from protocol.cluster import coordinators_prefix, leader_key

log = logging.getLogger("duet.coordinator")


class Election:
    def __init__(self, store: Store, cluster: str, replica_id: str, url: str, ttl: int) -> None:
        self.store = store
        self.replica_id = replica_id
        self.url = url
        self.ttl = ttl
        self.key = leader_key(cluster)
        self.member_key = coordinators_prefix(cluster) + replica_id
        self.lease = 0
        self.is_leader = False
        #: replica id of the current leader, as last seen (None: unknown / no leader)
        self.leader: str | None = None

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            if await self.store.keepalive(self.lease) <= 0:
                log.warning("coordinator lease lost; joining again")
                return

    async def _campaign(self) -> None:
        """Become leader, or follow until the leader key goes away; returns to campaign again."""
        while True:
            won = await self.store.create(self.key, self.replica_id.encode(), self.lease)
            kv = None
            if not won:
                kv = await self.store.get(self.key)
                if kv is None:
                    continue
                # Our own key under a lease we lost track of (etcd was briefly unreachable):
                # move it to the new lease instead of following ourselves until it expires.
                if kv.value.decode(errors="replace") == self.replica_id:
                    won = await self.store.replace(self.key, self.replica_id.encode(), kv.mod_revision, self.lease)
            if won:
                self.is_leader, self.leader = True, self.replica_id
                log.info("elected leader of the coordinators")
                await asyncio.Event().wait()  # leader until the lease is lost
            assert kv is not None
            self.is_leader, self.leader = False, kv.value.decode(errors="replace")
            async for ev in self.store.watch_prefix(self.key, kv.mod_revision + 1):
                if ev.key != self.key:
                    continue
                if ev.kind == "delete":
                    self.leader = None
                    break
                self.leader = ev.value.decode(errors="replace")

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                self.lease = await self.store.grant(self.ttl)
                await self.store.put(self.member_key, self.url.encode(), self.lease)
                backoff = 0.2
                tasks = [asyncio.create_task(self._keepalive()), asyncio.create_task(self._campaign())]
                try:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    self.is_leader = False
                for t in done:
                    t.result()
            except StoreError as e:
                if self.is_leader:
                    log.warning("etcd unreachable (%s): stepping down as leader", e)
                self.is_leader, self.leader = False, None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # a bug must not leave the replica silently out of the election
                self.is_leader, self.leader = False, None
                log.exception("election failed; joining again")
                await asyncio.sleep(1.0)

    async def resign(self) -> None:
        """Give up leadership and membership now (clean shutdown): followers need not wait."""
        lease, self.lease = self.lease, 0
        self.is_leader = False
        if lease:
            with contextlib.suppress(StoreError):
                await self.store.revoke(lease)
