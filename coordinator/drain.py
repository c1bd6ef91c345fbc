"""Draining a node: rewrite its registration with `status: draining` (same lease); undoing it.

Used by `duet drain` and by every coordinator replica's `POST /nodes/{id}/drain`; the node
watches its own key and finishes its work (node/registration.py). A compare-and-swap on the
key's revision keeps a concurrent re-registration from being overwritten with stale data.

The undo (`duet drain --undo`, `DELETE /nodes/{id}/drain`) goes to the node itself, at the URL
it registered: `DELETE {url}/drain` (node/drain.py). Only the node knows whether it is already
stopping (then 409), and its own write of `status: active` is ordered with its own drain writes;
an etcd rewrite from outside could be undone by the node's next publish, or revive the key of a
node on its way out.
"""

from __future__ import annotations

import aiohttp
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
        if await store.replace(
            found.key, msgspec.json.encode(new), found.mod_revision, found.lease
        ):
            return new
    raise StoreError(f"registration of {node_id} kept changing; drain not written")


async def undrain_node(
    store: Store,
    cluster: str,
    node_id: str,
    session: aiohttp.ClientSession,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, NodeInfo]:
    """Ask `node_id` to undo its drain: the node's answer (status, JSON body: UndrainStatus, or
    the error) and its registration. Raises NodeNotFound, StoreError, and aiohttp.ClientError or
    TimeoutError when the node cannot be reached."""
    found = await find_node(store, cluster, node_id)
    if found is None:
        raise NodeNotFound(node_id)
    async with session.delete(
        found.info.url + "/drain", headers=headers, timeout=aiohttp.ClientTimeout(total=15)
    ) as r:
        return r.status, await r.read(), found.info
