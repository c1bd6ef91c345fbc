"""A page of an ended simple batch's results (`GET /v1/batch/{id}?limit=&after=`), read from
its files: the output file's lines (the requests that succeeded, in input order), then the
error file's (the rest, in input order). Nothing is read from the store, and a page costs its
own lines only: the cursor is where the last page stopped (which file, the byte offset in it),
so the next page seeks there instead of reading what came before.

Invariants: a page holds at most `limit` lines (`MAX_LIMIT`) and stops early once it holds
`MAX_PAGE_BYTES` (one line always fits); a file the team deleted contributes nothing; the cursor
is opaque to clients (`next_after` of the last page), and a malformed one is a 400.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from gateway.batch.files import FileStore
from protocol.openai import APIError

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
#: a page stops growing past this many bytes of lines (a line of a long answer may be large)
MAX_PAGE_BYTES = 4 << 20


@dataclass(frozen=True)
class Cursor:
    """Where a page starts: `part` 0 is the output file, 1 the error file."""

    part: int = 0
    offset: int = 0

    def text(self) -> str:
        return f"{self.part}.{self.offset}"


@dataclass(frozen=True)
class Page:
    lines: list[msgspec.Raw]
    #: the next page's `after`, or None when this page reached the end
    next_after: str | None


def parse_limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_LIMIT
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
        raise APIError(400, f"limit must be an integer from 1 to {MAX_LIMIT}", param="limit")
    return int(text)


def parse_cursor(text: str | None) -> Cursor:
    if text is None:
        return Cursor()
    part, _, offset = text.partition(".")
    if part not in ("0", "1") or not offset.isdigit():
        raise APIError(
            400, "after must be the next_after of an earlier page of this batch", param="after"
        )
    return Cursor(int(part), int(offset))


def read_page(files: FileStore, parts: Sequence[str | None], after: Cursor, limit: int) -> Page:
    """The page of `limit` lines from `after` over the files `parts` (None: none); blocking."""
    lines: list[msgspec.Raw] = []
    size = 0
    for part in range(after.part, len(parts)):
        fid = parts[part]
        if fid is None:
            continue
        try:
            f = files.open(fid)
        except APIError:  # gone from disk: its lines are too
            continue
        with f:
            offset = after.offset if part == after.part else 0
            f.seek(offset)
            while len(lines) < limit and size < MAX_PAGE_BYTES and (line := f.readline()):
                offset += len(line)
                size += len(line)
                lines.append(msgspec.Raw(line.rstrip(b"\n")))
            if len(lines) < limit and size < MAX_PAGE_BYTES:
                continue  # this file is done and the page has room
            if offset < os.fstat(f.fileno()).st_size:
                return Page(lines, Cursor(part, offset).text())
            return Page(lines, Cursor(part + 1).text() if _any_after(files, parts, part) else None)
    return Page(lines, None)


def _any_after(files: FileStore, parts: Sequence[str | None], part: int) -> bool:
    """Whether a file after `part` has a line."""
    for fid in parts[part + 1 :]:
        if fid is not None:
            try:
                if files.path(fid).stat().st_size > 0:
                    return True
            except FileNotFoundError:
                pass
    return False
