"""The cluster's members as a node sees them: a mirror of etcd's node registrations.

With `--etcd` the node watches `/duet/<cluster>/nodes/` (coordinator.registry.Registry: list,
then watch, list again after a break) and keeps, for each registered generation node (active
or draining: a draining node still holds KV), its engine id → the host and port of its
registered URL. The decode role pulls a prompt's KV only from a prefill-capable one (role
prefill or both; `kv_source`), at that address (decode.leg): naming an address in
`kv_transfer_params` is not enough to become a "prefill" of this cluster. A node pulls a
shared prefix from any of them (`kv_peer`; node/kv_pull.py). Writing a registration needs the
cluster's etcd, which is the operator's to protect.

Invariants: until the registrations were listed once, `listed` is False and nothing is a
member (the decode role then refuses with a retryable 503); while etcd is unreachable the last
listed view stays (as the coordinator's does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from protocol.cluster import NodeInfo, NodeTask

log = logging.getLogger("duet.node")
#: roles whose nodes serve KV to decode nodes
_KV_SOURCES = ("prefill", "both")


class ClusterMembers:
    """node.legs.Membership over the registrations (fed by a Registry's callbacks)."""

    def __init__(self) -> None:
        self._listed = False
        #: node id → (engine id, host, port, prefill-capable) of each generation node
        self._nodes: dict[str, tuple[str, str, int, bool]] = {}
        self._by_engine: dict[str, tuple[str, int]] = {}
        self._peers: dict[str, tuple[str, int]] = {}

    @property
    def listed(self) -> bool:
        return self._listed

    def kv_source(self, engine_id: str) -> tuple[str, int] | None:
        return self._by_engine.get(engine_id)

    def kv_hosts(self) -> set[str]:
        return {host for _, host, _, source in self._nodes.values() if source}

    def kv_peer(self, engine_id: str) -> tuple[str, int] | None:
        return self._peers.get(engine_id)

    def sync(self, nodes: dict[str, NodeInfo]) -> None:
        self._nodes = {}
        for info in nodes.values():
            self._add(info)
        self._listed = True
        self._index()

    def put(self, info: NodeInfo) -> None:
        self._nodes.pop(info.node_id, None)
        self._add(info)
        self._index()

    def delete(self, node_id: str) -> None:
        if self._nodes.pop(node_id, None) is not None:
            self._index()

    def _add(self, info: NodeInfo) -> None:
        if info.task != NodeTask.GENERATE:
            return
        try:
            url = urlsplit(info.url)
            host, port = url.hostname, url.port
        except ValueError:
            host = port = None
        if not host or not port:
            log.warning(
                "ignoring the registration of %r: no host and port in its url %r",
                info.node_id,
                info.url,
            )
            return
        self._nodes[info.node_id] = (info.engine_id, host, port, info.role in _KV_SOURCES)

    def _index(self) -> None:
        nodes = self._nodes.values()
        self._by_engine = {e: (host, port) for e, host, port, source in nodes if source}
        self._peers = {e: (host, port) for e, host, port, _ in nodes}


def members_ctx(state: Any) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that mirrors the cluster's registrations into `state.members` while the
    app runs (reads `state.config.etcd/cluster`)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        from coordinator.etcd_store import EtcdStore
        from coordinator.registry import Registry

        cfg = state.config
        store = EtcdStore(cfg.etcd)
        members = ClusterMembers()
        registry = Registry(
            store, cfg.cluster, on_sync=members.sync, on_put=members.put, on_delete=members.delete
        )
        state.members = members
        task = asyncio.create_task(registry.run(), name="cluster-members")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()

    return ctx
