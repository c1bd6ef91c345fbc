"""One coordinator replica's live state: the nodes it sees in etcd, a subscriber per node
feeding the prefix index and load, the router, and its election.

Invariants: a node has a view and a subscriber iff its registration is in etcd (as last
seen); a node leaving etcd is dropped from the index at once; a node whose URL or engine id
changed (restarted under the same id) gets a fresh subscriber and a fresh index entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from coordinator.election import Election
from coordinator.index import PrefixIndex
from coordinator.kv_reuse import RouteReuse
from coordinator.lora import AdapterLoadFailed, AdapterPlacer
from coordinator.metrics import CoordinatorMetrics, count_nodes
from coordinator.nodes import NodeView
from coordinator.policy import Router
from coordinator.registry import Registry
from coordinator.route_config import Decision, PolicyConfig
from coordinator.store import Store
from coordinator.subscriber import Subscriber
from protocol.cluster import (
    DEFAULT_CLUSTER,
    NODE_TTL_S,
    ClusterNode,
    ClusterReport,
    LoadReport,
    ModelReuse,
    NodeInfo,
    NodeTask,
    PendingReport,
    TierTokens,
)
from protocol.openai import APIError
from protocol.planner import PlannerReport
from protocol.route import RouteRequest
from runtime.plane import PlaneSecurity
from runtime.read_deadlines import ReadDeadlines

log = logging.getLogger("duet.coordinator")
#: routes tried for a request whose LoRA adapter a chosen node could not load
ROUTE_ATTEMPTS = 3
_TIERS = ("pool", "host", "disk", "peer")


@dataclass
class CoordinatorConfig:
    """What an operator sets for one coordinator replica; `duet coordinator`'s flags are
    generated from these fields (duet/config_flags.py), their help from the `#:` comments."""

    #: etcd client URL
    etcd: str = field(default="http://127.0.0.1:2379", metadata={"metavar": "URL"})
    #: cluster name (etcd key prefix /duet/NAME/)
    cluster: str = DEFAULT_CLUSTER
    #: address to listen on
    host: str = "127.0.0.1"
    #: port of the routing API
    port: int = 8400
    #: stable name of this replica (default: coordinator-HOSTNAME-PORT)
    replica_id: str | None = None
    #: URL gateways use to reach this replica (default: http://HOST:PORT)
    advertise_url: str | None = field(default=None, metadata={"metavar": "URL"})
    #: memory bound of the prefix index, in block hashes (the least recently matched go first)
    index_max_blocks: int = 1_000_000
    #: lease TTL of this replica's membership and leadership, in seconds
    ttl_s: int = field(default=NODE_TTL_S, metadata={"hidden": True})
    #: how /route picks a prefill/decode pair
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    #: cluster secret, TLS and /metrics policy of the internal plane (runtime/plane.py)
    security: PlaneSecurity = field(default_factory=PlaneSecurity)
    #: deadlines for reading a request's headers and body (slow clients)
    deadlines: ReadDeadlines = field(default_factory=ReadDeadlines)

    def __post_init__(self) -> None:
        if self.index_max_blocks < 1:
            raise ValueError("--index-max-blocks must be ≥ 1")
        if self.ttl_s < 2:
            raise ValueError("--ttl-s must be ≥ 2 seconds")
        if self.policy.local_prefill_tokens < 0:
            raise ValueError("--local-prefill-tokens must be ≥ 0")

    @property
    def resolved_replica_id(self) -> str:
        return self.replica_id or f"coordinator-{socket.gethostname()}-{self.port}"

    @property
    def url(self) -> str:
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return self.advertise_url or f"{self.security.own_scheme}://{host}:{self.port}"


class Coordinator:
    def __init__(self, config: CoordinatorConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self.replica_id = config.resolved_replica_id
        self.index = PrefixIndex(config.index_max_blocks)
        self.router = Router(config.policy)
        self.views: dict[str, NodeView] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.etcd_connected = False
        self.metrics = CoordinatorMetrics(self._metric_snapshot)
        self.election = Election(store, config.cluster, self.replica_id, config.url, config.ttl_s)
        self.registry = Registry(
            store,
            config.cluster,
            on_sync=self._on_sync,
            on_put=self._on_put,
            on_delete=self._on_delete,
            on_connected=self._on_connected,
        )
        self.session: aiohttp.ClientSession | None = None
        #: told of every routing decision (the planner's rate meters); must not raise or block
        self.route_observers: list[Callable[[RouteRequest, Decision], None]] = []
        #: loads requests' LoRA adapters on the nodes routes pick (coordinator/lora.py)
        self.placer = AdapterPlacer(lambda: self.session)
        #: the planner's report for `GET /planner` (set by planner/loop.py; None: no planner here)
        self.planner_report: Callable[[], PlannerReport] | None = None
        self._background: list[asyncio.Task[None]] = []
        #: per model: prompt tokens routed, reuse that existed, reuse captured by tier
        self.reuse: dict[str, Counter[str]] = {}

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.session = self.config.security.client_session()  # nodes' /kv/events, with the secret
        self._background = [
            asyncio.create_task(self.registry.run(), name="registry"),
            asyncio.create_task(self.election.run(), name="election"),
        ]

    async def stop(self) -> None:
        for t in [*self._background, *self._tasks.values()]:
            t.cancel()
        for t in [*self._background, *self._tasks.values()]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        await self.election.resign()
        if self.session is not None:
            await self.session.close()

    # -- registry callbacks ----------------------------------------------------------------
    def _on_connected(self, ok: bool) -> None:
        self.etcd_connected = ok

    def _on_sync(self, nodes: dict[str, NodeInfo]) -> None:
        for node_id in list(self.views):
            if node_id not in nodes:
                self._on_delete(node_id)
        for info in nodes.values():
            self._on_put(info)

    def _on_put(self, info: NodeInfo) -> None:
        view = self.views.get(info.node_id)
        if view is not None and (view.info.url, view.info.engine_id) == (info.url, info.engine_id):
            if view.info.status != info.status:
                log.info("node %s is now %s", info.node_id, info.status)
            view.info = info
            return
        if view is not None:
            log.info(
                "node %s restarted (engine %s → %s)",
                info.node_id,
                view.info.engine_id,
                info.engine_id,
            )
            self._on_delete(info.node_id)
        log.info(
            "node %s joined: %s %s at %s (pool %s, %s)",
            info.node_id,
            info.role,
            info.model,
            info.url,
            info.pool,
            info.status,
        )
        view = NodeView(info=info)
        self.views[info.node_id] = view
        if self.session is not None:
            sub = Subscriber(
                view,
                self.session,
                self.index,
                settle_s=self.config.policy.pending_settle_s,
                on_resync=lambda reason: self.metrics.resyncs.labels(reason).inc(),
                on_lag=self.metrics.event_lag.observe,
            )
            self._tasks[info.node_id] = asyncio.create_task(
                sub.run(), name=f"kv-events-{info.node_id}"
            )

    def _on_delete(self, node_id: str) -> None:
        view = self.views.pop(node_id, None)
        task = self._tasks.pop(node_id, None)
        if task is not None:
            task.cancel()
        self.index.remove_node(node_id)
        if view is not None:
            log.info("node %s left the cluster: dropped from routing and the prefix index", node_id)

    # -- routing ---------------------------------------------------------------------------
    def route(self, req: RouteRequest) -> Decision:
        t0 = time.perf_counter()
        now = time.monotonic()
        try:
            decision = self.router.route(req, self.views.values(), self.index, now)
        except APIError as e:  # counted too: a rising no_capacity rate is what operators page on
            self.metrics.decisions.labels(e.code or "bad_request").inc()
            raise
        finally:
            self.metrics.route_latency.observe(time.perf_counter() - t0)
        # Generation legs reach nodes under the request's X-Request-Id, which their load frames
        # acknowledge (coordinator/nodes.py); embeddings are not acknowledged: settle time.
        ticket = req.request_id if req.task == NodeTask.GENERATE else None
        for node_id, (seqs, tokens, blocks) in decision.pending.items():
            self.views[node_id].add_pending(now, seqs, tokens, blocks, ticket)
        self.metrics.decisions.labels(decision.outcome).inc()
        if decision.reuse is not None:
            self._tally(req.model, decision.reuse)
        for observe in self.route_observers:
            observe(req, decision)
        return decision

    async def route_placed(self, req: RouteRequest) -> Decision:
        """`route`, then the request's LoRA adapter loaded on the chosen nodes that lack it
        (coordinator/lora.py); a node that cannot load it is excluded and the request routed
        again, at most ROUTE_ATTEMPTS times."""
        decision = self.route(req)
        for _ in range(ROUTE_ATTEMPTS):
            if not decision.lora_loads:
                return decision
            assert req.lora_name is not None
            views = [self.views[n] for n in decision.lora_loads if n in self.views]
            path = await self.placer.path_of(req.lora_name, req.lora_path, self.views.values())
            try:
                await self.placer.place(req.lora_name, path, views)
                return decision
            except AdapterLoadFailed as e:
                log.warning("LoRA adapter %s not loaded: %s; routing again", req.lora_name, e)
                req = msgspec.structs.replace(req, exclude=[*req.exclude, e.node_id])
                decision = self.route(req)
        raise APIError(
            503,
            f"LoRA adapter {req.lora_name!r} could not be loaded on {ROUTE_ATTEMPTS} nodes",
            type_="service_unavailable",
            code="no_capacity",
            retry_after_s=1,
        )

    def _tally(self, model: str, reuse: RouteReuse) -> None:
        m = self.metrics
        m.reuse_prompt.labels(model).inc(reuse.prompt_tokens)
        m.reuse_existed.labels(model).inc(reuse.existed)
        tally = self.reuse.setdefault(model, Counter())
        tally["prompt_tokens"] += reuse.prompt_tokens
        tally["existed"] += reuse.existed
        for tier, n in reuse.captured.items():
            if n:
                m.reuse_routed.labels(model, tier).inc(n)
                tally[tier] += n

    def _model_reuse(self) -> list[ModelReuse]:
        """Per model: the routes' reuse (this replica's) and the engines' (their load frames)."""
        delivered: dict[str, Counter[str]] = {}
        for v in self.views.values():
            r = v.load.reuse if v.load is not None else None
            if r is not None:
                d = delivered.setdefault(v.info.model, Counter())
                d.update(
                    prompt_tokens=r.prompt_tokens,
                    pool=r.pool,
                    host=r.host,
                    disk=r.disk,
                    peer=r.peer,
                )
        out = []
        for model in sorted(set(self.reuse) | set(delivered)):
            t, d = self.reuse.get(model, Counter()), delivered.get(model, Counter())
            out.append(
                ModelReuse(
                    model=model,
                    prompt_tokens=t["prompt_tokens"],
                    existed=t["existed"],
                    routed=TierTokens(**{k: t[k] for k in _TIERS}),
                    engine_prompt_tokens=d["prompt_tokens"],
                    delivered=TierTokens(**{k: d[k] for k in _TIERS}),
                )
            )
        return out

    # -- views -----------------------------------------------------------------------------
    def _metric_snapshot(self) -> dict[str, Any]:
        return {
            "index_blocks": len(self.index),
            "index_max_blocks": self.index.max_blocks,
            "index_evictions": self.index.evictions,
            "nodes": count_nodes([(v.info.role, v.info.status) for v in self.views.values()]),
            "is_leader": self.election.is_leader,
            "etcd_connected": self.etcd_connected,
        }

    def cluster(self) -> ClusterReport:
        now = time.monotonic()
        cfg = self.config.policy
        return ClusterReport(
            cluster=self.config.cluster,
            replica_id=self.replica_id,
            leader=self.election.leader,
            is_leader=self.election.is_leader,
            etcd_connected=self.etcd_connected,
            index_blocks=len(self.index),
            index_max_blocks=self.index.max_blocks,
            nodes=[
                self._node_report(v, now, cfg)
                for v in sorted(self.views.values(), key=lambda v: v.node_id)
            ],
            reuse=self._model_reuse(),
        )

    def _node_report(self, v: NodeView, now: float, cfg: PolicyConfig) -> ClusterNode:
        p = v.pending_totals(now, cfg.pending_max_age_s)
        load = v.load
        return ClusterNode(
            node_id=v.node_id,
            role=v.info.role,
            url=v.info.url,
            model=v.info.model,
            pool=v.info.pool,
            status=v.info.status,
            engine_id=v.info.engine_id,
            ready=v.ready(now, cfg.stale_load_s),
            connected=v.connected,
            load_age_s=None if load is None else round(now - v.load_at, 3),
            load=None
            if load is None
            else LoadReport(
                waiting=load.num_requests_waiting,
                running=load.num_requests_running,
                kv_cache_usage_perc=load.kv_cache_usage_perc,
                queued_prefill_tokens=load.queued_prefill_tokens,
                kv_blocks_free=load.kv_blocks_free,
                kv_blocks_total=load.kv_blocks_total,
                ttft_p90_s=load.ttft_p90_s,
                ttft_samples=load.ttft_samples,
                itl_p90_s=load.itl_p90_s,
                itl_samples=load.itl_samples,
                ttft_hist=load.ttft_hist,
                itl_hist=load.itl_hist,
                lora_adapters=load.lora_adapters,
                sleeping=load.sleeping,
            ),
            pending=PendingReport(seqs=p.seqs, prefill_tokens=p.prefill_tokens, blocks=p.blocks),
            indexed_blocks=self.index.node_block_count(v.node_id),
            indexed_host_blocks=self.index.node_tier_count(v.node_id, "host"),
            indexed_disk_blocks=self.index.node_tier_count(v.node_id, "disk"),
            event_seq=v.seq,
            resyncs=v.resyncs,
            event_lag_s=round(v.last_event_lag_s, 4),
            task=v.info.task,
        )
