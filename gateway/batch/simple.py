"""The seed's simple batch form: `POST /v1/batch {requests, callback_url, priority}` →
`{batch_id, status, estimated_completion}`, and `GET /v1/batch/{id}?limit=&after=` (status,
counts and, once the batch has ended, a page of its results: results_page.py).

Each request is an OpenAI body (`{"model", "messages"}` or `{"model", "prompt"}`), or
`{"custom_id"?, "url"?, "body"}` to name it; line numbers in errors are 1-based positions in
`requests`. Under the hood it is an ordinary batch: the requests are stored as a JSONL input
file of the team, so both forms share validation, the runner, and the output files.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
from aiohttp import web

from gateway.accounts.store.batch_tables import BatchTables, TeamLimit
from gateway.batch.callback import CallbackURLError, check_callback_url_now
from gateway.batch.config import BatchConfig
from gateway.batch.contracts import Authenticate
from gateway.batch.estimate import Estimator
from gateway.batch.files import (
    MAX_REPORTED_ERRORS,
    FileStore,
    InvalidFile,
    Scan,
    new_file_id,
    unfit,
)
from gateway.batch.models import (
    PRIORITIES,
    TERMINAL,
    BatchError,
    SimpleBatchCreate,
    SimpleBatchCreated,
    SimpleBatchStatus,
    SimpleRequest,
)
from gateway.batch.results_page import Cursor, Page, parse_cursor, parse_limit, read_page
from gateway.batch.rows import BatchRow, FileRow
from gateway.batch.submit import (
    api_handler,
    batch_object,
    check_open_batches,
    check_priority,
    decode,
    json_response,
    limit_error,
    storage_left,
    submit_batch,
    team_of,
    window_seconds,
)
from gateway.batch.uploads import UploadSlots
from protocol.openai import APIError

_ENC = msgspec.json.Encoder()


def to_jsonl(requests: list[Any]) -> tuple[list[bytes], list[BatchError]]:
    """One JSONL line per simple request, and the requests that are not even shaped right."""
    lines: list[bytes] = []
    errors: list[BatchError] = []
    for n, item in enumerate(requests, start=1):
        if not isinstance(item, dict):
            errors.append(
                BatchError(code="invalid_request", line=n, message="a request must be an object")
            )
            lines.append(b"")
            continue
        if "body" in item:
            try:
                req = msgspec.convert(item, SimpleRequest)
            except msgspec.ValidationError as e:
                errors.append(BatchError(code="invalid_request", line=n, message=str(e)))
                lines.append(b"")
                continue
        else:
            req = SimpleRequest(body=item)
        url = req.url or (
            "/v1/completions"
            if "prompt" in req.body and "messages" not in req.body
            else "/v1/chat/completions"
        )
        custom_id = req.custom_id if req.custom_id is not None else f"request-{n}"
        lines.append(
            _ENC.encode({"custom_id": custom_id, "method": "POST", "url": url, "body": req.body})
        )
    return lines, errors


def add_simple_routes(
    router: web.UrlDispatcher,
    *,
    store: BatchTables,
    authenticate: Authenticate,
    config: BatchConfig,
    wake: Any,
    slots: UploadSlots,
) -> None:
    files = FileStore(config.files_dir)
    estimator = Estimator(store, config)

    async def create(request: web.Request) -> web.Response:
        team = await team_of(request, authenticate)
        with slots.hold(team):  # before the body is read
            return await create_for(request, team)

    async def create_for(request: web.Request, team: str) -> web.Response:
        body: SimpleBatchCreate = decode(await request.read(), SimpleBatchCreate)
        if not body.requests:
            raise APIError(400, "requests is empty", param="requests")
        if len(body.requests) > config.max_requests:
            raise APIError(
                400, f"a batch holds at most {config.max_requests} requests", param="requests"
            )
        window = window_seconds(config, body.completion_window)
        if body.callback_url is not None:
            if config.callback_secret_for(team) is None:
                raise APIError(
                    400, "callbacks are not configured on this gateway", param="callback_url"
                )
            try:
                check_callback_url_now(body.callback_url, config.allow_private_callbacks)
            except CallbackURLError as e:
                raise APIError(
                    400, str(e), param="callback_url", code="invalid_callback_url"
                ) from None
        lines, errors = to_jsonl(body.requests)
        scan = Scan(config)
        parsed = list(scan.lines(lines))
        errors += scan.errors
        unfit_lines = (unfit(x, parsed[0].url, config) for x in parsed)
        errors += [e for e in unfit_lines if e is not None][:MAX_REPORTED_ERRORS]
        if errors:
            errors.sort(key=lambda e: e.line or 0)
            raise APIError(400, str(InvalidFile(errors)), param="requests", code="invalid_batch")
        data = b"\n".join(lines) + b"\n"
        if len(data) > config.max_file_bytes:
            raise APIError(
                413, f"a batch is at most {config.max_file_bytes} bytes", param="requests"
            )
        if len(data) > await storage_left(store, config, team):
            raise APIError(
                413,
                f"this batch would take the team's stored files past its limit of "
                f"{config.max_team_bytes} bytes; delete files first",
                param="requests",
                code="team_storage_full",
            )
        check_priority(config, team, PRIORITIES[body.priority])
        await check_open_batches(store, config, team)  # before its file is stored
        fid = new_file_id()
        await asyncio.to_thread(files.write, fid, [data])
        now = time.time()
        try:  # the store holds both bounds against requests racing the checks above
            await store.insert_file(
                FileRow(
                    id=fid,
                    team_id=team,
                    purpose="batch",
                    filename="batch.jsonl",
                    bytes=len(data),
                    created_at=now,
                ),
                max_team_bytes=config.max_team_bytes,
            )
        except TeamLimit as e:
            with contextlib.suppress(OSError):
                files.delete(fid)
            raise limit_error(config, team, e, param="requests") from None
        try:
            row = await submit_batch(
                store,
                files,
                config,
                team_id=team,
                kind="simple",
                endpoint=parsed[0].url,
                input_file_id=fid,
                window=body.completion_window,
                metadata=body.metadata,
                callback_url=body.callback_url,
                priority=PRIORITIES[body.priority],
                refuse_invalid=True,
            )
        except APIError:  # no batch: its file goes too, so it holds none of the team's storage
            await store.delete_file(team, fid)
            with contextlib.suppress(OSError):
                files.delete(fid)
            raise
        wake()
        est = min(await estimator.completion(len(parsed), now), now + window)
        return json_response(
            SimpleBatchCreated(batch_id=row.id, status=row.status, estimated_completion=int(est)),
            status=202,
        )

    async def status(request: web.Request) -> web.Response:
        team = await team_of(request, authenticate)
        limit = parse_limit(request.query.get("limit"))
        after = parse_cursor(request.query.get("after"))
        bid = request.match_info["batch_id"]
        row = await store.get_batch(team, bid)
        if row is None:
            raise APIError(404, f"No such Batch: {bid!r}", param="id", code="not_found")
        return json_response(await simple_status(store, estimator, row, files, (after, limit)))

    router.add_route("POST", "/v1/batch", api_handler(create))
    router.add_route("GET", "/v1/batch/{batch_id}", api_handler(status))


async def simple_status(
    store: BatchTables,
    estimator: Estimator,
    row: BatchRow,
    files: FileStore,
    page_at: tuple[Cursor, int],
) -> SimpleBatchStatus:
    """The batch's state; once it has ended, the page of its results `page_at` (after, limit)
    names, from its files (those its team still has)."""
    page: Page | None = None
    est: float | None = None
    if row.status in TERMINAL:
        parts = [
            f if f is not None and await store.get_file(row.team_id, f) else None
            for f in (row.output_file_id, row.error_file_id)
        ]
        page = await asyncio.to_thread(read_page, files, parts, *page_at)
    else:
        left = row.counts.total - row.counts.completed - row.counts.failed
        est = min(
            await estimator.completion(0, time.time()) if left else time.time(),
            row.expires_at,
        )
    obj = batch_object(row)
    return SimpleBatchStatus(
        batch_id=row.id,
        status=row.status,
        created_at=obj.created_at,
        estimated_completion=None if est is None else int(est),
        request_counts=row.counts,
        output_file_id=row.output_file_id,
        error_file_id=row.error_file_id,
        errors=obj.errors,
        results=None if page is None else page.lines,
        next_after=None if page is None else page.next_after,
    )
