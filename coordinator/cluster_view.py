"""`ClusterView`: one read of a cluster's membership from the store — the nodes registered
under `nodes_prefix` and the coordinator replicas under `coordinators_prefix` (protocol.cluster).

The one reader of those two prefixes for everyone who needs a snapshot rather than a watch: the
gateway's own view (gateway/etcd_view.py), `duet status`, and `replica_urls` (coordinator/client.py).
The coordinator's registry (registry.py) watches the same node keys and decodes them with the
same `decode_node`.

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
class ClusterSnapshot:
    #: every readable node registration, by node id
    nodes: tuple[NodeInfo, ...]
    #: URLs of the coordinator replicas alive (their keys live on their leases)
    coordinators: list[str]
    #: the store revision the nodes were read at
    revision: int

    def active(self) -> list[NodeInfo]:
        """The nodes a router may send new work to."""
        return [n for n in self.nodes if n.status == NodeStatus.ACTIVE]


class ClusterView:
    def __init__(self, store: Store, cluster: str) -> None:
        self.store = store
        self.cluster = cluster

    async def read(self) -> ClusterSnapshot:
        kvs, revision = await self.store.get_prefix(nodes_prefix(self.cluster))
        nodes = [info for kv in kvs if (info := decode_node(kv.key, kv.value)) is not None]
        replicas, _ = await self.store.get_prefix(coordinators_prefix(self.cluster))
        urls = sorted(u for kv in replicas if (u := decode_replica(kv.value)) is not None)
        return ClusterSnapshot(nodes=tuple(sorted(nodes, key=lambda n: n.node_id)), coordinators=urls,
                               revision=revision)  # fmt: skip
