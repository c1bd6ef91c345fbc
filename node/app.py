"""The node's aiohttp application (DESIGN §4 internal API), built by `make_app`.

Middleware gives every request its X-Request-Id (in the log context and the answer), turns
APIError into OpenAI's error body with the right status, answers 503 while draining, and keeps
an unexpected exception from taking the node down (500 with a message, logged).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from node.completions import handle_completions, new_request_id, prefill_request_id
from node.request_log import REQUEST_ID
from node.state import NodeState
from protocol.node_api import AbortRequest, NodeHealth
from protocol.openai import APIError

log = logging.getLogger("duet.node")
STATE = web.AppKey("state", NodeState)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(err: APIError, request_id: str) -> web.Response:
    headers = {"X-Request-Id": request_id}
    return web.Response(status=err.status, body=msgspec.json.encode(err.body()),
                        content_type="application/json", headers=headers)  # fmt: skip


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request.headers.get("X-Request-Id") or new_request_id()
    token = REQUEST_ID.set(rid)
    try:
        state = request.app[STATE]
        if state.draining and request.method == "POST" and request.path == "/v1/completions":
            raise APIError(503, "this node is shutting down; retry on another node",
                           type_="service_unavailable", code="draining")  # fmt: skip
        return await handler(request)
    except APIError as e:
        if e.status >= 500:
            log.warning("%s %s → %d: %s", request.method, request.path, e.status, e.message)
        else:
            log.info("%s %s → %d: %s", request.method, request.path, e.status, e.message)
        return _error(e, rid)
    except web.HTTPException:
        raise
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        raise
    except Exception as e:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return _error(APIError(500, f"internal error: {type(e).__name__}: {e}", type_="internal_error"), rid)
    finally:
        REQUEST_ID.reset(token)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await handle_completions(request.app[STATE], request)


async def _health(request: web.Request) -> web.Response:
    s = request.app[STATE]
    status, detail = "ok", None
    if s.engine.dead is not None:
        status, detail = "failed", f"engine failed: {s.engine.dead!r}"
    elif s.draining:
        status = "draining"
    body = NodeHealth(status=status, role=s.config.role, node_id=s.node_id, engine_id=s.engine_id,
                      model=s.engine.model_name, detail=detail)  # fmt: skip
    return web.Response(status=200 if status == "ok" else 503, body=msgspec.json.encode(body),
                        content_type="application/json")  # fmt: skip


async def _metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _abort(request: web.Request) -> web.Response:
    s = request.app[STATE]
    try:
        body = msgspec.json.decode(await request.read(), type=AbortRequest)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise APIError(400, f"malformed abort request: {e}") from None
    aborted = await s.engine.abort(body.request_id)
    if s.leases is not None:
        erid = prefill_request_id(body.request_id)
        aborted = await s.engine.abort(erid) or aborted
        aborted = await s.leases.release(erid) or aborted
    return web.json_response({"aborted": aborted})


def make_app(state: NodeState) -> web.Application:
    """The node app; `state` holds an engine that is built but not started."""
    app = web.Application(middlewares=[_middleware], client_max_size=64 * 2**20)
    app[STATE] = state
    app.cleanup_ctx.append(_lifecycle)
    from prefill.leg import handle_metadata, handle_release

    def bind(fn: Callable[[NodeState, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
        async def h(request: web.Request) -> web.StreamResponse:
            return await fn(request.app[STATE], request)

        return h

    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/kv/metadata", bind(handle_metadata))
    app.router.add_post("/kv/release", bind(handle_release))
    app.router.add_post("/abort", _abort)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    from node.kv_events import add_kv_event_routes  # /kv/events, /kv/snapshot
    from node.registration import registration_ctx

    add_kv_event_routes(app, state)
    if state.config.etcd:
        app.cleanup_ctx.append(registration_ctx(state))
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    s = app[STATE]
    s.engine.start()
    s.session = aiohttp.ClientSession()
    if s.transport is not None:
        base, device = s.engine.kv_memory()
        await s.transport.register_pool(base, s.engine.kv_layout, device)
        from decode.remote_kv import RemoteKV
        from prefill.leases import LeaseManager

        if s.config.role in ("prefill", "both"):
            s.leases = LeaseManager(lambda erid: s.engine.release(erid))
        if s.config.role in ("decode", "both"):
            s.remote_kv = RemoteKV(s.transport, s.session, s.config.transfer_timeout)
    s.idle.set()
    yield
    if s.leases is not None:
        await s.leases.release_all()
    await s.session.close()
    await s.engine.stop()
    if s.transport is not None:
        await s.transport.close()
