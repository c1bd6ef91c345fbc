"""What both API forms share: who is calling, OpenAI error answers, turning a validated input
file into a batch (or a failed one, with its bad lines), and a store row into a Batch object.

Invariant: a batch row and all its request rows are written in one transaction, so a batch the
client can see is always complete.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, BinaryIO

import msgspec
from aiohttp import web

from gateway.accounts.store.batch_tables import BatchTables, TeamLimit
from gateway.batch.config import BatchConfig
from gateway.batch.contracts import Authenticate
from gateway.batch.files import FileStore, InvalidFile, Scan, read_lines
from gateway.batch.models import PRIORITIES, Batch, BatchError, BatchErrors, RequestCounts
from gateway.batch.rows import BatchRow, NewRequest
from protocol.openai import APIError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_METADATA_PAIRS = 16
PRIORITY_NAMES = {v: k for k, v in PRIORITIES.items()}


def json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def api_handler(fn: Handler) -> Handler:
    """Turn APIError into OpenAI's error body, so these routes answer right in any app."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request)
        except APIError as e:
            return json_response(e.body(), e.status, e.response_headers())
        except web.HTTPRequestEntityTooLarge as e:  # the app's client_max_size, in OpenAI's words
            err = APIError(413, f"request body too large: {e.text}", code="request_too_large")
            return json_response(err.body(), err.status)

    return wrapped


async def team_of(request: web.Request, authenticate: Authenticate) -> str:
    team = authenticate(request)
    if inspect.isawaitable(team):
        team = await team
    if not isinstance(team, str) or not team:
        raise APIError(
            401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key"
        )
    return team


def decode(raw: bytes, type_: type[Any]) -> Any:
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request: {e}") from None
    except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise APIError(400, f"malformed JSON body: {e}") from None


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, f"metadata holds at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for k, v in metadata.items():
        if len(k) > 64 or len(v) > 512:
            raise APIError(
                400,
                "metadata keys are at most 64 characters and values at most 512",
                param="metadata",
            )


def check_priority(config: BatchConfig, team_id: str, priority: int) -> None:
    """A batch's priority is the operator's grant (`[teams.X] batch_priority`), not the client's."""
    if priority > config.max_priority_for(team_id):
        raise APIError(
            403,
            f"team {team_id!r} may not submit batches at this priority (its highest is "
            f"{PRIORITY_NAMES.get(config.max_priority_for(team_id), '?')!r})",
            type_="permission_error",
            param="priority",
            code="priority_not_allowed",
        )


def too_many_open(config: BatchConfig, team_id: str, held: int) -> APIError:
    return APIError(
        429,
        f"team {team_id!r} already has {held} batches not yet ended (limit "
        f"{config.max_open_batches}); wait for one to end or cancel one",
        type_="rate_limit_error",
        code="too_many_open_batches",
    )


def storage_full(config: BatchConfig, team_id: str, held: int, param: str = "file") -> APIError:
    return APIError(
        413,
        f"team {team_id!r} stores {held} bytes of files; this one would take it past its "
        f"limit of {config.max_team_bytes} bytes; delete files first",
        param=param,
        code="team_storage_full",
    )


def limit_error(config: BatchConfig, team_id: str, e: TeamLimit, param: str = "file") -> APIError:
    """The answer to a bound the store found reached in its own transaction (store.TeamLimit)."""
    return (
        storage_full(config, team_id, e.held, param)
        if e.kind == "bytes"
        else too_many_open(config, team_id, e.held)
    )


async def check_open_batches(store: BatchTables, config: BatchConfig, team_id: str) -> None:
    """An early answer, before a file is read or stored; the bound itself is held by the store
    (`create_batch(max_open=)`), where requests racing this check are counted."""
    _, open_ = await store.team_holdings(team_id)
    if open_ >= config.max_open_batches:
        raise too_many_open(config, team_id, open_)


async def storage_left(store: BatchTables, config: BatchConfig, team_id: str) -> int:
    """Bytes the team may still store in one file (its file bound, or what its storage allows):
    an early bound for reading an upload; the store holds the limit
    (`insert_file(max_team_bytes=)`)."""
    held, _ = await store.team_holdings(team_id)
    left = config.max_team_bytes - held
    if left <= 0:
        raise APIError(
            413,
            f"team {team_id!r} stores {held} bytes of files, its limit is "
            f"{config.max_team_bytes}; delete files first",
            param="file",
            code="team_storage_full",
        )
    return min(config.max_file_bytes, left)


def window_seconds(config: BatchConfig, window: str) -> float:
    if window not in config.completion_windows:
        raise APIError(
            400,
            f"completion_window must be one of {', '.join(config.completion_windows)}",
            param="completion_window",
        )
    return config.completion_windows[window]


def _errors_json(errors: list[BatchError]) -> list[dict[str, Any]]:
    return [msgspec.to_builtins(e) for e in errors]


async def submit_batch(
    store: BatchTables,
    files: FileStore,
    config: BatchConfig,
    *,
    team_id: str,
    kind: str,
    endpoint: str,
    input_file_id: str,
    window: str,
    metadata: dict[str, str] | None,
    callback_url: str | None = None,
    priority: int = 1,
    refuse_invalid: bool = False,
) -> BatchRow:
    """Create a batch from a stored input file. Lines unfit for this batch make a `failed`
    batch listing them (OpenAI's behaviour), or a 400 when `refuse_invalid`."""
    if endpoint not in config.endpoints:
        raise APIError(
            400, f"endpoint must be one of {', '.join(config.endpoints)}", param="endpoint"
        )
    seconds = window_seconds(config, window)
    check_metadata(metadata)
    check_priority(config, team_id, priority)
    await check_open_batches(store, config, team_id)

    with files.open(input_file_id) as f:  # one handle for both reads: a delete cannot cut it
        count, errors = await asyncio.to_thread(_scan, f, endpoint, config)
        if errors and refuse_invalid:
            raise APIError(400, str(InvalidFile(errors)), param="requests", code="invalid_batch")
        row = _new_row(
            errors,
            count,
            seconds,
            team_id=team_id,
            kind=kind,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=window,
            priority=priority,
            metadata=metadata,
            callback_url=callback_url,
        )
        # The requests are read from the file again as the store inserts them, one at a time.
        f.seek(0)
        reqs = [] if errors else _requests(f, endpoint, config)
        try:
            await store.create_batch(
                row, reqs, max_open=config.max_open_batches, max_team_bytes=config.max_team_bytes
            )
        except TeamLimit as e:  # batches created since the early check took the last places
            raise limit_error(config, team_id, e, param="input_file_id") from None
    return row


def _scan(f: BinaryIO, endpoint: str, config: BatchConfig) -> tuple[int, list[BatchError]]:
    """The file's valid lines for a batch at `endpoint`, and what makes it unfit (its lines were
    checked at upload, but the limits may have changed since)."""
    scan = Scan(config, endpoint)
    for _ in scan.lines(read_lines(f, config.max_line_bytes)):
        pass
    return scan.count, scan.errors


def _requests(f: BinaryIO, endpoint: str, config: BatchConfig) -> Iterator[NewRequest]:
    for line in Scan(config, endpoint).lines(read_lines(f, config.max_line_bytes)):
        yield NewRequest(line=line.number, custom_id=line.custom_id, body=line.body)


def _new_row(errors: list[BatchError], count: int, window_s: float, **given: Any) -> BatchRow:
    """A new batch's row: `given` names what the caller chose (team, kind, endpoint, input
    file, window, priority, metadata, callback); `errors` make it a failed batch."""
    now = time.time()
    total = 0 if errors else count
    return BatchRow(
        id=f"batch_{uuid.uuid4().hex}",
        status="failed" if errors else "in_progress",
        errors=_errors_json(errors) if errors else None,
        total=total,
        output_file_id=None,
        error_file_id=None,
        created_at=now,
        in_progress_at=None if errors else now,
        expires_at=now + window_s,
        finalizing_at=None,
        completed_at=None,
        failed_at=now if errors else None,
        expired_at=None,
        cancelling_at=None,
        cancelled_at=None,
        callback_state=None,
        callback_attempts=0,
        counts=RequestCounts(total=total),
        **given,
    )


def _ts(x: float | None) -> int | None:
    return None if x is None else int(x)


def batch_object(row: BatchRow) -> Batch:
    errors = None
    if row.errors:
        errors = BatchErrors(data=[msgspec.convert(e, BatchError) for e in row.errors])
    return Batch(
        id=row.id,
        endpoint=row.endpoint,
        errors=errors,
        input_file_id=row.input_file_id,
        completion_window=row.completion_window,
        status=row.status,
        output_file_id=row.output_file_id,
        error_file_id=row.error_file_id,
        created_at=int(row.created_at),
        request_counts=row.counts,
        metadata=row.metadata,
        in_progress_at=_ts(row.in_progress_at),
        expires_at=_ts(row.expires_at),
        finalizing_at=_ts(row.finalizing_at),
        completed_at=_ts(row.completed_at),
        failed_at=_ts(row.failed_at),
        expired_at=_ts(row.expired_at),
        cancelling_at=_ts(row.cancelling_at),
        cancelled_at=_ts(row.cancelled_at),
    )
