"""What a node app shares between handlers (stored under one web.AppKey); the roles see it as
node.legs.Node.

`shutdown` is set by SIGTERM/SIGINT or by the engine dying; `exit_code` is what the process
then returns (non-zero after an engine failure, so a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from node.config import NodeConfig
from node.engine_api import NodeEngine
from node.legs import Membership, Roles, RoleStates
from node.metrics import NodeMetrics
from runtime.tracing import Tracing
from text.guide_compile import GuideChecker

if TYPE_CHECKING:
    from kvtransfer import Transport
    from node.remote_kv import RemoteKV


@dataclass
class NodeState:
    config: NodeConfig
    engine: NodeEngine
    metrics: NodeMetrics
    node_id: str
    engine_id: str
    roles: Roles = field(default_factory=Roles)
    #: None on a node that moves no KV (or whose engine moves it itself)
    transport: Transport | None = None
    #: reads peers' KV (node/remote_kv.py): set at start on a node with a transport
    remote_kv: RemoteKV | None = None
    session: aiohttp.ClientSession | None = None
    draining: bool = False
    #: a drain was asked through `POST /drain` (node/drain.py); registration publishes it
    drain_requested: bool = False
    #: monotonic time `status: draining` reached etcd (None: not yet); with `drain_via_etcd`
    #: False (no --etcd) the drain counts as published when it is asked
    drain_published_at: float | None = None
    drain_via_etcd: bool = False
    #: one more each time a drain is undone (`DELETE /drain`): a `POST /drain?wait=` waiter
    #: that sees it change knows its drain was called off
    drain_epoch: int = 0
    #: the owner of this drain (`POST /drain?owner=`; "" : an operator's, never lapses), how
    #: long it lives without a renewal, and when it was last renewed (monotonic)
    drain_owner: str = ""
    drain_lease_s: float = 0.0
    drain_renewed_at: float = 0.0
    #: with --etcd, registration's undo (node/registration.py::Registration.undrain): writes
    #: `status: active` and then ends the drain here; False when the node is exiting
    undrain_registered: Callable[[], Awaitable[bool]] | None = None
    inflight: int = 0
    #: completion requests received, for --fail-fraction's even spread
    completions_seen: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    shutdown: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int = 0
    #: engine request ids of in-flight requests (aborted when the grace period ends)
    active: set[str] = field(default_factory=set)
    #: per-role state set by the roles' start hooks, one object per type (decode: its RemoteKV)
    role_state: RoleStates = field(default_factory=RoleStates)
    #: the cluster's registered nodes (node.members), with --etcd; None without a cluster
    members: Membership | None = None
    #: unix time the node process started (registration, /v1/models)
    started_at: float = field(default_factory=time.time)
    #: OpenTelemetry (off: every span site is a no-op)
    tracing: Tracing = field(default_factory=Tracing.off)
    #: checks request guides' grammars off the event loop, bounded in threads and time
    #: (build_state sizes it from the config and counts its compiles in `metrics`)
    guides: GuideChecker = field(default_factory=GuideChecker)

    def enter(self, engine_request_id: str) -> None:
        self.inflight += 1
        self.active.add(engine_request_id)
        self.idle.clear()

    def leave(self, engine_request_id: str) -> None:
        self.inflight -= 1
        self.active.discard(engine_request_id)
        if self.inflight == 0:
            self.idle.set()
