"""What the gateway's handlers share, built complete by one factory: `open_state`.

`GatewayState` is made once the event loop runs (the store opened, the HTTP session, the
models with their tokenizers and backends, the cluster's etcd view) and holds no field that is
filled in later: a handler never checks whether a part exists. Domain objects take the narrow
parts they use (`Serving` for the request pipeline, `Books` for a ledger, `Auth` for a
handler's caller), never the state.

`open_state` owns every lifetime it starts and ends them in the reverse order: the background
tasks (the store heartbeat, the loop-lag heartbeat), the usage writer (flushed), this gateway's
heartbeat row, the cluster backend's pending aborts, the node client, the nodes' HTTP session,
the etcd view, the HTTP session (coordinators, providers), the store, the grammar checker's
threads, and tracing's export queue (flushed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp

from gateway.accounts import heartbeat
from gateway.accounts.auth import Auth
from gateway.accounts.key_cache import KeyCache
from gateway.accounts.ledger import Books
from gateway.accounts.store.base import Store
from gateway.accounts.store.dsn import redact
from gateway.accounts.usage_writer import UsageWriter
from gateway.backends.base import ServedModel
from gateway.backends.build import Wiring, cluster_backend, coordinator_urls, served_models
from gateway.backends.etcd_view import EtcdView
from gateway.backends.loop_lag import LoopLag
from gateway.backends.node_client import NodeClient
from gateway.backends.node_silence import SocketFactory, silent_socket_factory
from gateway.backends.provider import ProviderBackend
from gateway.backends.providers.base import Provider
from gateway.backends.providers.metrics import register_provider_metrics
from gateway.backends.routing import NodeLoad
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.serving.choice import ModelChoice
from gateway.serving.context import Serving
from gateway.serving.tiers import Admission
from protocol.cluster import NodeInfo
from runtime.tracing import Tracing
from text.guide_compile import GuideChecker

log = logging.getLogger("duet.gateway")


class Topology:
    """The cluster as the console shows it: the coordinator replicas (configured, then those
    registered in etcd) and the nodes etcd lists (none without [routing] etcd)."""

    def __init__(self, urls: Callable[[], list[str]], etcd: EtcdView | None) -> None:
        self.coordinator_urls = urls
        #: etcd's view of the cluster (None: the gateway reads no etcd)
        self.etcd = etcd

    @property
    def nodes(self) -> Sequence[NodeInfo]:
        return self.etcd.infos if self.etcd is not None else ()


@dataclass(frozen=True)
class GatewayState:
    config: GatewayConfig
    store: Store
    metrics: GatewayMetrics
    #: OpenTelemetry (off: every span site is a no-op); its ring feeds the console
    tracing: Tracing
    #: API keys and the admin key (gateway/accounts/auth.py)
    auth: Auth
    #: the one HTTP session: nodes, coordinators, providers, the console's fetches
    session: aiohttp.ClientSession
    topology: Topology
    #: what the request pipeline serves with: models, choice, admission, books…
    serving: Serving


def _guides(config: GatewayConfig, metrics: GatewayMetrics) -> GuideChecker:
    return GuideChecker(
        config.server.guide_compile_timeout_s,
        config.server.guide_compile_threads,
        on_compile=lambda v: metrics.guide_compiles.labels(verdict=v.value).inc(),
        running=metrics.guide_compiling.set,
        # a team (a cache domain) compiles on half the threads at most: the rest stay free
        # for the other teams' structured outputs
        domain_threads=max(1, config.server.guide_compile_threads // 2),
    )


def _session(
    config: GatewayConfig, tracing: Tracing, sockets: SocketFactory | None = None
) -> aiohttp.ClientSession:
    """A session for coordinators and providers, or with `sockets` for nodes: it carries no
    cluster secret (NodeClient and the route client add it per request); it trusts --tls-ca
    besides the system's CAs."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=0,
            limit_per_host=config.routing.max_connections_per_node,
            ssl=config.security.client_ssl(),
            socket_factory=sockets,
        ),
        trace_configs=tracing.trace_configs(),
    )


def _tasks(stack: contextlib.AsyncExitStack, *coros: Awaitable[None]) -> None:
    """Run each coroutine as a task until the stack closes."""
    tasks = [asyncio.ensure_future(c) for c in coros]

    async def stop() -> None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    stack.push_async_callback(stop)


@contextlib.asynccontextmanager
async def open_state(
    config: GatewayConfig, store: Store, metrics: GatewayMetrics, tracing: Tracing
) -> AsyncIterator[GatewayState]:
    """The gateway's state, complete, for as long as the context lasts (see the docstring)."""
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(asyncio.to_thread, tracing.shutdown)  # flushes queued spans
        guides = _guides(config, metrics)
        stack.callback(guides.close)
        await store.open()
        stack.push_async_callback(store.close)
        instance = config.server.instance
        # this process's identity in the store; a named gateway's says which one it is, so its
        # next life reclaims what this one leaves
        life = uuid.uuid4().hex[:16]
        gateway_id = f"{instance}/{life}" if instance else f"gw-{life}"
        writer = UsageWriter(store, metrics, config.quotas.usage_batch)
        books = Books(store, writer, metrics, tracing, config.quotas, gateway_id)
        if instance:
            await heartbeat.reclaim_previous_life(books, instance)
        session = _session(config, tracing)
        stack.push_async_callback(session.close)
        lag = LoopLag()
        wiring = await _wiring(stack, config, session, lag, metrics, tracing)
        cluster = cluster_backend(wiring, NodeLoad())
        stack.push_async_callback(cluster.drain)
        models = served_models(wiring, cluster)
        stack.push_async_callback(_leave, books)
        await stack.enter_async_context(contextlib.asynccontextmanager(writer.lifecycle)())
        _tasks(stack, heartbeat.run(books), lag.run())
        log.info(
            "gateway serving %s; store %s", ", ".join(sorted(models)), redact(config.store_url)
        )
        serving = _serving(config, models, guides, books, metrics)
        yield GatewayState(
            config=config,
            store=store,
            metrics=metrics,
            tracing=tracing,
            auth=Auth(KeyCache(store, config.server.key_cache_ttl_s), config),
            session=session,
            topology=Topology(coordinator_urls(config, wiring.view), wiring.view),
            serving=serving,
        )


async def _wiring(
    stack: contextlib.AsyncExitStack,
    config: GatewayConfig,
    session: aiohttp.ClientSession,
    lag: LoopLag,
    metrics: GatewayMetrics,
    tracing: Tracing,
) -> Wiring:
    """What the backends are built on: the node client and etcd's view (when configured), both
    ended with the stack."""
    rc = config.routing
    view = EtcdView(rc.etcd, rc.cluster) if rc.etcd else None
    if view is not None:
        await stack.enter_async_context(contextlib.asynccontextmanager(view.lifecycle)())
    # the nodes' own pool: its sockets bound the node's silence from their connect on, which a
    # provider across the internet must not get
    node_session = _session(config, tracing, silent_socket_factory(rc.connect_timeout_s))
    stack.push_async_callback(node_session.close)
    nodes = NodeClient(
        node_session,
        rc.connect_timeout_s,
        rc.prefill_timeout_s,
        rc.read_timeout_s,
        lag,
        auth=config.security.headers,
    )
    nodes.stall_timeout_s = rc.stall_timeout_s
    stack.push_async_callback(nodes.close)
    return Wiring(config, session, nodes, view, metrics, tracing)


def _serving(
    config: GatewayConfig,
    models: dict[str, ServedModel],
    guides: GuideChecker,
    books: Books,
    metrics: GatewayMetrics,
) -> Serving:
    def providers() -> list[Provider]:
        return [
            m.backend.provider for m in models.values() if isinstance(m.backend, ProviderBackend)
        ]

    return Serving(
        config=config,
        models=models,
        choice=ModelChoice(config, models),
        admission=Admission(config.tiers, metrics),
        guides=guides,
        tracing=books.tracing,
        books=books,
        fallbacks=register_provider_metrics(metrics.registry, providers),
    )


async def _leave(books: Books) -> None:
    """A clean stop: nothing of ours is left to reclaim."""
    with contextlib.suppress(Exception):
        await books.store.leave(books.gateway_id)
