"""The node registry: mirrors `/duet/<cluster>/nodes/` from etcd into callbacks.

List the prefix (through coordinator/cluster_view.py, the one reader of membership), hand the
full set to `on_sync`, then watch from the listed revision and hand each change to `on_put` /
`on_delete`. When the watch breaks (etcd restarted, network), list
again: whatever vanished meanwhile is deleted by the next `on_sync`. While etcd is unreachable
the last known view stays in place (nodes keep serving; a dead one stops reporting load and is
not routed to).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from coordinator.cluster_view import ClusterView, decode_node
from coordinator.store import Store, StoreError
from protocol.cluster import NodeInfo, nodes_prefix

log = logging.getLogger("duet.coordinator")


class Registry:
    def __init__(
        self,
        store: Store,
        cluster: str,
        *,
        on_sync: Callable[[dict[str, NodeInfo]], None],
        on_put: Callable[[NodeInfo], None],
        on_delete: Callable[[str], None],
        on_connected: Callable[[bool], None] = lambda ok: None,
    ) -> None:
        self.store = store
        self.view = ClusterView(store, cluster)
        self.prefix = nodes_prefix(cluster)
        self.on_sync = on_sync
        self.on_put = on_put
        self.on_delete = on_delete
        self.on_connected = on_connected
        #: etcd key → node id, to resolve deletes (their value is empty)
        self._keys: dict[str, str] = {}

    async def run(self) -> None:
        backoff, down = 0.2, False
        while True:
            try:
                records, revision = await self.view.nodes()
                nodes = {r.info.node_id: r.info for r in records}
                self._keys = {r.key: r.info.node_id for r in records}
                self.on_sync(nodes)
                self.on_connected(True)
                if down:
                    log.info("etcd reachable again: %d node(s) registered", len(nodes))
                down, backoff = False, 0.2
                async for ev in self.store.watch_prefix(self.prefix, revision + 1):
                    if ev.kind == "put":
                        info = decode_node(ev.key, ev.value)
                        if info is not None:
                            self._keys[ev.key] = info.node_id
                            self.on_put(info)
                    else:
                        node_id = self._keys.pop(ev.key, None)
                        if node_id is not None and node_id not in self._keys.values():
                            self.on_delete(node_id)
            except StoreError as e:
                self.on_connected(False)
                if not down:
                    log.warning(
                        "etcd: %s; keeping the last known %d node key(s), retrying",
                        e,
                        len(self._keys),
                    )
                down = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # a bug must not silently freeze the node view
                self.on_connected(False)
                log.exception("node registry failed; listing again")
                await asyncio.sleep(1.0)
