"""The store's "no space left" as the client's defined error: 503 `store_unavailable`.

A request reserves its worst case in the store before any backend computes for it, and its
usage record is written there after. When the store's file system (SQLite) or database server
(PostgreSQL) is full, the reservation cannot be written: the request is refused then, before
work is done that could not be billed, with a message that says why and a Retry-After. Usage
already written stays (a failed write changes nothing), settlements of requests already running
wait in the usage writer's queue until the store takes them, and the first reservation that
fits after space returns is served: nothing to restart.

Anything else the store raises stays an internal error.
"""

from __future__ import annotations

import errno
import sqlite3

from protocol.openai import APIError

#: PostgreSQL's SQLSTATE for a full disk (disk_full)
PG_DISK_FULL = "53100"
#: what a refused client waits before trying again
RETRY_AFTER_S = 5.0


def disk_full(e: BaseException) -> bool:
    """Whether `e` (or what it was raised from) says the store's storage is full."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, sqlite3.Error) and getattr(cur, "sqlite_errorcode", None) == (
            sqlite3.SQLITE_FULL
        ):
            return True
        if isinstance(cur, OSError) and cur.errno == errno.ENOSPC:
            return True
        if getattr(cur, "sqlstate", None) == PG_DISK_FULL:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def store_unavailable(e: BaseException) -> APIError | None:
    """503 `store_unavailable` for a full store; None for any other error."""
    if not disk_full(e):
        return None
    return APIError(
        503,
        "the gateway's usage store is out of space (its disk is full), so no new request can "
        "be booked; retry shortly (operators: free space on the store's file system)",
        type_="service_unavailable",
        code="store_unavailable",
        retry_after_s=RETRY_AFTER_S,
    )
