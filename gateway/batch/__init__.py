"""The batch tier: OpenAI's Files + Batches APIs, the seed's simple `/v1/batch` form, a durable
runner, and signed callbacks. It needs only its storage interface (`BatchTables`, part of the
gateway's one store) and the contracts below: the gateway plugs it in.

Wiring: gateway/batch/wiring.py does it in the gateway's `make_app(config)` (`[batch]` in
gateway.toml): the executor runs each line through `gateway.serving.pipeline.run` at tier=batch and
the batch discount; `authenticate` is the gateway's API keys; `may_run` is "no interactive request
waits for an admission slot"; the runner lives in the app's cleanup_ctx. In short:

    store = state.store                                     # the gateway's one store
    runner = BatchRunner(store, executor, batch_config, may_run=lambda: not interactive_waiting())
    make_batch_routes(app, store=store, authenticate=team_of, config=batch_config, wake=runner.wake)
    async def batch_ctx(app):                               # app.cleanup_ctx.append(batch_ctx)
        await runner.start(); yield; await runner.stop()

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
- Storage: `BatchTables` (gateway/accounts/store/batch_tables.py), which the gateway's one
  store implements on SQLite (the batch data directory's `batch.sqlite3`) or PostgreSQL (the
  gateways' shared database); `SqliteBatchStore` / `PostgresBatchStore` are the tables alone.
  File contents live on disk under `BatchConfig.data_dir/files` (a shared mount for several
  hosts).
- Several gateways may share one store: requests and finalization are claimed with leases
  (`claimed_by`, `lease_until`); `worker_id` must be unique among live processes and stable
  across a restart to resume at once (otherwise claims lapse after `lease_s`).
"""
