"""Draining a node: rewrite its registration with `status: draining` (same lease).

Used by `duet drain` and by every coordinator replica's `POST /nodes/{id}/drain`; the node
watches its own key and finishes its work (node/registration.py). A compare-and-swap on the
key's revision keeps a concurrent re-registration from being overwritten with stale data.
"""

from __future__ import annotations

import msgspec

from coordinator.cluster_view import ClusterView, NodeRecord
from coordinator.store import Store, StoreError
from protocol.cluster import NodeInfo, NodeStatus


class NodeNotFound(KeyError):
    pass


async def find_node(store: Store, cluster: str, node_id: str) -> NodeRecord | None:
    """`node_id`'s registration (key, info, revision, lease), or None."""
    return await ClusterView(store, cluster).node(node_id)


async def drain_node(store: Store, cluster: str, node_id: str) -> NodeInfo:
    """Mark `node_id` draining; returns its new registration. Raises NodeNotFound."""
    for _ in range(10):
        found = await find_node(store, cluster, node_id)
        if found is None:
            raise NodeNotFound(node_id)
        if found.info.status == NodeStatus.DRAINING:
            return found.info
        new = msgspec.structs.replace(found.info, status=NodeStatus.DRAINING)
        if await store.replace(found.key, msgspec.json.encode(new), found.mod_revision, found.lease):
            return new
    raise StoreError(f"registration of {node_id} kept changing; drain not written")
