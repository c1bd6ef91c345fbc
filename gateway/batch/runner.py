"""The durable batch runner: claims requests from the store, runs them through the executor at
batch priority, checkpoints each result, finalizes batches (output and error files), and
delivers callbacks.

Invariants:
- Work is claimed with a lease and renewed while it runs; a runner that dies loses its claims
  when their leases lapse (at once if it restarts with the same `worker_id`), so a batch
  resumes after a restart or on another gateway, and the store's claim check means one result
  per custom_id, whoever ran it.
- A line is billed once: its request id is written with its claim and kept until an outcome
  is recorded, and the executor bills under it as a usage key (store/base.py `Settlement.key`,
  `UsageKey.RERUN`), so a rerun after a crash between its usage record and its result
  replaces the first run's record instead of adding a second. A recorded retry keeps the id
  too: a run cut mid-answer by the cluster's fault was billed (its prompt, what it sent), and
  the retry's record replaces that one — a line pays for the run that gave its result.
- Retryable failures (an exception, 408/429/5xx) go back to `pending` with exponential backoff,
  until `max_attempts`; then the last answer is the request's result. A 429
  `insufficient_quota` (spent budget) is final at once; an executor's `Defer` (rate window
  full, load shed: the request never ran) re-queues it after its delay without spending an
  attempt, so a long batch under a tight RPM limit is slowed, not failed.
- At most `concurrency` requests run at once, and none starts while `may_run()` is False: the
  gateway uses it to let interactive load go first.
- A batch ends `completed` when every request has a result, `expired` past its window (the
  rest written as `batch_expired` errors) and `cancelled` after a cancel (`batch_cancelled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from gateway.accounts.store.batch_tables import BatchTables
from gateway.batch.callback import CallbackSender
from gateway.batch.config import BatchConfig
from gateway.batch.contracts import RETRYABLE_STATUS, Defer, Executor, MayRun, is_final
from gateway.batch.files import FileStore, new_file_id
from gateway.batch.models import (
    CallbackPayload,
    OutputError,
    OutputLine,
    OutputResponse,
    RequestCounts,
)
from gateway.batch.rows import BatchRow, Claimed, FileRow, ResultRow, new_request_id

log = logging.getLogger("duet.gateway.batch")
_ENC = msgspec.json.Encoder()


def output_line(batch_id: str, r: ResultRow) -> OutputLine:
    # A stable id: finalizing twice (after a crash) writes the same lines.
    rid = "batch_req_" + hashlib.sha256(f"{batch_id}\0{r.custom_id}".encode()).hexdigest()[:32]
    if r.state in ("succeeded", "failed") and r.status_code is not None and r.response is not None:
        resp = OutputResponse(
            status_code=r.status_code, request_id=r.request_id or "", body=r.response
        )
        return OutputLine(id=rid, custom_id=r.custom_id, response=resp, error=None)
    if r.state == "expired":
        err = OutputError(
            code="batch_expired",
            message="the batch's completion window ended before this request ran",
        )
    elif r.state == "cancelled":
        err = OutputError(
            code="batch_cancelled", message="the batch was cancelled before this request ran"
        )
    else:
        e = r.error or {}
        err = OutputError(
            code=str(e.get("code", "request_failed")),
            message=str(e.get("message", "the request failed")),
        )
    return OutputLine(id=rid, custom_id=r.custom_id, response=None, error=err)


#: how often expired batch files' contents are removed from disk
FILE_SWEEP_S = 60.0


class BatchRunner:
    def __init__(
        self,
        store: BatchTables,
        executor: Executor,
        config: BatchConfig,
        *,
        may_run: MayRun | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.executor = executor
        self.config = config
        self.files = FileStore(config.files_dir)
        self.may_run = may_run or (lambda: True)
        self.clock = clock
        self.worker_id = config.worker_id
        self._limit = config.concurrency
        self._inflight: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._callbacks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._last_renew = 0.0
        self._last_sweep = 0.0
        self._claiming = False
        self._sender = CallbackSender(
            allow_private=config.allow_private_callbacks, timeout_s=config.callback_timeout_s
        )

    # ---- lifecycle ----
    async def start(self) -> None:
        n = await self.store.release_claims(self.worker_id)
        if n:
            log.info(
                "batch runner %s: resumed %d request(s) left running by a previous process",
                self.worker_id,
                n,
            )
        self._loop_task = asyncio.create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._inflight.values(), *self._callbacks) if t]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        # Hand unfinished work back at once rather than after the lease.
        await self.store.release_claims(self.worker_id)
        await self._sender.close()

    def set_concurrency(self, n: int) -> None:
        """Change how many requests may run at once (the gateway shrinks it under load)."""
        self._limit = max(0, n)
        self.wake()

    @property
    def concurrency(self) -> int:
        return self._limit

    def wake(self) -> None:
        self._wake.set()

    @property
    def running(self) -> int:
        """Requests in flight, counting a claim under way (so 0 means truly idle)."""
        return len(self._inflight) + self._claiming

    # ---- the loop ----
    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a store hiccup must not stop the tier; the next tick retries
                log.exception("batch runner tick failed")
            self._wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns when the wake and a
            # cancel land in one turn, losing the cancel, and stop() then waits for ever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.poll_s):
                    await self._wake.wait()

    async def tick(self) -> None:
        now = self.clock()
        if now - self._last_sweep >= FILE_SWEEP_S:
            self._last_sweep = now
            await self.sweep_expired_files(now)
        if self._inflight and now - self._last_renew >= self.config.lease_s / 3:
            self._last_renew = now
            await self.store.renew_leases(
                self.worker_id, list(self._inflight), now + self.config.lease_s
            )
        for batch_id in await self.store.claim_finalizable(
            self.worker_id, self.config.lease_s, now
        ):
            await self._finalize(batch_id)
        for row in await self.store.claim_callbacks(self.worker_id, self.config.lease_s, now):
            self._spawn_callback(row)
        free = self._limit - len(self._inflight)
        if free > 0 and self.may_run():
            self._claiming = True
            try:
                claimed = await self.store.claim_requests(
                    self.worker_id, free, self.config.lease_s, now
                )
                for c in claimed:
                    self._inflight[(c.batch_id, c.custom_id)] = asyncio.create_task(self._run(c))
            finally:
                self._claiming = False

    async def sweep_expired_files(self, now: float) -> int:
        """Remove the contents of files past their `expires_after` (the store marks them deleted
        first, so the API and the team's storage already count them gone); how many."""
        n = 0
        while ids := await self.store.purge_expired_files(now):
            for fid in ids:
                with contextlib.suppress(OSError):
                    self.files.delete(fid)
            n += len(ids)
        if n:
            log.info("batch files: removed %d expired file(s)", n)
        return n

    # ---- one request ----
    async def _run(self, c: Claimed) -> None:
        # The claim's id: a rerun after a crash reuses it, so its usage record is billed once.
        request_id = c.request_id or new_request_id()
        try:
            await self._run_once(c, request_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # the store failed: the claim lapses and the request runs again
            log.exception(
                "batch %s request %s: could not record its result", c.batch_id, c.custom_id
            )
        finally:
            self._inflight.pop((c.batch_id, c.custom_id), None)
            self.wake()

    async def _run_once(self, c: Claimed, request_id: str) -> None:
        """Run one claimed request and checkpoint its result (or schedule its retry)."""
        try:
            status, body = await self.executor(
                c.team_id, c.endpoint, c.body, tier="batch", request_id=request_id
            )
            error: dict[str, Any] | None = None
        except asyncio.CancelledError:
            raise
        except Defer as d:  # never ran: later, and the attempt is not spent
            await self.store.retry_request(
                self.worker_id,
                c.batch_id,
                c.custom_id,
                self.clock() + max(d.after_s, self.config.retry_base_s),
                {"code": "deferred", "message": d.reason},
                spent=False,
            )
            return
        except Exception as e:  # the executor could not reach anything: retry like a 503
            status, body = 503, {}
            error = {"code": "executor_error", "message": f"{type(e).__name__}: {e}"}
        retryable = status in RETRYABLE_STATUS and not is_final(status, body)
        now = self.clock()
        if retryable and c.attempts < self.config.max_attempts:
            await self.store.retry_request(
                self.worker_id,
                c.batch_id,
                c.custom_id,
                now + self.config.backoff(c.attempts),
                error or {"code": "retryable_status", "status": status},
            )
            return
        await self.store.finish_request(
            self.worker_id,
            c.batch_id,
            c.custom_id,
            ok=200 <= status < 300,
            status_code=None if error else status,
            request_id=request_id,
            response=None if error else body,
            error=error,
            now=now,
        )

    # ---- the end of a batch ----
    async def _finalize(self, batch_id: str) -> None:
        row = await self.store.get_batch(None, batch_id)
        if row is None:
            return
        results = await self.store.results(batch_id)
        now = self.clock()
        unfinished = [r for r in results if r.state not in ("succeeded", "failed")]
        if row.status == "cancelling":
            status = "cancelled"
        elif unfinished:
            status = "expired"
            results = [
                r
                if r.state in ("succeeded", "failed", "cancelled")
                else ResultRow(r.custom_id, r.line, "expired", None, None, None, None)
                for r in results
            ]
        else:
            status = "completed"
        if status == "cancelled":
            results = [
                r
                if r.state in ("succeeded", "failed")
                else ResultRow(r.custom_id, r.line, "cancelled", None, None, None, None)
                for r in results
            ]
        good = [output_line(batch_id, r) for r in results if r.state == "succeeded"]
        bad = [output_line(batch_id, r) for r in results if r.state != "succeeded"]
        files: list[FileRow] = []
        ids: dict[str, str | None] = {"output": None, "error": None}
        for kind, lines in (("output", good), ("error", bad)):
            if not lines:
                continue
            fid = new_file_id()
            size = await asyncio.to_thread(
                self.files.write, fid, (_ENC.encode(x) + b"\n" for x in lines)
            )
            files.append(
                FileRow(
                    id=fid,
                    team_id=row.team_id,
                    purpose="batch_output",
                    filename=f"{batch_id}_{kind}.jsonl",
                    bytes=size,
                    created_at=now,
                )
            )
            ids[kind] = fid
        if not await self.store.finish_batch(
            self.worker_id, batch_id, status, files, ids["output"], ids["error"], now
        ):
            for f in files:  # another runner finished it after our claim lapsed
                self.files.delete(f.id)
            return
        log.info("batch %s %s: %d ok, %d not ok", batch_id, status, len(good), len(bad))

    # ---- callbacks ----
    def _spawn_callback(self, row: BatchRow) -> None:
        t = asyncio.create_task(self._callback(row))
        self._callbacks.add(t)
        t.add_done_callback(self._callbacks.discard)

    async def _callback(self, row: BatchRow) -> None:
        attempt = row.callback_attempts + 1
        secret = self.config.callback_secret_for(row.team_id)
        assert row.callback_url is not None
        if secret is None:
            await self.store.callback_result(
                self.worker_id,
                row.id,
                delivered=False,
                next_at=None,
                error="no callback secret configured",
            )
            return
        payload = CallbackPayload(
            type=f"batch.{row.status}",
            batch_id=row.id,
            status=row.status,
            request_counts=RequestCounts(
                total=row.counts.total, completed=row.counts.completed, failed=row.counts.failed
            ),
            output_file_id=row.output_file_id,
            error_file_id=row.error_file_id,
            metadata=row.metadata,
        )
        ok, detail = await self._sender.send(
            row.callback_url, secret, _ENC.encode(payload), f"{row.id}:{row.status}"
        )
        next_at = None
        if not ok:
            if attempt < self.config.callback_max_attempts:
                next_at = self.clock() + self.config.callback_backoff(attempt)
            log.warning("callback for batch %s failed (attempt %d): %s", row.id, attempt, detail)
        await self.store.callback_result(
            self.worker_id, row.id, delivered=ok, next_at=next_at, error=None if ok else detail
        )
