"""HTTP routes of OpenAI's Files and Batches APIs (as the official SDK calls them):
`POST/GET /v1/files`, `GET/DELETE /v1/files/{id}`, `GET /v1/files/{id}/content`,
`POST/GET /v1/batches`, `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`, plus the simple
form (simple.py). Mounted on any aiohttp app or router by `make_batch_routes`.

Invariants: every handler first learns the caller's team, and every lookup is by (team, id),
so another team's file or batch answers 404 exactly like a missing one. Uploads are streamed
to disk with a size cap (413 past it) and validated before the file exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web

from gateway.accounts.store.batch_tables import BatchTables, Conflict, TeamLimit
from gateway.accounts.store.private_files import open_private
from gateway.batch.api_rate import rate_limited
from gateway.batch.config import BatchConfig
from gateway.batch.contracts import Authenticate
from gateway.batch.files import FileStore, InvalidFile, bounded_lines, new_file_id, validate_file
from gateway.batch.models import CreateBatch, FileObject, ListPage
from gateway.batch.rows import FileRow
from gateway.batch.simple import add_simple_routes
from gateway.batch.submit import (
    api_handler,
    batch_object,
    decode,
    json_response,
    limit_error,
    storage_left,
    submit_batch,
    team_of,
)
from gateway.batch.uploads import UploadSlots
from protocol.openai import APIError

UPLOAD_CHUNK = 1 << 20


def file_object(row: FileRow) -> FileObject:
    return FileObject(
        id=row.id,
        bytes=row.bytes,
        created_at=int(row.created_at),
        filename=row.filename,
        purpose=row.purpose,
        expires_at=None if row.expires_at is None else int(row.expires_at),
    )


#: OpenAI's bounds on a file's `expires_after[seconds]` (one hour to 30 days)
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 30 * 86400


def expires_after(anchor: str | None, seconds: str | None) -> float | None:
    """Seconds after creation at which the file expires, from OpenAI's multipart fields
    `expires_after[anchor]` (only `created_at`) and `expires_after[seconds]`."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise APIError(
            400,
            f"expires_after[anchor] must be 'created_at', got {anchor!r}",
            param="expires_after",
        )
    try:
        n = int(seconds or "")
    except ValueError:
        raise APIError(
            400,
            f"expires_after[seconds] must be an integer, got {seconds!r}",
            param="expires_after",
        ) from None
    if not EXPIRES_MIN_S <= n <= EXPIRES_MAX_S:
        raise APIError(
            400,
            f"expires_after[seconds] must be between {EXPIRES_MIN_S} and {EXPIRES_MAX_S}, got {n}",
            param="expires_after",
        )
    return float(n)


def page_limit(request: web.Request, default: int = 20) -> int:
    raw = request.query.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError:
        raise APIError(400, f"limit must be an integer, got {raw!r}", param="limit") from None
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", param="limit")
    return limit


def not_found(kind: str, id_: str) -> APIError:
    return APIError(404, f"No such {kind}: {id_!r}", param="id", code="not_found")


class _Routes:
    def __init__(
        self, store: BatchTables, authenticate: Authenticate, config: BatchConfig, wake: Any
    ) -> None:
        self.store = store
        self.auth = authenticate
        self.config = config
        self.files = FileStore(config.files_dir)
        self.wake = wake
        self.slots = UploadSlots(config)

    # ---- files ----
    async def upload(self, request: web.Request) -> web.Response:
        team = await team_of(request, self.auth)
        if not request.content_type.startswith("multipart/"):
            raise APIError(
                400, "upload a file as multipart/form-data with fields 'file' and 'purpose'"
            )
        with self.slots.hold(team):  # before the body is read
            return await self._upload(request, team)

    async def _upload(self, request: web.Request, team: str) -> web.Response:
        reader = await request.multipart()
        purpose: str | None = None
        expiry: dict[str, str] = {}
        filename = "upload.jsonl"
        temp = None
        size = 0
        try:
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):  # a multipart/* part: a form in a form
                    raise APIError(400, "a form field cannot itself be multipart")
                if part.name == "purpose":
                    purpose = (await part.read(decode=True)).decode(errors="replace")[:64]
                elif part.name in ("expires_after[anchor]", "expires_after[seconds]"):
                    expiry[part.name[14:-1]] = (await part.read(decode=True)).decode(
                        errors="replace"
                    )[:64]
                elif part.name == "file":
                    if temp is not None:
                        raise APIError(400, "upload one file per request", param="file")
                    # Echoed in headers and listings: keep it printable and short.
                    filename = re.sub(r"[^\w.\- ]", "_", part.filename or filename)[:255]
                    temp, size = await self._save_part(
                        part, await storage_left(self.store, self.config, team)
                    )
            if purpose != "batch":
                raise APIError(400, f"purpose must be 'batch' (got {purpose!r})", param="purpose")
            ttl = expires_after(expiry.get("anchor"), expiry.get("seconds"))
            if temp is None:
                raise APIError(400, "the upload has no 'file' field", param="file")
            saved = temp
            try:
                await asyncio.to_thread(
                    lambda: validate_file(
                        bounded_lines(saved, self.config.max_line_bytes), self.config
                    )
                )
            except InvalidFile as e:
                raise APIError(
                    400, f"invalid batch file: {e}", param="file", code="invalid_file"
                ) from None
            fid = new_file_id()
            self.files.commit(temp, fid)
            temp = None
        finally:
            if temp is not None:
                temp.unlink(missing_ok=True)
        now = time.time()
        row = FileRow(
            id=fid,
            team_id=team,
            purpose="batch",
            filename=filename,
            bytes=size,
            created_at=now,
            expires_at=None if ttl is None else now + ttl,
        )
        try:
            await self.store.insert_file(row, max_team_bytes=self.config.max_team_bytes)
        except TeamLimit as e:  # uploads racing this one filled the team's storage meanwhile
            with contextlib.suppress(OSError):
                self.files.delete(fid)
            raise limit_error(self.config, team, e) from None
        return json_response(file_object(row))

    async def _save_part(self, part: BodyPartReader, cap: int) -> tuple[Path, int]:
        """`cap`: the file bound, or less when the team's storage (`max_team_bytes`) is nearly
        full."""
        temp = self.files.temp_path()
        size = 0
        try:
            with open_private(temp) as f:
                while chunk := await part.read_chunk(UPLOAD_CHUNK):
                    size += len(chunk)
                    if size > cap:
                        if cap < self.config.max_file_bytes:
                            raise APIError(
                                413,
                                "this file would take the team's stored files past its limit of "
                                f"{self.config.max_team_bytes} bytes; delete files first",
                                param="file",
                                code="team_storage_full",
                            )
                        raise APIError(
                            413,
                            f"a batch file is at most {self.config.max_file_bytes} bytes",
                            param="file",
                            code="file_too_large",
                        )
                    f.write(chunk)
                f.flush()
                await asyncio.to_thread(
                    os.fsync, f.fileno()
                )  # the upload survives a crash once answered
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        return temp, size

    async def get_file(self, request: web.Request) -> web.Response:
        team = await team_of(request, self.auth)
        fid = request.match_info["file_id"]
        row = await self.store.get_file(team, fid)
        if row is None:
            raise not_found("File", fid)
        return json_response(file_object(row))

    async def list_files(self, request: web.Request) -> web.Response:
        team = await team_of(request, self.auth)
        limit = page_limit(request, 100)
        rows, more = await self.store.list_files(
            team, request.query.get("purpose"), request.query.get("after"), limit
        )
        data = [file_object(r) for r in rows]
        return json_response(
            ListPage(
                data=data,
                first_id=data[0].id if data else None,
                last_id=data[-1].id if data else None,
                has_more=more,
            )
        )

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        team = await team_of(request, self.auth)
        fid = request.match_info["file_id"]
        row = await self.store.get_file(team, fid)
        if row is None or not self.files.path(fid).is_file():
            raise not_found("File", fid)
        return web.FileResponse(
            self.files.path(fid),
            headers={
                "Content-Type": "application/jsonl",
                "Content-Disposition": f'attachment; filename="{row.filename}"',
            },
        )

    async def delete_file(self, request: web.Request) -> web.Response:
        team = await team_of(request, self.auth)
        fid = request.match_info["file_id"]
        if not await self.store.delete_file(team, fid):
            raise not_found("File", fid)
        # Running batches keep their requests in the store, so the contents can go now.
        with contextlib.suppress(OSError):
            self.files.delete(fid)
        return json_response({"id": fid, "object": "file", "deleted": True})

    # ---- batches ----
    async def create_batch(self, request: web.Request) -> web.Response:
        team = await team_of(request, self.auth)
        body: CreateBatch = decode(await request.read(), CreateBatch)
        f = await self.store.get_file(team, body.input_file_id)
        if f is None:
            raise not_found("File", body.input_file_id)
        if f.purpose != "batch":
            raise APIError(
                400, f"file {f.id!r} has purpose {f.purpose!r}, not 'batch'", param="input_file_id"
            )
        with self.slots.hold(team):  # it reads the whole file, twice
            row = await submit_batch(
                self.store,
                self.files,
                self.config,
                team_id=team,
                kind="openai",
                endpoint=body.endpoint,
                input_file_id=f.id,
                window=body.completion_window,
                metadata=body.metadata,
            )
        self.wake()
        return json_response(batch_object(row))

    async def get_batch(self, request: web.Request) -> web.Response:
        team = await team_of(request, self.auth)
        bid = request.match_info["batch_id"]
        row = await self.store.get_batch(team, bid)
        if row is None:
            raise not_found("Batch", bid)
        return json_response(batch_object(row))

    async def list_batches(self, request: web.Request) -> web.Response:
        team = await team_of(request, self.auth)
        rows, more = await self.store.list_batches(
            team, request.query.get("after"), page_limit(request)
        )
        data = [batch_object(r) for r in rows]
        return json_response(
            ListPage(
                data=data,
                first_id=data[0].id if data else None,
                last_id=data[-1].id if data else None,
                has_more=more,
            )
        )

    async def cancel_batch(self, request: web.Request) -> web.Response:
        team = await team_of(request, self.auth)
        bid = request.match_info["batch_id"]
        try:
            row = await self.store.cancel_batch(team, bid, time.time())
        except Conflict as e:
            raise APIError(409, str(e), code="batch_not_cancellable") from None
        if row is None:
            raise not_found("Batch", bid)
        self.wake()
        return json_response(batch_object(row))


def make_batch_routes(
    app_or_router: web.Application | web.UrlDispatcher,
    *,
    store: BatchTables,
    authenticate: Authenticate,
    config: BatchConfig,
    wake: Any = None,
) -> None:
    """Add the batch tier's routes. `wake` (e.g. `BatchRunner.wake`) makes a runner in the same
    process look at a new or cancelled batch at once instead of at its next poll."""
    router = app_or_router.router if isinstance(app_or_router, web.Application) else app_or_router
    authenticate = rate_limited(authenticate, config.max_api_calls_per_minute)
    r = _Routes(store, authenticate, config, wake or (lambda: None))
    for method, path, fn in (
        ("POST", "/v1/files", r.upload),
        ("GET", "/v1/files", r.list_files),
        ("GET", "/v1/files/{file_id}", r.get_file),
        ("DELETE", "/v1/files/{file_id}", r.delete_file),
        ("GET", "/v1/files/{file_id}/content", r.file_content),
        ("POST", "/v1/batches", r.create_batch),
        ("GET", "/v1/batches", r.list_batches),
        ("GET", "/v1/batches/{batch_id}", r.get_batch),
        ("POST", "/v1/batches/{batch_id}/cancel", r.cancel_batch),
    ):
        router.add_route(method, path, api_handler(fn))
    add_simple_routes(
        router, store=store, authenticate=authenticate, config=config, wake=r.wake, slots=r.slots
    )
