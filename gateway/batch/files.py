"""Batch input files: JSONL validation with line numbers, and file contents on disk.

Invariants: a stored file is complete (written to a temporary name, then renamed); a file with
purpose `batch` was validated line by line before it was stored, so a batch built from it needs
only the checks that depend on the batch itself (its endpoint, the models served). Line numbers
are 1-based and count every line, blank ones included, as an editor shows them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from gateway.accounts.store.private_files import durable_replace, open_private, private_dir
from gateway.batch.config import BatchConfig
from gateway.batch.models import BatchError, InputLine

MAX_CUSTOM_ID = 512
MAX_REPORTED_ERRORS = 100  # a 50,000-line file of garbage should not make a 50,000-line error
_LINE = msgspec.json.Decoder(InputLine)


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


def _check_body(url: str, body: dict[str, Any]) -> str | None:
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "body.model must be a non-empty string"
    if body.get("stream"):
        return "body.stream is not supported in a batch"
    if url == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            return "body.messages must be a non-empty list of message objects"
    elif url == "/v1/completions" and body.get("prompt") in (None, "", []):
        return "body.prompt is required"
    return None


def parse_lines(lines: Iterable[bytes], config: BatchConfig) -> list[tuple[int, InputLine]]:
    """Every request line of a batch input file with its line number; raises InvalidFile
    listing malformed JSON, missing/extra fields, bad methods or endpoints, duplicate
    custom_ids and a count over the limit."""
    out, errors = parse_lines_collect(lines, config)
    if errors:
        raise InvalidFile(errors)
    return out


def parse_lines_collect(
    lines: Iterable[bytes], config: BatchConfig
) -> tuple[list[tuple[int, InputLine]], list[BatchError]]:
    """parse_lines, returning the good lines and the errors instead of raising."""
    out: list[tuple[int, InputLine]] = []
    errors: list[BatchError] = []
    seen: dict[str, int] = {}

    def bad(n: int, code: str, message: str, param: str | None = None) -> None:
        errors.append(BatchError(code=code, message=message, line=n, param=param))

    for n, raw in enumerate(lines, start=1):
        if len(errors) >= MAX_REPORTED_ERRORS:
            break
        if len(raw) > config.max_line_bytes:  # before decoding: a 200 MB line costs nothing
            bad(n, "line_too_large", f"a request line is at most {config.max_line_bytes} bytes")
            continue
        if not raw.strip():
            continue
        try:
            line = _LINE.decode(raw)
        except msgspec.ValidationError as e:
            bad(n, "invalid_request", f"invalid request line: {e}")
            continue
        except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: JSON nested too deep
            bad(n, "invalid_json_line", f"malformed JSON: {e}")
            continue
        if not line.custom_id or len(line.custom_id) > MAX_CUSTOM_ID:
            bad(
                n,
                "invalid_custom_id",
                f"custom_id must be 1 to {MAX_CUSTOM_ID} characters",
                "custom_id",
            )
            continue
        if line.custom_id in seen:
            bad(
                n,
                "duplicate_custom_id",
                f"custom_id {line.custom_id!r} already used on line {seen[line.custom_id]}",
                "custom_id",
            )
            continue
        seen[line.custom_id] = n
        if line.method != "POST":
            bad(n, "invalid_method", f"method must be POST, got {line.method!r}", "method")
            continue
        if line.url not in config.endpoints:
            bad(
                n,
                "invalid_url",
                f"url {line.url!r} is not a batch endpoint (one of {', '.join(config.endpoints)})",
                "url",
            )
            continue
        if (msg := _check_body(line.url, line.body)) is not None:
            bad(n, "invalid_body", msg, "body")
            continue
        out.append((n, line))
        if len(out) > config.max_requests:
            bad(n, "too_many_requests", f"a batch holds at most {config.max_requests} requests")
            break
    if not out and not errors:
        errors.append(BatchError(code="empty_file", message="the file holds no requests"))
    return out, errors


def check_for_batch(
    lines: list[tuple[int, InputLine]], endpoint: str, config: BatchConfig
) -> list[BatchError]:
    """What makes a valid file unfit for this batch: a line for another endpoint, a model not
    served."""
    errors: list[BatchError] = []
    for n, line in lines:
        if line.url != endpoint:
            errors.append(
                BatchError(
                    code="mismatched_endpoint",
                    line=n,
                    param="url",
                    message=(f"url {line.url!r} differs from the batch's endpoint {endpoint!r}"),
                )
            )
        elif config.models is not None and line.body["model"] not in config.models:
            errors.append(
                BatchError(
                    code="model_not_found",
                    line=n,
                    param="body.model",
                    message=(f"model {line.body['model']!r} is not served here"),
                )
            )
        if len(errors) >= MAX_REPORTED_ERRORS:
            break
    return errors


def bounded_lines(path: Path, limit: int | None = None) -> Iterator[bytes]:
    """Lines of the file at `path`; with `limit`, a line longer than `limit` bytes is yielded
    cut to `limit + 1` bytes and the rest of it is skipped."""
    with open(path, "rb") as f:
        if limit is None:
            yield from f
            return
        while line := f.readline(limit + 1):
            if len(line) > limit and not line.endswith(b"\n"):
                while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass
            yield line


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
        whole in memory), enough for parse_lines to refuse it."""
        yield from bounded_lines(self.path(file_id), limit)

    def read(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
