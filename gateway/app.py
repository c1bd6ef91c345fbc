"""The gateway's aiohttp application, built by `make_app(config)`.

The middleware gives every request the gateway's own X-Request-Id, turns every error —
ours (APIError), aiohttp's (404/405/413) and unexpected ones (500, logged) — into OpenAI's
error body (Anthropic's under `/v1/messages`) with the right status — a full store as 503
`store_unavailable` (serving/store_faults.py) — and never lets one request's failure reach
another.
`cleanup_ctx` owns everything with a lifetime: the gateway's state, built complete by
`state.open_state` once the event loop runs (the store, the one ClientSession, the usage
writer, the store heartbeat, the model backends), then the batch runner (batch/wiring.py).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.accounts.auth import MIN_ADMIN_KEY
from gateway.accounts.store import open_store
from gateway.accounts.store.base import Store, StoreError
from gateway.api import admin, admin_teams, embeddings, openai, rollout, tokens
from gateway.api.anthropic import api as anthropic_api
from gateway.api.anthropic import count as anthropic_count
from gateway.api.responses import api as responses_api
from gateway.batch import wiring as batch_wiring
from gateway.config import ConfigError, GatewayConfig
from gateway.console import install as install_console
from gateway.metrics import GatewayMetrics
from gateway.serving.relay import WRITE_TIMEOUT
from gateway.serving.requests import Endpoint
from gateway.serving.store_faults import store_unavailable
from gateway.serving.tiers import Shed
from gateway.state import GatewayState, open_state
from protocol.openai import APIError
from runtime.cluster_secret import metrics_middleware
from runtime.http_errors import error_middleware
from runtime.tracing import DEFAULT_RING, Tracing, from_env, setup

log = logging.getLogger("duet.gateway")
STATE = web.AppKey("state", GatewayState)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_ENC = msgspec.json.Encoder()


@web.middleware
async def _request_id(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request gets the gateway's own id (never the client's: it names engine requests on
    shared nodes). 128 random bits as uuid4's hex spells them, without building a UUID object
    (a few microseconds on every request)."""
    request[_RID] = f"req-{secrets.token_hex(16)}"
    return await handler(request)


def _translator(limit: int) -> Callable[[web.Request, BaseException], APIError | None]:
    """The gateway's own errors for the shared middleware: store conflicts, the body limit."""

    def translate(request: web.Request, e: BaseException) -> APIError | None:
        if isinstance(e, StoreError):
            return APIError(e.status, str(e), code="conflict" if e.status == 409 else "not_found")
        if (full := store_unavailable(e)) is not None:
            return full
        if isinstance(e, web.HTTPRequestEntityTooLarge):
            return APIError(
                413,
                f"the request body is larger than this gateway accepts ({limit} bytes)",
                code="request_too_large",
            )
        return None

    return translate


_RID = web.RequestKey("request_id", str)
#: the paths that answer every error in Anthropic's shape (the router's 404 and 405 included)
_ANTHROPIC = "/v1/messages"


def _render(request: web.Request, err: APIError, request_id: str | None) -> web.Response | None:
    """Anthropic's error body for a path under `/v1/messages`, so its clients parse every error
    there (an unknown sub-path, a wrong method, a crash) as their typed errors."""
    path = request.path
    if path != _ANTHROPIC and not path.startswith(_ANTHROPIC + "/"):
        return None
    return anthropic_api.error_response(err, request_id or "")


def _bind(fn: Callable[[GatewayState, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
    async def h(request: web.Request) -> web.StreamResponse:
        return await fn(request.app[STATE], request)

    return h


def _completions(endpoint: Endpoint) -> Handler:
    async def h(request: web.Request) -> web.StreamResponse:
        return await openai.handle(request.app[STATE], request, endpoint, request[_RID])

    return h


async def _messages(request: web.Request) -> web.StreamResponse:
    return await anthropic_api.handle(request.app[STATE], request, request[_RID])


async def _generate(request: web.Request) -> web.StreamResponse:
    return await tokens.generate(request.app[STATE], request, request[_RID])


def _render_prompt(endpoint: Endpoint) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await tokens.render(request.app[STATE], request, endpoint, request[_RID])

    return handler


async def _count_tokens(request: web.Request) -> web.StreamResponse:
    return await anthropic_count.handle(request.app[STATE], request, request[_RID])


async def _responses(request: web.Request) -> web.StreamResponse:
    return await responses_api.handle(request.app[STATE], request, request[_RID])


async def _embeddings(request: web.Request) -> web.StreamResponse:
    return await embeddings.handle(request.app[STATE], request, request[_RID])


def _health(reader: Callable[[web.Request], bool]) -> Handler:
    """GET /health: a status for anyone (probes, load balancers); the models, the admission
    queues' depths and the batch worker (named by its host) only for `reader`'s callers (the
    admin key, the cluster secret): they are the gateway's internals, not a client's business."""

    async def h(request: web.Request) -> web.Response:
        body: dict[str, object] = {"status": "ok"}
        if "Authorization" not in request.headers or not reader(request):
            return web.json_response(body)
        s = request.app[STATE]
        body["models"] = sorted(s.serving.models)
        body["running"] = s.serving.admission.running
        body["waiting"] = {t: s.serving.admission.depth(t) for t in ("interactive", "batch")}
        if batch_wiring.RUNNER in request.app:
            body["batch"] = batch_wiring.health(request.app[batch_wiring.RUNNER])
        return web.json_response(body)

    return h


def _metrics(metrics: GatewayMetrics) -> Handler:
    async def h(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    return h


def _metrics_reader(config: GatewayConfig) -> Callable[[web.Request], bool]:
    """Who may read a protected /metrics and /health's details: the cluster secret's holders
    and the admin."""
    secret = config.security.secret

    def check(request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        if secret is not None and secret.verify(header):
            return True
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        auth = request.app[STATE].auth
        address = auth.client(request)
        try:  # the admin endpoints' per-address limit on failed attempts holds here too
            auth.guard.check(address)
        except APIError:
            return False  # blocked: the key is not even compared
        if auth.is_admin(token.strip()):
            return True
        auth.guard.failed(address)
        return False

    return check


def make_app(config: GatewayConfig) -> web.Application:
    errors = error_middleware(
        log, _translator(config.server.max_body_bytes), lambda r: r.get(_RID), _render
    )
    admin_key = config.admin_key
    if admin_key is not None and len(admin_key) < MIN_ADMIN_KEY:
        raise ConfigError(
            f"$DUET_ADMIN_KEY is {len(admin_key)} characters; an admin key needs at least "
            f"{MIN_ADMIN_KEY} (generate one: python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    # /metrics needs the cluster secret or the admin key unless --open-metrics (the rest of the
    # gateway's API has its own keys); its series name teams, so no credential means no reader
    if (
        config.security.protect_metrics
        and config.security.secret is None
        and not (admin_key or config.server.admin_key_sha256)
    ):
        log.warning(
            "/metrics is protected and this gateway has neither a cluster secret nor an admin "
            "key: nothing can read it (set one, or --open-metrics on a private listener)"
        )
    guard = [metrics_middleware(_metrics_reader(config))] if config.security.protect_metrics else []
    app = web.Application(
        middlewares=[*guard, _request_id, errors], client_max_size=config.server.max_body_bytes
    )
    app[WRITE_TIMEOUT] = config.server.write_timeout_s
    # what exists before the event loop runs: the routes, the middleware, the batch routes and
    # the console find them here; the rest of the state is made at start-up (`_lifecycle`)
    store = open_store(config.store_url, batch_wiring.data_dir(config))
    metrics = GatewayMetrics()
    tracing = setup("duet-gateway", from_env(DEFAULT_RING, config.tracing))
    # public endpoints: a client's traceparent is a link, never the parent (runtime/tracing/)
    tracing.install(app, after=_request_id, trust_parent=False)
    app.cleanup_ctx.append(_lifecycle(config, store, metrics, tracing))
    if config.batch.enabled:  # after _lifecycle: the runner needs the gateway's state
        batch_wiring.install(app, config, store, STATE)
    r = app.router
    r.add_post("/v1/chat/completions", _completions(Endpoint.CHAT))
    r.add_post("/v1/completions", _completions(Endpoint.COMPLETION))
    r.add_post("/v1/messages", _messages)
    r.add_post("/v1/messages/count_tokens", _count_tokens)
    r.add_post("/inference/v1/generate", _generate)
    r.add_post("/v1/chat/completions/render", _render_prompt(Endpoint.CHAT))
    r.add_post("/v1/completions/render", _render_prompt(Endpoint.COMPLETION))
    r.add_post("/v1/responses", _responses)
    r.add_post("/v1/embeddings", _embeddings)
    r.add_get("/v1/models", _bind(openai.models))
    r.add_get("/v1/usage", _bind(admin.usage))
    r.add_get("/health", _health(_metrics_reader(config)))
    r.add_get("/metrics", _metrics(metrics))
    r.add_post("/admin/teams", _bind(admin_teams.create_team))
    r.add_get("/admin/teams", _bind(admin_teams.list_teams))
    r.add_get("/admin/teams/{id}", _bind(admin_teams.list_teams))
    r.add_put("/admin/teams/{id}", _bind(admin_teams.update_team))
    r.add_patch("/admin/teams/{id}", _bind(admin_teams.patch_team))
    r.add_delete("/admin/teams/{id}", _bind(admin_teams.delete_team))
    r.add_post("/admin/keys", _bind(admin_teams.create_key))
    r.add_get("/admin/keys", _bind(admin_teams.list_keys))
    r.add_delete("/admin/keys/{id}", _bind(admin_teams.revoke_key))
    r.add_get("/admin/batches", _bind(admin.list_batches))
    r.add_post("/admin/batches/{id}/cancel", _bind(admin.cancel_batch))
    r.add_get("/admin/models/{model}/versions", _bind(rollout.get_versions))
    r.add_put("/admin/models/{model}/versions", _bind(rollout.set_weights))
    r.add_post("/admin/models/{model}/rollout", _bind(rollout.rollout))
    install_console(app, STATE)  # /console: the operator console (gateway/console)
    return app


def _lifecycle(
    config: GatewayConfig, store: Store, metrics: GatewayMetrics, tracing: Tracing
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def life(app: web.Application) -> AsyncIterator[None]:
        async with open_state(config, store, metrics, tracing) as state:
            app[STATE] = state
            yield

    return life


__all__ = ["STATE", "Shed", "make_app"]
