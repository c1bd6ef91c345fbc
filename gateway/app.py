"""The gateway's aiohttp application, built by `make_app(config)`.

The middleware gives every request the gateway's own X-Request-Id, turns every error —
ours (APIError), aiohttp's (404/405/413) and unexpected ones (500, logged) — into OpenAI's
error body with the right status, and never lets one request's failure reach another.
`cleanup_ctx` owns everything with a lifetime: the store, the one ClientSession, the usage
writer, the reservation sweeper, the model backends, and the batch runner (batch_wiring.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import admin, anthropic_api, batch_wiring, embeddings, responses_api, serve
from gateway.auth import MIN_ADMIN_KEY, admin_or_team, is_admin
from gateway.backend import Backend
from gateway.choice import ModelChoice
from gateway.cluster import ClusterBackend
from gateway.config import AUTO, ConfigError, GatewayConfig, ModelConfig, StaticNodes
from gateway.console import install as install_console
from gateway.etcd_view import EtcdView
from gateway.key_cache import KeyCache
from gateway.ledger import streamed_report, streamed_reported
from gateway.loop_lag import LoopLag
from gateway.metrics import GatewayMetrics
from gateway.node_client import NodeClient
from gateway.provider_backend import ProviderBackend, make_backend
from gateway.provider_slots import ProviderSlots
from gateway.providers.metrics import register_provider_metrics
from gateway.requests import Endpoint
from gateway.routing import CoordinatorRouter, FailoverRouter, NodeLoad, Router, StaticRouter
from gateway.state import GatewayState, ServedModel
from gateway.store import open_store
from gateway.store.base import StoreError
from gateway.tiers import Admission, Shed
from gateway.usage_writer import UsageWriter
from protocol.cluster import NodeTask
from protocol.openai import APIError
from runtime.cluster_secret import metrics_middleware
from runtime.http_errors import error_middleware
from runtime.models import resolve_model
from runtime.tracing import DEFAULT_RING, from_env, setup
from text.guide_compile import GuideChecker
from text.tokenizer import Tokenizer

log = logging.getLogger("duet.gateway")
STATE = web.AppKey("state", GatewayState)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_ENC = msgspec.json.Encoder()


@web.middleware
async def _request_id(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request gets the gateway's own id (never the client's: it names engine requests on
    shared nodes)."""
    request[_RID] = f"req-{uuid.uuid4().hex}"
    return await handler(request)


def _translate(request: web.Request, e: BaseException) -> APIError | None:
    """The gateway's own errors for the shared middleware: store conflicts, the body limit."""
    if isinstance(e, StoreError):
        return APIError(e.status, str(e), code="conflict" if e.status == 409 else "not_found")
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        limit = request.app[STATE].config.server.max_body_bytes
        return APIError(
            413,
            f"the request body is larger than this gateway accepts ({limit} bytes)",
            code="request_too_large",
        )
    return None


_RID = web.RequestKey("request_id", str)


def _bind(fn: Callable[[GatewayState, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
    async def h(request: web.Request) -> web.StreamResponse:
        return await fn(request.app[STATE], request)

    return h


def _completions(endpoint: Endpoint) -> Handler:
    async def h(request: web.Request) -> web.StreamResponse:
        return await serve.handle(request.app[STATE], request, endpoint, request[_RID])

    return h


async def _messages(request: web.Request) -> web.StreamResponse:
    return await anthropic_api.handle(request.app[STATE], request, request[_RID])


async def _responses(request: web.Request) -> web.StreamResponse:
    return await responses_api.handle(request.app[STATE], request, request[_RID])


async def _embeddings(request: web.Request) -> web.StreamResponse:
    return await embeddings.handle(request.app[STATE], request, request[_RID])


async def _models(request: web.Request) -> web.Response:
    s = request.app[STATE]
    await admin_or_team(s, request)
    data = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "external" if m.config.kind == "external" else "duet",
            "max_model_len": m.max_model_len,
            "capability_rank": m.config.capability_rank,
            "tiers": list(m.config.tiers),
            "fallback": list(m.config.fallback),
        }
        for name, m in sorted(s.models.items())
    ]
    if s.choice is not None and s.choice.router is not None:
        data.append(
            {
                "id": AUTO,
                "object": "model",
                "created": 0,
                "owned_by": "duet",
                "candidates": sorted(s.choice.auto_catalog),
            }
        )
    return web.Response(
        body=_ENC.encode({"object": "list", "data": data}), content_type="application/json"
    )


async def _health(request: web.Request) -> web.Response:
    s = request.app[STATE]
    body = {
        "status": "ok",
        "models": sorted(s.models),
        "running": s.admission.running,
        "waiting": {t: s.admission.depth(t) for t in ("interactive", "batch")},
    }
    if batch_wiring.RUNNER in request.app:
        body["batch"] = batch_wiring.health(request.app[batch_wiring.RUNNER])
    return web.json_response(body)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=generate_latest(request.app[STATE].metrics.registry),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


def _metrics_reader(config: GatewayConfig) -> Callable[[web.Request], bool]:
    """Who may read a protected /metrics: the cluster secret's holders and the admin."""
    secret = config.security.secret

    def check(request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        if secret is not None and secret.verify(header):
            return True
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        state, address = request.app[STATE], request.remote or ""
        try:  # the admin endpoints' per-address limit on failed attempts holds here too
            state.admin_guard.check(address)
        except APIError:
            return False  # blocked: the key is not even compared
        if is_admin(state, token.strip()):
            return True
        state.admin_guard.failed(address)
        return False

    return check


def make_app(config: GatewayConfig) -> web.Application:
    errors = error_middleware(log, _translate, lambda r: r.get(_RID))
    admin_key = config.admin_key
    if admin_key is not None and len(admin_key) < MIN_ADMIN_KEY:
        raise ConfigError(
            f"$DUET_ADMIN_KEY is {len(admin_key)} characters; an admin key needs at least {MIN_ADMIN_KEY} "
            "(generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    # --protect-metrics: /metrics needs the cluster secret or the admin key (the rest of the
    # gateway's API has its own keys).
    if (
        config.security.protect_metrics
        and config.security.secret is None
        and not (admin_key or config.server.admin_key_sha256)
    ):
        raise ConfigError(
            "--protect-metrics needs a cluster secret or an admin key: nothing could read /metrics"
        )
    guard = [metrics_middleware(_metrics_reader(config))] if config.security.protect_metrics else []
    app = web.Application(
        middlewares=[*guard, _request_id, errors], client_max_size=config.server.max_body_bytes
    )
    metrics = GatewayMetrics()
    store = open_store(config.store_url)
    app[STATE] = GatewayState(
        config=config,
        store=store,
        metrics=metrics,
        writer=UsageWriter(store, metrics, config.quotas.usage_batch),
        admission=Admission(config.tiers, metrics),
        keys=KeyCache(store, config.server.key_cache_ttl_s),
        guides=GuideChecker(
            config.server.guide_compile_timeout_s,
            config.server.guide_compile_threads,
            on_compile=lambda v: metrics.guide_compiles.labels(verdict=v.value).inc(),
            running=metrics.guide_compiling.set,
        ),
    )
    state = app[STATE]
    state.tracing = setup("duet-gateway", from_env(DEFAULT_RING, config.tracing))
    # public endpoints: a client's traceparent is a link, never the parent (runtime/tracing.py)
    state.tracing.install(app, after=_request_id, trust_parent=False)
    state.provider_metrics = register_provider_metrics(
        metrics.registry,
        lambda: [
            m.backend.provider
            for m in state.models.values()
            if isinstance(m.backend, ProviderBackend)
        ],
    )
    app.cleanup_ctx.append(_lifecycle)
    if config.batch.enabled:  # after _lifecycle: the runner needs the models and the session
        batch_wiring.install(app, STATE)
    r = app.router
    r.add_post("/v1/chat/completions", _completions(Endpoint.CHAT))
    r.add_post("/v1/completions", _completions(Endpoint.COMPLETION))
    r.add_post("/v1/messages", _messages)
    r.add_post("/v1/responses", _responses)
    r.add_post("/v1/embeddings", _embeddings)
    r.add_get("/v1/models", _models)
    r.add_get("/v1/usage", _bind(admin.usage))
    r.add_get("/health", _health)
    r.add_get("/metrics", _metrics)
    r.add_post("/admin/teams", _bind(admin.create_team))
    r.add_get("/admin/teams", _bind(admin.list_teams))
    r.add_get("/admin/teams/{id}", _bind(admin.list_teams))
    r.add_put("/admin/teams/{id}", _bind(admin.update_team))
    r.add_delete("/admin/teams/{id}", _bind(admin.delete_team))
    r.add_post("/admin/keys", _bind(admin.create_key))
    r.add_get("/admin/keys", _bind(admin.list_keys))
    r.add_delete("/admin/keys/{id}", _bind(admin.revoke_key))
    r.add_get("/admin/batches", _bind(admin.list_batches))
    r.add_post("/admin/batches/{id}/cancel", _bind(admin.cancel_batch))
    install_console(app, STATE)  # /console: the operator console (gateway/console)
    return app


def _max_model_len(m: ModelConfig, directory: Path) -> int:
    if m.max_model_len:
        return m.max_model_len
    cfg = (
        json.loads((directory / "config.json").read_text())
        if (directory / "config.json").is_file()
        else {}
    )
    return int(cfg.get("max_position_embeddings") or 4096)


def _router(
    s: GatewayState, load: NodeLoad, view: EtcdView | None, task: NodeTask = NodeTask.GENERATE
) -> Router:
    """Coordinator replicas (configured, plus those registered in etcd) first; the static
    node lists (configured, else etcd's view) of the task's nodes when no replica answers, or
    when there is none."""
    cfg = s.config
    static = StaticRouter(
        lambda name: _static_nodes(cfg, name, task) or (view.pool(name, task) if view else None),
        load,
    )
    configured = list(cfg.routing.coordinator)
    if not configured and view is None:
        return static
    assert s.session is not None

    def replicas() -> list[str]:
        return configured + [u for u in (view.coordinators if view else []) if u not in configured]

    coord = CoordinatorRouter(
        s.session, replicas, cfg.routing.route_timeout_s, cfg.security.headers
    )
    return FailoverRouter(
        coord, static, lambda reason: s.metrics.route_fallback.labels(reason=reason).inc()
    )


def _static_nodes(
    cfg: GatewayConfig, cluster_name: str, task: NodeTask = NodeTask.GENERATE
) -> StaticNodes | None:
    for m in cfg.models.values():
        if (
            m.cluster_name == cluster_name
            and m.static is not None
            and (m.kind == "embedding") == (task == NodeTask.EMBED)
        ):
            return m.static
    return None


def _embedding_size(directory: Path) -> int | None:
    """An embedding model's vector size (config.json's hidden_size; None: unknown here, the
    node checks `dimensions` then)."""
    f = directory / "config.json"
    size = json.loads(f.read_text()).get("hidden_size") if f.is_file() else None
    return int(size) if size else None


def _external_backend(m: ModelConfig, s: GatewayState, slots: ProviderSlots) -> Backend:
    assert s.session is not None
    return make_backend(m, s.session, slots)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    s = app[STATE]
    cfg = s.config
    await s.store.open()
    if cfg.server.instance:  # a restart of a named gateway frees its dead life's team slots at once
        s.gateway_id = f"{cfg.server.instance}/{uuid.uuid4().hex[:16]}"
        n = await s.store.reclaim_previous(cfg.server.instance, s.gateway_id)
        if n:
            log.warning(
                "reclaimed %d reservations of this gateway's previous life (%s; billed at their prompt and "
                "what they had streamed)",
                n,
                cfg.server.instance,
            )
    # One session for nodes, coordinators and providers: it carries no cluster secret (NodeClient
    # and the route client add it per request); it trusts --tls-ca besides the system's CAs.
    s.session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=0,
            limit_per_host=cfg.routing.max_connections_per_node,
            ssl=cfg.security.client_ssl(),
        ),
        trace_configs=s.tracing.trace_configs(),
    )
    load = NodeLoad()
    rc = cfg.routing
    view = EtcdView(rc.etcd, rc.cluster) if rc.etcd else None
    view_life = view.lifecycle() if view else None
    if view_life is not None:
        await view_life.__anext__()
    lag = LoopLag()
    nodes = NodeClient(
        s.session,
        rc.connect_timeout_s,
        rc.prefill_timeout_s,
        rc.read_timeout_s,
        lag,
        auth=cfg.security.headers,
    )
    router = _router(s, load, view)
    s.etcd_view = view
    s.coordinator_urls = lambda: (
        list(rc.coordinator)
        + [u for u in (view.coordinators if view else []) if u not in rc.coordinator]
    )
    cluster = ClusterBackend(
        nodes, router, load, rc, on_retry=lambda k: s.metrics.retries.labels(kind=k).inc()
    )
    slots = ProviderSlots(
        cfg.server.max_provider_calls, s.metrics
    )  # one bound for every external model
    embed_router = (
        _router(s, load, view, NodeTask.EMBED)
        if any(m.kind == "embedding" for m in cfg.models.values())
        else None
    )
    for name, m in cfg.models.items():
        if m.kind == "cluster":
            assert m.tokenizer is not None
            directory = resolve_model(m.tokenizer).directory
            s.models[name] = ServedModel(
                m, cluster, Tokenizer(directory), _max_model_len(m, directory)
            )
        elif m.kind == "embedding":
            assert m.tokenizer is not None and embed_router is not None
            directory = resolve_model(m.tokenizer).directory
            backend = embeddings.EmbeddingBackend(
                nodes, embed_router, rc, _embedding_size(directory)
            )
            s.models[name] = ServedModel(
                m, backend, Tokenizer(directory), _max_model_len(m, directory)
            )
        else:
            s.models[name] = ServedModel(
                m, _external_backend(m, s, slots), None, m.max_model_len or 1 << 20
            )
    s.choice = ModelChoice(cfg, s.models)
    cluster.tracing = s.tracing
    writer = s.writer.lifecycle()
    await writer.__anext__()
    sweeper = asyncio.ensure_future(_sweep(s))
    heartbeat = asyncio.ensure_future(lag.run())
    log.info("gateway serving %s; store %s", ", ".join(sorted(s.models)), cfg.store_url)
    try:
        yield
    finally:
        sweeper.cancel()
        heartbeat.cancel()
        await asyncio.gather(sweeper, heartbeat, return_exceptions=True)
        with contextlib.suppress(StopAsyncIteration):
            await writer.__anext__()
        with contextlib.suppress(Exception):  # a clean stop: nothing of ours is left to reclaim
            await s.store.leave(s.gateway_id)
        await cluster.drain()
        await nodes.close()
        if view_life is not None:
            with contextlib.suppress(StopAsyncIteration):
                await view_life.__anext__()
        await s.session.close()
        await s.store.close()
        s.guides.close()
        await asyncio.to_thread(s.tracing.shutdown)  # flushes the spans still queued for export


#: a gateway whose heartbeat is this many heartbeats old is dead (its reservations reclaimed)
DEAD_AFTER_HEARTBEATS = 2.5


async def _sweep(s: GatewayState) -> None:
    """Every heartbeat: this gateway's heartbeat (which renews its own reservations, so a
    request outliving the TTL still counts, and reports the tokens each stream has sent, which
    a booking bills if this gateway dies), the reclaim of dead gateways' reservations (a
    killed gateway's, its own previous life's included), and the expiry of lapsed ones."""
    q = s.config.quotas
    while True:
        try:
            report = streamed_report(s)
            await s.store.heartbeat(s.gateway_id, q.reservation_ttl_s, streamed=report)
            streamed_reported(s, report)
            n = await s.store.reclaim(DEAD_AFTER_HEARTBEATS * q.heartbeat_s)
            if n:
                log.warning(
                    "reclaimed %d reservations of a gateway that stopped (billed at their prompt and "
                    "what they had streamed)",
                    n,
                )
            n = await s.store.expire_reservations()
            if n:
                log.warning("expired %d stale quota reservations", n)
        except Exception:
            log.exception("the reservation heartbeat failed")
        await asyncio.sleep(q.heartbeat_s)


__all__ = ["STATE", "Shed", "make_app"]
