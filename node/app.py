"""The node's aiohttp application (DESIGN §4 internal API), built by `make_app`.

Middleware gives every request its X-Request-Id (in the log context and the answer); the shared
error middleware (runtime/http_errors.py) turns APIError into OpenAI's error body with the
right status and keeps an unexpected exception from taking the node down (500, logged), and the
node's `_translate` adds its own: 503 when the engine's queue is full (with Retry-After) or the
engine is dead, 413 for a body larger than any prompt within the context can need. A draining
node answers 503 to new completions. Role routes and hooks come from `state.roles`
(node.legs); this module knows no role.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from node.completions import handle_chat_completions, handle_completions, new_request_id
from node.engine_api import EngineDead, EngineOverloaded, RequestRefused
from node.lora import add_lora_routes, lora_engine
from node.request_log import REQUEST_ID
from node.responder import engine_dead
from node.sleep import add_sleep_routes, idle_sleep_ctx
from node.state import NodeState
from protocol.node_api import AbortRequest, NodeHealth
from protocol.openai import APIError
from runtime.http_errors import error_middleware

log = logging.getLogger("duet.node")
STATE = web.AppKey("state", NodeState)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: what a draining node refuses: new work of either task (node/embed.py serves the last one)
_WORK_PATHS = (*_COMPLETION_PATHS, "/v1/embeddings")

#: bytes a body may take beyond its prompt (sampling fields, stop strings, kv_transfer_params)
BODY_OVERHEAD = 1 << 20
#: bytes one prompt token can take in JSON: a token id with its separator, or a token's text
#: with JSON escapes (a long token of escaped characters)
BODY_BYTES_PER_TOKEN = 64


#: an embed node's body limit: 2,048 inputs of token ids, as many as a gateway's largest text
#: body (4 MiB: at least a byte of text per token) can turn into
EMBED_MAX_BODY = 64 * 2**20


def max_body_bytes(max_model_len: int) -> int:
    """The largest body a prompt within the context can need."""
    return BODY_OVERHEAD + BODY_BYTES_PER_TOKEN * max_model_len


@web.middleware
async def _request_id(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The request's X-Request-Id (the gateway's, or a new one) in the log context, for every
    middleware and handler inside (the error answer names it too)."""
    token = REQUEST_ID.set(request.headers.get("X-Request-Id") or new_request_id())
    try:
        return await handler(request)
    finally:
        REQUEST_ID.reset(token)


@web.middleware
async def _draining(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A node that is draining refuses new completions (the gateway retries them elsewhere)."""
    state = request.app[STATE]
    if state.draining and request.method == "POST" and request.path in _WORK_PATHS:
        state.metrics.rejected("draining")
        raise APIError(
            503,
            "this node is shutting down; retry on another node",
            type_="service_unavailable",
            code="draining",
        )
    if state.config.task == "embed" and request.path in _COMPLETION_PATHS:
        raise APIError(
            400,
            "this node serves embeddings only (--task embed): POST /v1/embeddings",
            code="wrong_task",
        )
    return await handler(request)


def _translate(request: web.Request, e: BaseException) -> APIError | None:
    """The node's own failures for the shared error middleware (runtime/http_errors.py)."""
    state = request.app[STATE]
    if isinstance(e, EngineOverloaded):
        state.metrics.rejected("queue_full")
        return APIError(
            503,
            f"this node is overloaded: {e}; retry later or on another node",
            type_="service_unavailable",
            code="overloaded",
            retry_after_s=e.retry_after,
        )
    if isinstance(e, EngineDead):
        state.metrics.rejected("engine_dead")
        return engine_dead(e)
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        state.metrics.rejected("body_too_large")
        limit = request.app._client_max_size  # the limit aiohttp enforced
        return APIError(
            413,
            f"the request body is too large ({e.text or ''}); a prompt within this model's "
            f"context of {state.engine.max_model_len} tokens needs at most {limit} bytes",
            code="request_too_large",
        )
    return None


def _rid(request: web.Request) -> str | None:
    return REQUEST_ID.get()


async def _completions(request: web.Request) -> web.StreamResponse:
    return await handle_completions(request.app[STATE], request)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle_chat_completions(request.app[STATE], request)


async def _models(request: web.Request) -> web.Response:
    """OpenAI's model list: the model this node serves, then its LoRA adapters (vLLM's shape:
    `parent` is the base model) — routers discover them here."""
    s = request.app[STATE]
    model = {
        "id": s.engine.model_name,
        "object": "model",
        "created": int(s.started_at),
        "owned_by": "duet",
        "max_model_len": s.engine.max_model_len,
        "role": s.config.role,
        "quantization": s.engine.kv_layout.weights or None,
    }
    lora = lora_engine(s.engine)
    adapters = [
        {"id": name, "object": "model", "created": int(s.started_at), "owned_by": "duet"}
        | {"root": path, "parent": s.engine.model_name, "max_model_len": s.engine.max_model_len}
        for name, path in (lora.lora_paths() if lora is not None else {}).items()
    ]
    return web.json_response({"object": "list", "data": [model, *adapters]})


async def _health(request: web.Request) -> web.Response:
    """Liveness by default: 503 once the engine died or SIGTERM's grace period began, but 200
    through a drain asked by `POST /drain` or `duet drain` (a long drain is not a dead node).
    `?probe=ready` is readiness: 503 from the moment a drain is asked, whoever asked, until it
    is undone (`DELETE /drain`) — in
    Kubernetes the drained scale-in victim then ranks as a not-ready pod, like any other
    not-ready pod of its Deployment, so the ReplicaSet's pod-deletion-cost decides between them
    (a Ready victim would outrank a starting pod, and the starting pod would be removed instead)."""
    s = request.app[STATE]
    probe = request.query.get("probe", "live")
    if probe not in ("live", "ready"):
        raise APIError(400, f"probe must be 'live' or 'ready', not {probe[:40]!r}", param="probe")
    status, detail = "ok", None
    if s.engine.dead is not None:
        status, detail = "failed", f"engine failed: {s.engine.dead!r}"
    elif s.draining or (probe == "ready" and s.drain_requested):
        status = "draining"
    body = NodeHealth(
        status=status,
        role=s.config.role,
        node_id=s.node_id,
        engine_id=s.engine_id,
        model=s.engine.model_name,
        detail=detail,
    )
    return web.Response(
        status=200 if status == "ok" else 503,
        body=msgspec.json.encode(body),
        content_type="application/json",
    )


async def _metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _kv_metadata(request: web.Request) -> web.Response:
    """The transport handshake (DESIGN §4): any node with a transport serves it, so a peer (or an
    operator) can read its layout before moving a byte."""
    transport = request.app[STATE].transport
    if transport is None:
        raise APIError(404, "this node has no KV transport")
    from kvtransfer import METADATA_CONTENT_TYPE
    from node import kv_network

    # the metadata carries the pool's memory keys: a NIXL reader off this host needs the
    # operator's word that the KV network is isolated
    isolated = request.app[STATE].config.kv_network_isolated
    remote = request.remote or "127.0.0.1"  # none: a unix socket, on this host
    why = kv_network.refusal(remote, isolated, transport.backend, "hand KV to")
    if why is not None:
        log.warning("GET /kv/metadata: %s", why)
        raise APIError(403, why, code=kv_network.CODE)

    return web.Response(body=transport.metadata_bytes(), content_type=METADATA_CONTENT_TYPE)


async def _abort(request: web.Request) -> web.Response:
    s = request.app[STATE]
    try:
        body = msgspec.json.decode(await request.read(), type=AbortRequest)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise APIError(400, f"malformed abort request: {e}") from None
    aborted = await s.engine.abort(body.request_id)
    from node.kv_share import share_id

    with contextlib.suppress(RequestRefused):  # a share a peer holds for the request ends too
        aborted = await s.engine.release_share(share_id(body.request_id)) is not None or aborted
    for hook in s.roles.on_abort:
        aborted = await hook(s, body.request_id) or aborted
    return web.json_response({"aborted": aborted})


def make_app(state: NodeState) -> web.Application:
    """The node app; `state` holds an engine that is built but not started, and the roles
    registered for this node."""
    errors = error_middleware(log, _translate, _rid)
    # The cluster secret first: a request without it reaches nothing (runtime/cluster_secret.py).
    auth = state.config.security.middlewares()
    limit = max_body_bytes(state.engine.max_model_len)
    if state.config.task == "embed":
        limit = max(limit, EMBED_MAX_BODY)
    app = web.Application(
        middlewares=[*auth, _request_id, errors, _draining], client_max_size=limit
    )
    app[STATE] = state
    app.cleanup_ctx.append(_lifecycle)
    state.tracing.install(app, after=_request_id)

    def bind(fn: Callable[[NodeState, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
        async def h(request: web.Request) -> web.StreamResponse:
            return await fn(request.app[STATE], request)

        return h

    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    # vLLM's token-in/token-out endpoints
    from node.generate import handle_generate, handle_render_chat, handle_render_completion

    app.router.add_post("/inference/v1/generate", bind(handle_generate))
    app.router.add_post("/v1/chat/completions/render", bind(handle_render_chat))
    app.router.add_post("/v1/completions/render", bind(handle_render_completion))
    app.router.add_get("/v1/models", _models)
    for method, path, fn in state.roles.routes:
        app.router.add_route(method, path, bind(fn))
    app.router.add_get("/kv/metadata", _kv_metadata)
    from node.kv_share import add_share_routes  # /kv/share, /kv/share/release: KV for peers

    add_share_routes(app, bind)
    app.router.add_post("/abort", _abort)
    from node.drain import handle_delete_drain, handle_get_drain, handle_post_drain

    # the drain endpoint (planner actuators, a pod's preStop hook; DELETE: `duet drain --undo`)
    app.router.add_get("/drain", bind(handle_get_drain))
    app.router.add_post("/drain", bind(handle_post_drain))
    app.router.add_delete("/drain", bind(handle_delete_drain))
    from node.spans import handle_spans

    # LoRA adapters and sleep mode, vLLM's endpoints (node/lora.py, node/sleep.py)
    add_lora_routes(app, bind)
    add_sleep_routes(app, bind)
    if state.config.sleep_after_idle_s is not None:
        app.cleanup_ctx.append(idle_sleep_ctx(state))

    # the console's request view: this node's recent spans of one trace (node/spans.py)
    app.router.add_get("/spans", bind(handle_spans))
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    from node.kv_events import add_kv_event_routes  # /kv/events, /kv/snapshot
    from node.members import members_ctx
    from node.registration import registration_ctx

    add_kv_event_routes(app, state)
    if state.config.etcd:
        app.cleanup_ctx.append(members_ctx(state))
        app.cleanup_ctx.append(registration_ctx(state))
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    s = app[STATE]

    def on_dead(exc: BaseException) -> None:
        # Never half alive: the node exits non-zero and its supervisor restarts it.
        log.critical("the engine died (%r): stopping this node with exit code 1", exc)
        s.exit_code = 1
        s.shutdown.set()

    s.engine.start(on_dead)
    # the internal plane only: peers' /kv/* (with the trace's traceparent when tracing)
    s.session = s.config.security.client_session(trace_configs=s.tracing.trace_configs())
    if s.transport is not None:
        base, device = s.engine.kv_memory()
        await s.transport.register_pool(base, s.engine.kv_layout, device)
        from node.peers import PeerPolicy
        from node.remote_kv import RemoteKV

        s.remote_kv = RemoteKV(
            s.transport,
            s.session,
            s.config.transfer_timeout_s,
            PeerPolicy(s.config.peer_networks(), kv_network_isolated=s.config.kv_network_isolated),
            s.config.security.scheme,
        )
    for hook in s.roles.on_start:
        await hook(s)
    s.idle.set()
    yield
    for hook in s.roles.on_stop:
        await hook(s)
    await s.session.close()
    await s.engine.stop()
    if s.transport is not None:
        await s.transport.close()
