"""Putting a request's LoRA adapter where the router sent it.

The policy (coordinator/policy.py) prefers nodes that hold a request's adapter and charges
`RouteWeights.lora_load` for one that does not, so an adapter spreads to another node exactly
when the nodes holding it are loaded past that cost. A decision that picked such nodes lists them
(`Decision.lora_loads`); before the route is answered, `AdapterPlacer.place` has each of them
load the adapter (`POST /v1/load_lora_adapter`, vLLM's body, with the cluster secret: the
replica's session carries it) and counts it held there until the node's load frames say so. A
node that cannot load it (every slot in use, an unreadable path) is excluded and the request is
routed again (`Coordinator.route_placed`).

Where the adapter is read from: the route request's `lora_path` (a gateway that configures its
adapters knows it), else the directory a node holding it loaded it from (its `GET /v1/models`
lists each adapter with `root`, as vLLM does). Concurrent routes that need the same adapter on
the same node share one load.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp
import msgspec

from coordinator.nodes import NodeView
from protocol.node_api import LoadLoraAdapterRequest
from protocol.openai import APIError

log = logging.getLogger("duet.coordinator")
#: seconds one load may take (reading the adapter and a slot copy: well under a second for
#: adapters of a few hundred MB; the node answers only once it is usable)
LOAD_TIMEOUT_S = 60.0


class AdapterLoadFailed(RuntimeError):
    def __init__(self, node_id: str, why: str) -> None:
        super().__init__(f"{node_id}: {why}")
        self.node_id = node_id


class AdapterPlacer:
    def __init__(self, session: Callable[[], aiohttp.ClientSession | None]) -> None:
        self._session = session
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}

    def _client(self) -> aiohttp.ClientSession:
        s = self._session()
        if s is None:
            raise APIError(503, "the coordinator is starting", type_="service_unavailable")
        return s

    async def path_of(self, name: str, given: str | None, views: Iterable[NodeView]) -> str:
        """Where to read adapter `name` from (404 when nobody knows)."""
        if given:
            return given
        for v in views:
            if not v.holds_adapter(name):
                continue
            try:
                async with self._client().get(
                    v.info.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    models = (await r.json()).get("data", [])
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            root = next((m.get("root") for m in models if m.get("id") == name), None)
            if root:
                return root
        raise APIError(
            404,
            f"LoRA adapter {name!r} is loaded on no node that can say where it lives, and the "
            "route request names no lora_path",
            param="model",
            code="model_not_found",
        )

    async def place(self, name: str, path: str, nodes: list[NodeView]) -> None:
        """Load `name` on every node of `nodes` (concurrently); AdapterLoadFailed names the
        first node that could not."""
        tasks = []
        for v in nodes:
            key = (v.node_id, name)
            task = self._loads.get(key)
            if task is None or task.done():
                task = asyncio.create_task(self._load(v, name, path))
                self._loads[key] = task
                task.add_done_callback(functools.partial(self._forget, key))
            tasks.append(task)
        await asyncio.gather(*[asyncio.shield(t) for t in tasks])

    def _forget(self, key: tuple[str, str], _task: asyncio.Task[None]) -> None:
        self._loads.pop(key, None)

    async def _load(self, v: NodeView, name: str, path: str) -> None:
        body = msgspec.json.encode(LoadLoraAdapterRequest(lora_name=name, lora_path=path))
        t0 = time.monotonic()
        try:
            async with self._client().post(
                v.info.url + "/v1/load_lora_adapter",
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S),
            ) as r:
                text = await r.text()
                # a load raced by another replica's answers "already been loaded": it is there
                if r.status != 200 and "already been loaded" not in text:
                    raise AdapterLoadFailed(v.node_id, f"HTTP {r.status}: {text[:300]}")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise AdapterLoadFailed(v.node_id, f"{type(e).__name__}: {e}") from None
        v.adapters_loaded[name] = time.monotonic()
        log.info("LoRA adapter %s loaded on %s in %.2f s", name, v.node_id, time.monotonic() - t0)
