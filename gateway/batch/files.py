"""Batch input files: JSONL validation with line numbers, and file contents on disk.

Invariants: a stored file is complete (written to a temporary name, then renamed); a file with
purpose `batch` was validated line by line before it was stored, so a batch built from it needs
only the checks that depend on the batch itself (its endpoint, the models served). Line numbers
are 1-based and count every line, blank ones included, as an editor shows them.

Validation streams: it holds one line at a time, never the file. A line's body is not decoded
into Python objects: only the few fields a check reads are (`model`, `stream`, whether
`messages` is a list of objects, whether `prompt` is empty), every other value is skipped by the
decoder, and the body goes on as the JSON text it came in. Decoded whole, a line of small nested
arrays took about 21 times its size, and the file's lines were all kept: one 200 MiB upload
could take the gateway's memory. What is kept across lines is each custom_id (to refuse a
duplicate), at most `max_requests` of them.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec

from gateway.accounts.store.private_files import durable_replace, open_private, private_dir
from gateway.batch.config import BatchConfig
from gateway.batch.models import BatchError
from protocol.openai import APIError

MAX_CUSTOM_ID = 512
MAX_REPORTED_ERRORS = 100  # a 50,000-line file of garbage should not make a 50,000-line error
_ABSENT = msgspec.Raw(b"")
#: an empty JSON array or object, as `prompt` or `stream` may be written
_EMPTY = re.compile(rb"\[\s*\]|\{\s*\}")
_EMPTY_LIST = re.compile(rb"\[\s*\]")


class _Line(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One input line; `body` stays the JSON text it was (a view of the line, not a copy)."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class _Body(msgspec.Struct, frozen=True):
    """The fields of a request body the checks read, still JSON text; the rest is skipped."""

    model: msgspec.Raw = _ABSENT
    stream: msgspec.Raw = _ABSENT
    messages: msgspec.Raw = _ABSENT
    prompt: msgspec.Raw = _ABSENT


class _Object(msgspec.Struct, frozen=True, gc=False):
    """Any JSON object, its keys skipped: a message is an object, whatever it holds."""


_LINE = msgspec.json.Decoder(_Line)
_BODY = msgspec.json.Decoder(_Body)
_MESSAGES = msgspec.json.Decoder(list[_Object])
_MODEL = msgspec.json.Decoder(str)
_SCALAR = msgspec.json.Decoder()


@dataclass(frozen=True)
class Line:
    """A valid request line: what the batch checks and the store need, the body as JSON text."""

    number: int
    custom_id: str
    url: str
    model: str
    body: str


class InvalidFile(ValueError):
    """A file or batch refused with the lines that are wrong."""

    def __init__(self, errors: list[BatchError]) -> None:
        self.errors = errors
        shown = "; ".join(
            f"line {e.line}: {e.message}" if e.line else e.message for e in errors[:10]
        )
        more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
        super().__init__(f"{len(errors)} invalid line(s): {shown}{more}")


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def _truthy(raw: msgspec.Raw) -> bool:
    """Python's truth of a JSON value, without building a container to learn it."""
    text = bytes(raw)
    if text[:1] in (b"[", b"{"):
        return _EMPTY.fullmatch(text) is None
    return bool(_SCALAR.decode(text))


def _no_prompt(raw: msgspec.Raw) -> bool:
    """`prompt` absent, null, "" or []."""
    text = bytes(raw)
    return text in (b"", b"null", b'""') or _EMPTY_LIST.fullmatch(text) is not None


def _model(body: _Body) -> str | None:
    if not body.model:
        return None
    try:
        model = _MODEL.decode(body.model)
    except msgspec.ValidationError:
        return None
    return model or None


def _check_body(url: str, body: _Body) -> str | None:
    if _model(body) is None:
        return "body.model must be a non-empty string"
    if body.stream and _truthy(body.stream):
        return "body.stream is not supported in a batch"
    if url == "/v1/chat/completions":
        try:
            messages = _MESSAGES.decode(body.messages) if body.messages else []
        except msgspec.ValidationError:
            messages = []
        if not messages:
            return "body.messages must be a non-empty list of message objects"
    elif url == "/v1/completions" and _no_prompt(body.prompt):
        return "body.prompt is required"
    return None


class Scan:
    """Checks a file's lines one at a time: `lines()` yields each valid line as it is read, and
    what is wrong lands in `errors` (at most MAX_REPORTED_ERRORS, then the scan stops). With an
    `endpoint`, a valid line unfit for that batch (another endpoint, a model not served) is an
    error too. Memory: one line, and the custom_ids seen so far."""

    def __init__(self, config: BatchConfig, endpoint: str | None = None) -> None:
        self.config = config
        self.endpoint = endpoint
        self.errors: list[BatchError] = []
        #: valid lines so far
        self.count = 0
        self._seen: dict[str, int] = {}

    def lines(self, raw_lines: Iterable[bytes]) -> Iterator[Line]:
        for n, raw in enumerate(raw_lines, start=1):
            if len(self.errors) >= MAX_REPORTED_ERRORS:
                break
            line = self._check(n, raw)
            if line is None:
                continue
            self.count += 1
            if self.count > self.config.max_requests:
                limit = self.config.max_requests
                self._bad(n, "too_many_requests", f"a batch holds at most {limit} requests")
                break
            if self.endpoint is not None and (bad := unfit(line, self.endpoint, self.config)):
                self.errors.append(bad)
                continue
            yield line
        if not self.count and not self.errors:
            self.errors.append(BatchError(code="empty_file", message="the file holds no requests"))

    def _bad(self, n: int, code: str, message: str, param: str | None = None) -> None:
        self.errors.append(BatchError(code=code, message=message, line=n, param=param))

    def _check(self, n: int, raw: bytes) -> Line | None:
        limit = self.config.max_line_bytes
        if len(raw) > limit:  # before decoding: a 200 MB line costs nothing
            self._bad(n, "line_too_large", f"a request line is at most {limit} bytes")
            return None
        if not raw.strip():
            return None
        try:
            line = _LINE.decode(raw)
        except msgspec.ValidationError as e:
            self._bad(n, "invalid_request", f"invalid request line: {e}")
            return None
        except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: nested too deep
            self._bad(n, "invalid_json_line", f"malformed JSON: {e}")
            return None
        try:
            body = _BODY.decode(line.body)  # an object? (its fields' values stay text)
        except msgspec.ValidationError as e:
            self._bad(n, "invalid_request", f"invalid request line: {e} - at `$.body`")
            return None
        cid = line.custom_id
        if not cid or len(cid) > MAX_CUSTOM_ID:
            msg = f"custom_id must be 1 to {MAX_CUSTOM_ID} characters"
            self._bad(n, "invalid_custom_id", msg, "custom_id")
            return None
        if cid in self._seen:
            msg = f"custom_id {cid!r} already used on line {self._seen[cid]}"
            self._bad(n, "duplicate_custom_id", msg, "custom_id")
            return None
        self._seen[cid] = n
        return self._request(n, line, body)

    def _request(self, n: int, line: _Line, body: _Body) -> Line | None:
        if line.method != "POST":
            self._bad(n, "invalid_method", f"method must be POST, got {line.method!r}", "method")
            return None
        if line.url not in self.config.endpoints:
            ends = ", ".join(self.config.endpoints)
            msg = f"url {line.url!r} is not a batch endpoint (one of {ends})"
            self._bad(n, "invalid_url", msg, "url")
            return None
        if (wrong := _check_body(line.url, body)) is not None:
            self._bad(n, "invalid_body", wrong, "body")
            return None
        text = bytes(line.body).decode()  # the decoder checked it is UTF-8
        return Line(
            number=n, custom_id=line.custom_id, url=line.url, model=_model(body) or "", body=text
        )


def unfit(line: Line, endpoint: str, config: BatchConfig) -> BatchError | None:
    """What makes a valid line unfit for this batch: another endpoint, a model not served."""
    if line.url != endpoint:
        msg = f"url {line.url!r} differs from the batch's endpoint {endpoint!r}"
        return BatchError(code="mismatched_endpoint", line=line.number, param="url", message=msg)
    if config.models is not None and line.model not in config.models:
        msg = f"model {line.model!r} is not served here"
        return BatchError(code="model_not_found", line=line.number, param="body.model", message=msg)
    return None


def validate_file(lines: Iterable[bytes], config: BatchConfig) -> int:
    """The number of requests in a batch input file; raises InvalidFile listing malformed JSON,
    missing/extra fields, bad methods or endpoints, duplicate custom_ids and a count over the
    limit. Reads the lines one at a time and keeps none of them."""
    scan = Scan(config)
    for _ in scan.lines(lines):
        pass
    if scan.errors:
        raise InvalidFile(scan.errors)
    return scan.count


def read_lines(f: BinaryIO, limit: int | None = None) -> Iterator[bytes]:
    """The lines of an open binary file; with `limit`, a line longer than `limit` bytes is
    yielded cut to `limit + 1` bytes and the rest of it is skipped (never whole in memory)."""
    if limit is None:
        yield from f
        return
    while line := f.readline(limit + 1):
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
        yield line


def bounded_lines(path: Path, limit: int | None = None) -> Iterator[bytes]:
    """`read_lines` of the file at `path`."""
    with open(path, "rb") as f:
        yield from read_lines(f, limit)


class FileStore:
    """File contents under one directory, named by file id."""

    def __init__(self, directory: Path) -> None:
        self.directory = private_dir(Path(directory))

    def path(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise ValueError(f"bad file id {file_id!r}")  # never let an id name another path
        return self.directory / f"{file_id}.jsonl"

    def temp_path(self) -> Path:
        return self.directory / f".upload-{uuid.uuid4().hex}.tmp"

    def commit(self, temp: Path, file_id: str) -> None:
        durable_replace(temp, self.path(file_id))

    def write(self, file_id: str, chunks: Iterable[bytes]) -> int:
        temp = self.temp_path()
        size = 0
        with open_private(temp) as f:
            for c in chunks:
                f.write(c)
                size += len(c)
            f.flush()
            os.fsync(f.fileno())
        self.commit(temp, file_id)
        return size

    def lines(self, file_id: str, limit: int | None = None) -> Iterator[bytes]:
        """The file's lines; with `limit`, a longer line comes cut to `limit + 1` bytes (never
        whole in memory), enough for a Scan to refuse it."""
        yield from bounded_lines(self.path(file_id), limit)

    def open(self, file_id: str) -> BinaryIO:
        """The file, open for reading (still readable if it is deleted meanwhile); a missing
        file is the caller's 404."""
        try:
            return open(self.path(file_id), "rb")
        except FileNotFoundError:
            raise APIError(
                404, f"No such File: {file_id!r}", param="input_file_id", code="not_found"
            ) from None

    def read(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
