"""The gateway's own view of the cluster, read from etcd (`--etcd`): coordinator replicas and
active nodes per model, through the one reader of membership (coordinator/cluster_view.py).

It lets the gateway find every coordinator replica without a list, and route on its own
(least-loaded by its in-flight counts, through `StaticRouter`) when no coordinator answers.
The view is re-read every `interval_s` (a full read of two small prefixes: simpler than a
watch that must survive reconnects, and the data changes slowly); while etcd is unreachable
the last good view stays in use.

Invariant: node URLs come only from NodeInfo records nodes registered, never from a client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable

from coordinator.cluster_view import ClusterSnapshot, ClusterView
from coordinator.etcd_store import EtcdStore
from coordinator.store import Store
from gateway.config import StaticNodes
from protocol.cluster import NodeInfo, NodeStatus, NodeTask

log = logging.getLogger("duet.gateway.etcd")


def pools_from(
    infos: Iterable[NodeInfo], task: NodeTask = NodeTask.GENERATE
) -> dict[str, StaticNodes]:
    """Model → its active nodes of `task` by role, with each node's KV layout hash, so the static
    router pairs P and D by the coordinator's rule (protocol.cluster.kv_layouts_match). Embed
    nodes register as `both`: a pool of them is routed as colocated nodes."""
    pools: dict[str, dict[str, list[str]]] = {}
    layouts: dict[str, dict[str, str]] = {}
    for info in infos:
        if info.status != NodeStatus.ACTIVE or info.task != task:
            continue
        pools.setdefault(info.model, {"prefill": [], "decode": [], "both": []})[info.role].append(
            info.url
        )
        layouts.setdefault(info.model, {})[info.url] = info.kv_layout_hash
    return {
        m: StaticNodes(
            prefill=tuple(sorted(p["prefill"])),
            decode=tuple(sorted(p["decode"])),
            both=tuple(sorted(p["both"])),
            kv_layouts=layouts[m],
        )
        for m, p in pools.items()
    }


class EtcdView:
    def __init__(
        self, endpoint: str, cluster: str, interval_s: float = 2.0, store: Store | None = None
    ) -> None:
        #: the store is the view's own unless given (then the caller closes it)
        self._owned = store is None
        self.store: Store = store if store is not None else EtcdStore(endpoint)
        self.endpoint = endpoint
        self.view = ClusterView(self.store, cluster)
        self.interval_s = interval_s
        self.coordinators: list[str] = []
        self.nodes: dict[str, StaticNodes] = {}
        #: the `--task embed` nodes, by model (never in `nodes`)
        self.embed_nodes: dict[str, StaticNodes] = {}
        self.loaded = asyncio.Event()
        #: every registration as last read (the console's cluster page)
        self.infos: tuple[NodeInfo, ...] = ()
        #: unix time of the last successful read, and the last read's error (None: it worked)
        self.read_at: float | None = None
        self.error: str | None = None

    def pool(self, model: str, task: NodeTask = NodeTask.GENERATE) -> StaticNodes | None:
        return (self.nodes if task == NodeTask.GENERATE else self.embed_nodes).get(model)

    def apply(self, snap: ClusterSnapshot) -> None:
        self.infos = snap.nodes
        self.read_at, self.error = time.time(), None
        self.coordinators = snap.coordinators
        self.nodes = pools_from(snap.nodes)
        self.embed_nodes = pools_from(snap.nodes, NodeTask.EMBED)
        self.loaded.set()

    async def refresh(self) -> None:
        self.apply(await self.view.read())

    async def run(self) -> None:
        warned = False
        while True:
            try:
                await self.refresh()
                if warned:
                    log.info("etcd at %s is reachable again", self.endpoint)
                    warned = False
            except Exception as e:  # StoreError, or a bug: either way keep the last view and retry
                self.error = f"{type(e).__name__}: {e}"
                if not warned:
                    log.warning("cannot read the cluster from etcd (%s); keeping the last view", e)
                    warned = True
            await asyncio.sleep(self.interval_s)

    async def lifecycle(self, first_load_timeout_s: float = 5.0) -> AsyncIterator[None]:
        task = asyncio.ensure_future(self.run())
        try:
            async with asyncio.timeout(first_load_timeout_s):
                await self.loaded.wait()
        except TimeoutError:
            log.warning(
                "no cluster view from etcd after %.0fs; starting without it", first_load_timeout_s
            )
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if self._owned:
                await self.store.close()
