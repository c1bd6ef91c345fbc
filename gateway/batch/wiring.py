"""The batch tier inside the gateway: the executor that runs each batch line through
the gateway's own serving path, the auth adapter, and the runner's lifecycle.

- Executor: a line runs through the request pipeline (`pipeline.run`) — what the HTTP handlers call
  — as the batch's team, at tier `batch` (lowest admission priority, `priority=batch` on the nodes)
  and at `1 - [batch] discount` of the model's prices, so quotas, routing, retries across nodes and
  usage records are exactly the interactive ones. Its usage records carry key id `batch` (a batch
  belongs to a team, not to the key that uploaded it).
- Quotas: a full rate window (RPM/TPM/concurrency, 429 `rate_limit_exceeded`) or a request
  shed for interactive load (503 `overloaded`) is `Defer`red: re-queued after its Retry-After
  without spending an attempt. A spent daily/monthly budget (429 `insufficient_quota`) is the
  line's final answer (runner.py): waiting for a budget period could hold a batch for a month.
- Auth: the gateway's API keys; every batch object is looked up by (team, id), so another
  team gets 404.
- Yielding: `may_run` is False while an interactive request waits for an admission slot or
  every slot is taken, so batch work never queues in front of, or next to, interactive work.
- Lifecycle: the runner starts after the gateway's own context (models, session) and stops
  before it, handing its claims back at once.

The batch tier's tables are the gateway's one store's (gateway/accounts/store/). Several
gateways: with a PostgreSQL store the batch tables are in the same database (claims with
FOR UPDATE SKIP LOCKED), so any gateway serves, runs and finalizes any batch; file contents stay on
disk under `[batch] data_dir`, which must then be a directory every gateway mounts (a warning at
start-up says so when it is left at its default). With SQLite, gateways on one host may share
`data_dir` (SQLite locking).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from gateway.accounts.ledger import Caller, RateLimited
from gateway.accounts.store.base import ApiKey, Store, UsageKey
from gateway.accounts.store.batch_tables import BatchTables
from gateway.accounts.store.private_files import private_dir
from gateway.accounts.team_gate import TeamLimited
from gateway.batch.config import BatchConfig
from gateway.batch.contracts import Defer
from gateway.batch.models import PRIORITIES
from gateway.batch.routes import make_batch_routes
from gateway.batch.runner import BatchRunner
from gateway.config import BatchSettings, GatewayConfig, TeamPolicy, TierConfig
from gateway.config_tables import BatchLimits
from gateway.serving.context import Serving
from gateway.serving.generate import parse
from gateway.serving.pipeline import run
from gateway.serving.requests import Endpoint
from gateway.serving.tiers import Admission, Shed
from gateway.state import GatewayState
from protocol.openai import APIError
from runtime.models import duet_home

log = logging.getLogger("duet.gateway.batch")
RUNNER = web.AppKey("batch_runner", BatchRunner)
_ENDPOINTS = {"/v1/chat/completions": Endpoint.CHAT, "/v1/completions": Endpoint.COMPLETION}
_ENC = msgspec.json.Encoder()
#: where an operator may keep the callbacks' HMAC secret instead of [batch] callback_secret
CALLBACK_SECRET_ENV = "DUET_BATCH_CALLBACK_SECRET"


def data_dir(cfg: GatewayConfig) -> Path:
    """`[batch] data_dir`, else `batch/` next to an SQLite gateway store, else $DUET_HOME/batch."""
    if cfg.batch.data_dir:
        return Path(cfg.batch.data_dir).expanduser()
    if cfg.store_url.startswith("sqlite://"):
        return Path(cfg.store_url.removeprefix("sqlite://")).expanduser().parent / "batch"
    return duet_home() / "batch"


def shared_store(cfg: GatewayConfig) -> bool:
    return cfg.store_url.startswith(("postgresql://", "postgres://"))


def batch_config(cfg: GatewayConfig) -> BatchConfig:
    b: BatchSettings = cfg.batch
    # host:port is unique among live gateways and the same after a restart, so a restarted
    # gateway takes its own claims back at once instead of waiting for their leases.
    worker = b.worker_id or f"{socket.gethostname()}:{cfg.server.port}"
    limits = {f.name: getattr(b, f.name) for f in dataclasses.fields(BatchLimits)}
    return BatchConfig(
        **{**limits, "callback_secret": b.callback_secret or os.environ.get(CALLBACK_SECRET_ENV)},
        data_dir=data_dir(cfg),
        models=frozenset(cfg.models),
        max_priority=PRIORITIES[cfg.teams.get("*", TeamPolicy()).batch_priority],
        max_priorities={t: PRIORITIES[p.batch_priority] for t, p in cfg.teams.items() if t != "*"},
        worker_id=worker,
    )


class GatewayExecutor:
    """The batch `Executor`: one line through the request pipeline, as its team, at the batch
    tier."""

    def __init__(self, serving: Serving, store: Store, discount: float) -> None:
        self.serving = serving
        self.store = store
        self.price_factor = 1.0 - discount

    async def __call__(
        self,
        team_id: str,
        endpoint: str,
        body: dict[str, Any],
        *,
        tier: str = "batch",
        request_id: str,
    ) -> tuple[int, dict[str, Any]]:
        team = await self.store.get_team(team_id)
        if team is None:
            err = APIError(
                403,
                f"team {team_id!r} no longer exists",
                type_="permission_error",
                code="team_deleted",
            )
            return err.status, msgspec.to_builtins(err.body())
        # a usage key: the runner reruns a line under the same id when its gateway died between
        # billing it and recording its result, and when it retries it — billed once, for the
        # run that gave its result (store/usage_keys.py)
        caller = Caller(
            ApiKey(id="batch", team_id=team_id, name="batch"),
            team,
            request_id,
            time.monotonic(),
            self.price_factor,
            usage_key=UsageKey.RERUN,
            capped=False,
        )
        try:
            call = parse(_ENDPOINTS[endpoint], _ENC.encode(body))
            answer = await run(self.serving, caller, call, tier_header=tier)
        except RateLimited as e:
            if e.type == "insufficient_quota":
                return e.status, msgspec.to_builtins(e.body())
            raise Defer(e.retry_after_s or 1.0, e.message) from None
        except (
            Shed,
            TeamLimited,
        ) as e:  # TeamLimited: the team's own limits, on this gateway's count
            raise Defer(e.retry_after_s or 1.0, e.message) from None
        except APIError as e:
            return e.status, msgspec.to_builtins(e.body())
        return answer.status, msgspec.to_builtins(answer.body)


def health(runner: BatchRunner) -> dict[str, Any]:
    """The batch tier's part of GET /health."""
    return {
        "worker_id": runner.worker_id,
        "running": runner.running,
        "concurrency": runner.concurrency,
        "paused": not runner.may_run(),
    }


def batch_may_run(admission: Admission, tiers: TierConfig) -> Callable[[], bool]:
    """Batch work starts only while no interactive request waits and a slot is free."""

    def may_run() -> bool:
        return admission.depth("interactive") == 0 and admission.running < tiers.max_inflight

    return may_run


def install(
    app: web.Application,
    config: GatewayConfig,
    store: BatchTables,
    state_key: web.AppKey[GatewayState],
) -> None:
    """Mount the batch routes on `app` (their tables: the gateway's one `store`) and run the
    runner with it (after the gateway's own cleanup_ctx entry, which must already be appended:
    the runner needs its state, and the store opened)."""
    bc = batch_config(config)

    async def team_of(request: web.Request) -> str:
        _key, team = await request.app[state_key].auth.authenticate(request)
        return team.id

    def wake() -> None:
        app[RUNNER].wake()

    # the batch data directory (the batch tables' file, the files' contents) is private from
    # the start, before any file is written into it
    private_dir(bc.data_dir)
    make_batch_routes(app, store=store, authenticate=team_of, config=bc, wake=wake)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        state = app[state_key]
        executor = GatewayExecutor(state.serving, state.store, config.batch.discount)
        may_run = batch_may_run(state.serving.admission, config.tiers)
        runner = app[RUNNER] = BatchRunner(store, executor, bc, may_run=may_run)
        if shared_store(config) and not config.batch.data_dir:
            log.warning(
                "batches are in the shared PostgreSQL store, but their file contents in this "
                "host's %s: set [batch] data_dir to a directory every gateway mounts, or a "
                "batch uploaded through another gateway cannot be read here",
                bc.files_dir,
            )
        await runner.start()
        log.info(
            "batch tier: store %s, worker %s, concurrency %d, discount %g",
            getattr(store, "batch_path", getattr(store, "path", "?")),
            bc.worker_id,
            bc.concurrency,
            config.batch.discount,
        )
        try:
            yield
        finally:
            await runner.stop()

    app.cleanup_ctx.append(lifecycle)
