"""`ClusterView`: one read of a cluster's membership from the store — the nodes registered
under `nodes_prefix` and the coordinator replicas under `coordinators_prefix` (protocol.cluster).

The one reader of those two prefixes for everyone who needs a snapshot rather than a watch: the
gateway's own view (gateway/backends/etcd_view.py), `duet status`, and `replica_urls`
(coordinator/client.py). The coordinator's registry (registry.py) watches the same node keys and
decodes them with the same `decode_node`.

Invariants: a record that does not decode is skipped with a warning, never fatal (one bad
writer must not hide the cluster); both lists are sorted, so two reads of the same store state
are equal; a failure to reach the store is `StoreError`, for the caller to retry.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import msgspec

from coordinator.store import Store
from protocol.cluster import NodeInfo, NodeStatus, coordinators_prefix, nodes_prefix

log = logging.getLogger("duet.coordinator.cluster")
_NODE = msgspec.json.Decoder(NodeInfo)


class _ReplicaRecord(msgspec.Struct):
    url: str


_REPLICA = msgspec.json.Decoder(_ReplicaRecord)


def decode_node(key: str, value: bytes) -> NodeInfo | None:
    """A node's registration, or None (logged) when it does not decode."""
    try:
        return _NODE.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.warning("ignoring unreadable registration %s: %s", key, e)
        return None


def decode_replica(value: bytes) -> str | None:
    """A coordinator replica's registration: its URL (election.py writes it bare), or a JSON
    object with `url`; None for anything else."""
    text = value.decode(errors="replace").strip()
    if text.startswith("{"):
        with contextlib.suppress(msgspec.DecodeError):
            return _REPLICA.decode(value).url
        return None
    return text if text.startswith(("http://", "https://")) else None


@dataclass(frozen=True)
class NodeRecord:
    """One node's registration as stored: where, and at which revision on which lease."""

    key: str
    info: NodeInfo
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class ClusterSnapshot:
    #: every readable node registration, by node id
    records: tuple[NodeRecord, ...]
    #: URLs of the coordinator replicas alive (their keys live on their leases)
    coordinators: list[str]
    #: the store revision the nodes were read at (a watch continues from revision + 1)
    revision: int

    @property
    def nodes(self) -> tuple[NodeInfo, ...]:
        return tuple(r.info for r in self.records)

    def active(self) -> list[NodeInfo]:
        """The nodes a router may send new work to."""
        return [n for n in self.nodes if n.status == NodeStatus.ACTIVE]


class ClusterView:
    def __init__(self, store: Store, cluster: str) -> None:
        self.store = store
        self.cluster = cluster

    async def nodes(self) -> tuple[tuple[NodeRecord, ...], int]:
        """Every readable node registration (by node id), and the revision they were read at."""
        kvs, revision = await self.store.get_prefix(nodes_prefix(self.cluster))
        records = [
            NodeRecord(kv.key, info, kv.mod_revision, kv.lease)
            for kv in kvs
            if (info := decode_node(kv.key, kv.value)) is not None
        ]
        return tuple(sorted(records, key=lambda r: r.info.node_id)), revision

    async def replicas(self) -> list[str]:
        """The URLs of the coordinator replicas alive, sorted."""
        kvs, _ = await self.store.get_prefix(coordinators_prefix(self.cluster))
        return sorted(u for kv in kvs if (u := decode_replica(kv.value)) is not None)

    async def node(self, node_id: str) -> NodeRecord | None:
        """`node_id`'s registration, or None."""
        records, _ = await self.nodes()
        return next((r for r in records if r.info.node_id == node_id), None)

    async def read(self) -> ClusterSnapshot:
        records, revision = await self.nodes()
        return ClusterSnapshot(
            records=records, coordinators=await self.replicas(), revision=revision
        )
