"""Draining a node: rewrite its registration with `status: draining` (same lease).

Used by `duet drain` and by every coordinator replica's `POST /nodes/{id}/drain`; the node
watches its own key and finishes its work (node/registration.py). A compare-and-swap on the
key's revision keeps a concurrent re-registration from being overwritten with stale data.
"""

from __future__ import annotations

import msgspec

from coordinator.cluster_view import decode_node
from coordinator.store import Store, StoreError
from protocol.cluster import NodeInfo, NodeStatus, nodes_prefix


class NodeNotFound(KeyError):
    pass


async def find_node(store: Store, cluster: str, node_id: str) -> tuple[str, NodeInfo, int, int] | None:
    """(key, info, mod_revision, lease) of `node_id`'s registration, or None."""
    kvs, _ = await store.get_prefix(nodes_prefix(cluster))
    for kv in kvs:
        if kv.key.rsplit("/", 1)[-1] != node_id:
            continue
        info = decode_node(kv.key, kv.value)
        if info is not None and info.node_id == node_id:
            return kv.key, info, kv.mod_revision, kv.lease
    return None


async def drain_node(store: Store, cluster: str, node_id: str) -> NodeInfo:
    """Mark `node_id` draining; returns its new registration. Raises NodeNotFound."""
    for _ in range(10):
        found = await find_node(store, cluster, node_id)
        if found is None:
            raise NodeNotFound(node_id)
        key, info, revision, lease = found
        if info.status == NodeStatus.DRAINING:
            return info
        new = msgspec.structs.replace(info, status=NodeStatus.DRAINING)
        if await store.replace(key, msgspec.json.encode(new), revision, lease):
            return new
    raise StoreError(f"registration of {node_id} kept changing; drain not written")
