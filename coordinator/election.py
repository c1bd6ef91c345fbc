"""Coordinator replica membership and leader election over etcd.

Each replica holds one lease (TTL `ttl`, refreshed every TTL/3, by coordinator/lease.py's
loop, the same one that keeps a node's registration) and writes its URL under
`/duet/<cluster>/coordinators/<replica_id>` with it, so gateways can find every replica. The
leader is whoever created `/duet/<cluster>/coordinator/leader` (a create-if-absent
transaction) with its lease; the others watch that key and campaign when it is deleted, so a
dead leader is replaced within its lease TTL. All replicas serve `/route`; only the leader
runs cluster-wide actions.
"""

from __future__ import annotations

import asyncio
import enum
import logging

from coordinator.lease import LeaseHolder, Watcher
from coordinator.store import Store, StoreError
from protocol.cluster import coordinators_prefix, leader_key

log = logging.getLogger("duet.coordinator")


class ElectionState(enum.StrEnum):
    """Where this replica stands (the `/cluster` view shows it as is_leader and leader)."""

    LEADER = "leader"
    FOLLOWER = "follower"
    #: no leader known: campaigning, or etcd unreachable
    UNKNOWN = "unknown"


class Election(LeaseHolder):
    def __init__(self, store: Store, cluster: str, replica_id: str, url: str, ttl: int) -> None:
        super().__init__(store, ttl, f"coordinator replica {replica_id}")
        self.replica_id = replica_id
        self.url = url
        self.key = leader_key(cluster)
        self.member_key = coordinators_prefix(cluster) + replica_id
        self.is_leader = False
        #: replica id of the current leader, as last seen (None: unknown / no leader)
        self.leader: str | None = None

    @property
    def state(self) -> ElectionState:
        if self.is_leader:
            return ElectionState.LEADER
        return ElectionState.UNKNOWN if self.leader is None else ElectionState.FOLLOWER

    async def attach(self) -> list[Watcher]:
        await self.store.put(self.member_key, self.url.encode(), self.lease)
        return [self._campaign()]

    def on_session_end(self) -> None:
        self.is_leader = False

    def on_down(self, error: Exception) -> None:
        if self.state is not ElectionState.UNKNOWN and isinstance(error, StoreError):
            log.warning("etcd unreachable (%s): no longer following or leading", error)
        self.is_leader, self.leader = False, None

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
                    won = await self.store.replace(
                        self.key, self.replica_id.encode(), kv.mod_revision, self.lease
                    )
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

    async def resign(self) -> None:
        """Give up leadership and membership now (clean shutdown): followers need not wait."""
        self.is_leader = False
        await self.release()
