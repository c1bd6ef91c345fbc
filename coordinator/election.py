"""Coordinator replica membership and leader election over etcd.

Each replica holds one lease (TTL `ttl`, refreshed every TTL/3, by coordinator/lease.py's
loop, the same one that keeps a node's registration) and writes its URL under
`/duet/<cluster>/coordinators/<replica_id>` with it, so gateways can find every replica. The
leader is whoever created `/duet/<cluster>/coordinator/leader` (a create-if-absent
transaction) with its lease; the others watch that key and campaign when it is deleted, so a
dead leader is replaced within its lease TTL. All replicas serve `/route`; only the leader
runs cluster-wide actions.

No two leaders act at once: `is_leader` holds only while the lease surely lives on etcd's side
(`LeaseHolder.valid_until`, less a margin for the two clocks' rates). A leader cut off from etcd
— a partition, a SIGSTOP, an etcd that lost its quorum — stops leading when that time is up,
before etcd can expire its key and let another replica win, even while its refresh is still
waiting for an answer; if the refresh then succeeds, the key was never lost and it leads again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

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
        #: this replica holds the leader key (as of the last answer etcd gave)
        self.won = False
        #: replica id of the current leader, as last seen (None: unknown / no leader)
        self.leader: str | None = None

    @property
    def is_leader(self) -> bool:
        """Leading now: the key is ours and the lease surely still lives (module docstring)."""
        margin = max(0.5, self.ttl / 10)
        return self.won and time.monotonic() < self.valid_until - margin

    @property
    def state(self) -> ElectionState:
        if self.is_leader:
            return ElectionState.LEADER
        return ElectionState.UNKNOWN if self.leader is None else ElectionState.FOLLOWER

    async def attach(self) -> list[Watcher]:
        await self.store.put(self.member_key, self.url.encode(), self.lease)
        return [self._campaign()]

    def on_session_end(self) -> None:
        self.won = False

    def on_down(self, error: Exception) -> None:
        if self.state is not ElectionState.UNKNOWN and isinstance(error, StoreError):
            log.warning("etcd unreachable (%s): no longer following or leading", error)
        self.won, self.leader = False, None

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
                self.won, self.leader = True, self.replica_id
                log.info("elected leader of the coordinators")
                await asyncio.Event().wait()  # leader until the lease is lost
            assert kv is not None
            self.won, self.leader = False, kv.value.decode(errors="replace")
            async for ev in self.store.watch_prefix(self.key, kv.mod_revision + 1):
                if ev.key != self.key:
                    continue
                if ev.kind == "delete":
                    self.leader = None
                    break
                self.leader = ev.value.decode(errors="replace")

    async def resign(self) -> None:
        """Give up leadership and membership now (clean shutdown): followers need not wait."""
        self.won = False
        await self.release()
