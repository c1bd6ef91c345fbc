"""The gateway's own view of the cluster, read from etcd (`--etcd`): coordinator replicas and
active nodes per model (protocol.cluster keys).

It lets the gateway find every coordinator replica without a list, and route on its own
(least-loaded by its in-flight counts, through `StaticRouter`) when no coordinator answers.
The view is re-read every `interval_s` (a full read of two small prefixes: simpler than a
watch that must survive reconnects, and the data changes slowly); while etcd is unreachable
the last good view stays in use.

Invariant: node URLs come only from NodeInfo records nodes registered, never from a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlparse

import aetcd
import msgspec

from gateway.config import StaticNodes
from protocol.cluster import NodeInfo, coordinators_prefix, nodes_prefix

log = logging.getLogger("duet.gateway.etcd")
_NODE = msgspec.json.Decoder(NodeInfo)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    u = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    return u.hostname or "127.0.0.1", u.port or 2379


def _coordinator_url(value: bytes) -> str | None:
    """A replica's registration: its URL, or a JSON object with `url`."""
    text = value.decode(errors="replace").strip()
    if text.startswith("{"):
        with contextlib.suppress(msgspec.DecodeError, AttributeError):
            url = msgspec.json.decode(value).get("url")
            return url if isinstance(url, str) else None
        return None
    return text if text.startswith(("http://", "https://")) else None


def pools_from(infos: Iterable[NodeInfo]) -> dict[str, StaticNodes]:
    """Model → its active nodes by role, with each node's KV layout hash, so the static router
    pairs P and D by the coordinator's rule (protocol.cluster.kv_layouts_match)."""
    pools: dict[str, dict[str, list[str]]] = {}
    layouts: dict[str, dict[str, str]] = {}
    for info in infos:
        if info.status != "active":
            continue
        pools.setdefault(info.model, {"prefill": [], "decode": [], "both": []})[info.role].append(info.url)
        layouts.setdefault(info.model, {})[info.url] = info.kv_layout_hash
    return {m: StaticNodes(prefill=tuple(sorted(p["prefill"])), decode=tuple(sorted(p["decode"])),
                           both=tuple(sorted(p["both"])), kv_layouts=layouts[m]) for m, p in pools.items()}  # fmt: skip


class EtcdView:
    def __init__(self, endpoint: str, cluster: str, interval_s: float = 2.0) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        self.cluster = cluster
        self.interval_s = interval_s
        self.coordinators: list[str] = []
        self.nodes: dict[str, StaticNodes] = {}
        self.loaded = asyncio.Event()

    def pool(self, model: str) -> StaticNodes | None:
        return self.nodes.get(model)

    async def refresh(self, client: aetcd.Client) -> None:
        coords = []
        for kv in await client.get_prefix(coordinators_prefix(self.cluster).encode()):
            url = _coordinator_url(kv.value)
            if url:
                coords.append(url)
        infos = []
        for kv in await client.get_prefix(nodes_prefix(self.cluster).encode()):
            try:
                infos.append(_NODE.decode(kv.value))
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("ignoring a malformed node record at %s", kv.key.decode(errors="replace"))
        self.coordinators = sorted(coords)
        self.nodes = pools_from(infos)
        self.loaded.set()

    async def run(self) -> None:
        warned = False
        while True:
            try:
                async with aetcd.Client(host=self.host, port=self.port, timeout=5) as client:
                    while True:
                        await self.refresh(client)
                        if warned:
                            log.info("etcd at %s:%d is reachable again", self.host, self.port)
                            warned = False
                        await asyncio.sleep(self.interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not warned:
                    log.warning("cannot read the cluster from etcd at %s:%d (%s); keeping the last view",
                                self.host, self.port, e)  # fmt: skip
                    warned = True
                await asyncio.sleep(self.interval_s)

    async def lifecycle(self, first_load_timeout_s: float = 5.0) -> AsyncIterator[None]:
        task = asyncio.ensure_future(self.run())
        try:
            await asyncio.wait_for(self.loaded.wait(), first_load_timeout_s)
        except TimeoutError:
            log.warning("no cluster view from etcd after %.0fs; starting without it", first_load_timeout_s)
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
