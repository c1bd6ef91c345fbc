"""What a node app shares between handlers (stored under one web.AppKey)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from node.config import NodeConfig
from node.engine_client import NodeEngine
from node.metrics import NodeMetrics


@dataclass
class NodeState:
    config: NodeConfig
    engine: NodeEngine
    metrics: NodeMetrics
    node_id: str
    engine_id: str
    transport: Any = None  # kvtransfer.Transport, None on a node that moves no KV
    session: aiohttp.ClientSession | None = None
    draining: bool = False
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: engine request ids of in-flight requests (aborted when the grace period ends)
    active: set[str] = field(default_factory=set)
    leases: Any = None  # prefill.leases.LeaseManager on prefill-capable nodes
    remote_kv: Any = None  # decode.remote_kv.RemoteKV on decode-capable nodes

    def enter(self, engine_request_id: str) -> None:
        self.inflight += 1
        self.active.add(engine_request_id)
        self.idle.clear()

    def leave(self, engine_request_id: str) -> None:
        self.inflight -= 1
        self.active.discard(engine_request_id)
        if self.inflight == 0:
            self.idle.set()
