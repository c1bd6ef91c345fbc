"""An aiohttp app with the batch tier mounted, a real node behind its executor, and API keys of
two teams: what the gateway will build, minus the gateway. Used in-process by the tests and as
a process (`python -m tests.batch.serve`) by the restart test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.config import BatchConfig
from gateway.batch.routes import make_batch_routes
from gateway.batch.runner import BatchRunner
from protocol.openai import APIError
from tests.batch.node_executor import NodeExecutor

KEYS = {"key-a": "team-a", "key-b": "team-b"}
RUNNER = web.AppKey("runner", BatchRunner)
STORE = web.AppKey("store", SqliteBatchStore)
EXECUTOR = web.AppKey("executor", NodeExecutor)


def authenticate(request: web.Request) -> str:
    key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if key not in KEYS:
        raise APIError(401, "invalid API key", type_="authentication_error", code="invalid_api_key")
    return KEYS[key]


def make_app(
    config: BatchConfig,
    *,
    node_url: str | None = None,
    model_dir: Path | None = None,
    may_run: Callable[[], bool] | None = None,
) -> web.Application:
    """Without a node, only the routes run (validation tests); with one, the runner too."""
    app = web.Application()
    store = SqliteBatchStore(Path(config.data_dir) / "batch.sqlite3")
    app[STORE] = store
    runner = None
    if node_url is not None:
        assert model_dir is not None
        # The session is bound in the context below, inside the running loop.
        app[EXECUTOR] = NodeExecutor(None, node_url, model_dir)  # type: ignore[arg-type]
        runner = BatchRunner(store, app[EXECUTOR], config, may_run=may_run)
        app[RUNNER] = runner

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        if runner is not None:
            app[EXECUTOR].session = aiohttp.ClientSession()
            await runner.start()
        yield
        if runner is not None:
            await runner.stop()
            await app[EXECUTOR].session.close()
        store.close()

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.cleanup_ctx.append(ctx)
    app.router.add_get("/health", health)
    make_batch_routes(
        app,
        store=store,
        authenticate=authenticate,
        config=config,
        wake=runner.wake if runner else None,
    )
    return app
