"""The batch tier (issue #13): OpenAI's Files + Batches APIs, the seed's simple `/v1/batch`
form, a durable runner, and signed callbacks. Self-contained: the gateway plugs it in.

Wiring: gateway/batch/wiring.py does it in the gateway's `make_app(config)` (`[batch]` in
gateway.toml): the executor runs each line through `gateway.serving.pipeline.run` at tier=batch and the
batch discount; `authenticate` is the gateway's API keys; `may_run` is "no interactive request
waits for an admission slot"; the runner lives in the app's cleanup_ctx. In short:

    store = SqliteBatchStore(data_dir / "batch.sqlite3")    # or PostgresBatchStore(dsn)
    runner = BatchRunner(store, executor, batch_config, may_run=lambda: not interactive_waiting())
    make_batch_routes(app, store=store, authenticate=team_of, config=batch_config, wake=runner.wake)
    async def batch_ctx(app):                               # app.cleanup_ctx.append(batch_ctx)
        await runner.start(); yield; await runner.stop(); store.close()

Contracts (see contracts.py):
- `Executor`: `async (team_id, endpoint, body, *, tier="batch", request_id) -> (status, body)`;
  runs one request through the gateway's normal path (quotas, batch price, batch priority).
  An exception or 408/425/429/5xx is retried with backoff up to `max_attempts`, except a 429
  `insufficient_quota` (final). Raising `Defer(after_s, reason)` re-queues a request that
  never ran without spending an attempt. The gateway's executor is gateway/batch/wiring.py.
- `Authenticate`: `(request) -> team_id` (may be async); raise APIError(401) for a bad key.
  Everything is looked up by (team, id): another team gets 404.
- `MayRun`: `() -> bool`; False stops new batch work from starting (interactive load first).
  `BatchRunner.set_concurrency(n)` resizes the in-flight limit at run time.
- Storage: `BatchStore` protocol (store.py); `SqliteBatchStore` is the default,
  `PostgresBatchStore` (pg_store.py, asyncpg) serves gateways sharing a PostgreSQL store. File
  contents live on disk under `BatchConfig.data_dir/files` (a shared mount for several hosts).
- Several gateways may share one store: requests and finalization are claimed with leases
  (`claimed_by`, `lease_until`); `worker_id` must be unique among live processes and stable
  across a restart to resume at once (otherwise claims lapse after `lease_s`).
"""

from gateway.batch.callback import SIGNATURE_HEADER, sign, verify_signature
from gateway.batch.config import BatchConfig
from gateway.batch.contracts import RETRYABLE_STATUS, Authenticate, Defer, Executor, MayRun
from gateway.batch.routes import make_batch_routes
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore, SqliteBatchStore

__all__ = [
    "RETRYABLE_STATUS",
    "SIGNATURE_HEADER",
    "Authenticate",
    "BatchConfig",
    "BatchRunner",
    "BatchStore",
    "Defer",
    "Executor",
    "MayRun",
    "SqliteBatchStore",
    "make_batch_routes",
    "sign",
    "verify_signature",
]
