"""The coordinator's HTTP API, built by `make_app(config)`.

- `POST /route`: RouteRequest → RouteResponse (protocol/route.py); 400 malformed, 404
  `model_not_found`, 503 `no_capacity` with `Retry-After`.
- `GET /cluster`: nodes, status, load, pending decisions, index size, leader.
- `GET /planner`: the autoscaler's recent decisions (protocol/planner.py); 404 `planner_off`
  on a replica without `--planner`.
- `POST /nodes/{node_id}/drain`: mark a node draining in etcd (any replica may do it);
  `DELETE /nodes/{node_id}/drain` undoes it through the node (coordinator/drain.py): the node's
  own answer — 200 UndrainStatus, 409 `node_stopping`, 503 — or 404 `node_not_found`, 502
  `node_unreachable`.
- `GET /health`, `GET /metrics`.

Errors are OpenAI-shaped (the shared error middleware, runtime/http_errors.py; a 503 says when
to retry through APIError.retry_after_s); one bad request never affects another, and an
unexpected exception is a logged 500, never a dead replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.drain import NodeNotFound, drain_node, undrain_node
from coordinator.service import Coordinator, CoordinatorConfig
from coordinator.store import Store, StoreError
from protocol.openai import APIError
from protocol.route import RouteRequest
from runtime.http_errors import error_middleware
from runtime.tracing import GEN_AI_REQUEST_MODEL, Tracing, from_env, setup

log = logging.getLogger("duet.coordinator")
COORDINATOR = web.AppKey("coordinator", Coordinator)
TRACING = web.AppKey("tracing", Tracing)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_NODE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")


def _json(body: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=msgspec.json.encode(body),
        content_type="application/json",
        headers=headers,
    )


_route_decoder = msgspec.json.Decoder(RouteRequest)


async def _route(request: web.Request) -> web.Response:
    if request.content_type not in ("application/json", "application/octet-stream", ""):
        raise APIError(
            415, f"send JSON (Content-Type: application/json), not {request.content_type}"
        )
    try:
        req = _route_decoder.decode(await request.read())
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid route request: {e}") from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"route request is not valid JSON: {e}") from None
    with request.app[TRACING].span(
        "coordinator.decide",
        {
            GEN_AI_REQUEST_MODEL: req.model,
            "duet.prompt_tokens": req.num_prompt_tokens,
            "duet.tier": req.tier,
        },
    ) as span:
        decision = await request.app[COORDINATOR].route_placed(req)
        if span is not None:
            r = decision.response
            span.set_attributes(
                {
                    "duet.route.reason": r.reason,
                    "duet.route.outcome": str(decision.outcome.value),
                    "duet.decode.node_id": r.decode.node_id,
                    "duet.prefill.node_id": r.prefill.node_id if r.prefill is not None else "",
                    "duet.cached_tokens": r.decode.cached_tokens,
                }
            )
    if req.request_id:
        log.debug("route %s → %s", req.request_id, decision.response.reason)
    return _json(decision.response)


async def _cluster(request: web.Request) -> web.Response:
    return _json(request.app[COORDINATOR].cluster())


async def _planner(request: web.Request) -> web.Response:
    report = request.app[COORDINATOR].planner_report
    if report is None:
        raise APIError(
            404,
            "this coordinator replica runs no planner (start it with --planner load|throughput)",
            code="planner_off",
        )
    return _json(report())


def _node_id(request: web.Request) -> str:
    """The `{node_id}` of a drain route, checked before it names an etcd key (400 otherwise)."""
    node_id = request.match_info["node_id"]
    if not _NODE_ID.match(node_id):
        raise APIError(400, f"invalid node id {node_id[:60]!r}", param="node_id")
    return node_id


async def _drain(request: web.Request) -> web.Response:
    node_id = _node_id(request)
    c = request.app[COORDINATOR]
    try:
        info = await drain_node(c.store, c.config.cluster, node_id)
    except NodeNotFound:
        raise APIError(
            404,
            f"no node {node_id!r} is registered in cluster {c.config.cluster!r}",
            param="node_id",
            code="node_not_found",
        ) from None
    except StoreError as e:
        raise APIError(
            503,
            f"cannot reach etcd to drain {node_id}: {e}",
            type_="service_unavailable",
            retry_after_s=1,
        ) from None
    log.info("node %s set to draining (requested through %s)", node_id, c.replica_id)
    return _json({"node_id": info.node_id, "status": info.status})


async def _undrain(request: web.Request) -> web.Response:
    node_id = _node_id(request)
    c = request.app[COORDINATOR]
    if c.session is None:
        raise APIError(
            503,
            "this coordinator replica is starting",
            type_="service_unavailable",
            retry_after_s=1,
        )
    try:
        status, body, info = await undrain_node(c.store, c.config.cluster, node_id, c.session)
    except NodeNotFound:
        raise APIError(
            404,
            f"no node {node_id!r} is registered in cluster {c.config.cluster!r}",
            param="node_id",
            code="node_not_found",
        ) from None
    except StoreError as e:
        raise APIError(
            503,
            f"cannot reach etcd to find {node_id}: {e}",
            type_="service_unavailable",
            retry_after_s=1,
        ) from None
    except (aiohttp.ClientError, TimeoutError) as e:
        raise APIError(
            502,
            f"cannot reach node {node_id} to undo its drain: {type(e).__name__}: {e}",
            type_="service_unavailable",
            code="node_unreachable",
        ) from None
    if status not in (200, 409, 503):  # 401: this replica's secret is not the node's
        raise APIError(
            502,
            f"node {node_id} at {info.url} answered {status} to DELETE /drain: {body[:200]!r}",
            type_="service_unavailable",
            code="node_error",
        )
    log.info(
        "undo of %s's drain (requested through %s): node answered %d", node_id, c.replica_id, status
    )
    return web.Response(status=status, body=body, content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    c = request.app[COORDINATOR]
    return _json(
        {
            "status": "ok",
            "replica_id": c.replica_id,
            "is_leader": c.election.is_leader,
            "etcd_connected": c.etcd_connected,
            "nodes": len(c.views),
        }
    )


async def _metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[COORDINATOR].metrics.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


#: a coroutine run beside a serving replica, given it (the planner)
Background = Callable[[Coordinator], Coroutine[Any, Any, None]]


def make_app(
    config: CoordinatorConfig,
    store: Store | None = None,
    *,
    coordinator: Coordinator | None = None,
    background: Sequence[Background] = (),
) -> web.Application:
    """The coordinator app; `store` defaults to an EtcdStore on `config.etcd`.

    With `coordinator`, the app serves that (already populated) state and starts nothing
    against etcd: the caller owns it (benchmarks, embedding). `background`: coroutines run
    beside the replica while it serves, given it (the composition root passes the planner)."""
    if coordinator is not None:
        return _app(coordinator)
    if store is None:
        from coordinator.etcd_store import EtcdStore

        store = EtcdStore(config.etcd)
    coordinator = Coordinator(config, store)
    app = _app(coordinator)

    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        await coordinator.start()
        tasks = [
            asyncio.create_task(run(coordinator), name="coordinator-background")
            for run in background
        ]
        yield
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await coordinator.stop()
        await store.close()

    app.cleanup_ctx.append(lifecycle)
    return app


def _app(coordinator: Coordinator) -> web.Application:
    # The cluster secret first: a request without it reaches nothing (runtime/cluster_secret.py).
    auth = coordinator.config.security.middlewares()
    app = web.Application(middlewares=[*auth, error_middleware(log)], client_max_size=16 * 2**20)
    app[COORDINATOR] = coordinator
    tracing = setup("duet-coordinator", from_env())
    tracing.install(app, at=len(app.middlewares) - 1)  # just before the error middleware
    app[TRACING] = tracing

    async def flush(_: web.Application) -> None:
        import asyncio

        await asyncio.to_thread(tracing.shutdown)

    app.on_cleanup.append(flush)
    app.router.add_post("/route", _route)
    app.router.add_get("/cluster", _cluster)
    app.router.add_get("/planner", _planner)
    app.router.add_post("/nodes/{node_id}/drain", _drain)
    app.router.add_delete("/nodes/{node_id}/drain", _undrain)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app
