"""The batch tier's rows and their mapping to and from table columns, written once for both
stores (gateway/accounts/store/sqlite_batch*.py and postgres_batch*.py): which columns a select
reads, the order an insert writes them in, JSON text for the dict columns, and a result row back
into a record.

Only the SQL differs between the stores (placeholders `?` vs `$n`, locking); the stores pass
`marks` for their placeholder style and otherwise share everything here.

Request states: pending → running → succeeded | failed; pending → cancelled (batch cancelled).
A running row whose lease lapsed counts as pending (its runner died). When the batch ends its
rows are deleted: the runner has written every line's outcome into the batch's files (what
never ran as `batch_expired` or `batch_cancelled`), and the counts stay on the batch's row.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.batch.models import BatchStatus, RequestCounts

FINISHED = ("succeeded", "failed")
#: the statuses `finish_batch` may write
FINAL_STATUSES = ("completed", "expired", "cancelled")


@dataclass(frozen=True)
class FileRow:
    id: str
    team_id: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    #: OpenAI's `expires_after`: past it the file is gone for the API and its team's storage
    expires_at: float | None = None


@dataclass(frozen=True)
class BatchRow:
    id: str
    team_id: str
    kind: str  # "openai" | "simple"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    priority: int
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None
    total: int
    output_file_id: str | None
    error_file_id: str | None
    created_at: float
    in_progress_at: float | None
    expires_at: float
    finalizing_at: float | None
    completed_at: float | None
    failed_at: float | None
    expired_at: float | None
    cancelling_at: float | None
    cancelled_at: float | None
    callback_url: str | None
    callback_state: str | None
    callback_attempts: int
    counts: RequestCounts


@dataclass(frozen=True)
class NewRequest:
    line: int
    custom_id: str
    #: the request's body, or its JSON text as the input file holds it (never decoded on the way)
    body: dict[str, Any] | str


@dataclass(frozen=True)
class Claimed:
    """A request this runner now holds a lease on."""

    batch_id: str
    custom_id: str
    line: int
    body: dict[str, Any]
    attempts: int  # including this one
    team_id: str
    endpoint: str
    #: the run's request id, the idempotency key of its usage record: kept on the row from the
    #: claim on, so a rerun after the runner died (its outcome never recorded) is billed under
    #: the same key, once; a recorded retry clears it and the next attempt gets a new one
    request_id: str = ""


@dataclass(frozen=True)
class ResultRow:
    custom_id: str
    line: int
    state: str
    status_code: int | None
    request_id: str | None
    response: dict[str, Any] | None
    error: dict[str, Any] | None


# -- columns ---------------------------------------------------------------------------------
BATCH_COLS = (
    "id, team_id, kind, endpoint, input_file_id, completion_window, status, priority, metadata, "
    "errors, total, output_file_id, error_file_id, created_at, in_progress_at, expires_at, "
    "finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at, "
    "callback_url, callback_state, callback_attempts, n_succeeded, n_failed"
)
FILE_COLS = "id, team_id, purpose, filename, bytes, created_at, expires_at"
#: a batch's request counts (by outcome) as the store keeps them on its row, and how an older
#: table without them gains them: counted once, from its lines, then the lines of the batches
#: that had ended dropped (as `finish_batch` now does; their results are in their files)
COUNT_COLS = ("n_succeeded", "n_failed")


def count_col(ok: bool) -> str:
    """The batch row's count a finished line adds to, by its outcome."""
    return COUNT_COLS[0] if ok else COUNT_COLS[1]


BACKFILL_COUNTS = (
    "UPDATE batches SET "
    "n_succeeded=(SELECT COUNT(*) FROM batch_requests r WHERE r.batch_id=batches.id "
    "AND r.state='succeeded'), "
    "n_failed=(SELECT COUNT(*) FROM batch_requests r WHERE r.batch_id=batches.id "
    "AND r.state='failed')"
)
DROP_ENDED_LINES = (
    "DELETE FROM batch_requests WHERE batch_id IN (SELECT id FROM batches WHERE status IN "
    "('completed', 'failed', 'expired', 'cancelled'))"
)
_BATCH_INSERT_COLS = (
    "id, team_id, kind, endpoint, input_file_id, completion_window, status, priority, "
    "metadata, errors, total, created_at, in_progress_at, expires_at, failed_at, callback_url"
)
#: the columns of a claimed request, in `claimed`'s order (`r.` the request, `b.` its batch)
CLAIM_COLS = (
    "r.batch_id, r.custom_id, r.line, r.body, r.attempts, b.team_id, b.endpoint, r.request_id"
)
RESULT_COLS = "custom_id, line, state, status_code, request_id, response, error"
REQUEST_INSERT_COLS = ("batch_id", "custom_id", "line", "body")

#: a store's placeholders: n → "?,?,?" (SQLite) or "$1,$2,$3" (PostgreSQL)
Marks = Callable[[int], str]


def insert_batch_sql(marks: Marks) -> str:
    return f"INSERT INTO batches ({_BATCH_INSERT_COLS}) VALUES ({marks(16)})"


def insert_file_sql(marks: Marks) -> str:
    return f"INSERT INTO batch_files ({FILE_COLS}) VALUES ({marks(7)})"


# -- values ----------------------------------------------------------------------------------
def dumps(x: Any) -> str | None:
    return None if x is None else json.dumps(x)


def text_bytes(*texts: str | None) -> int:
    """The bytes the texts take in the store (None: none)."""
    return sum(len(t.encode()) for t in texts if t is not None)


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def batch_values(row: BatchRow, total: int) -> tuple[Any, ...]:
    """A new batch's values in `insert_batch_sql`'s column order."""
    return (
        row.id,
        row.team_id,
        row.kind,
        row.endpoint,
        row.input_file_id,
        row.completion_window,
        row.status,
        row.priority,
        dumps(row.metadata),
        dumps(row.errors),
        total,
        row.created_at,
        row.in_progress_at,
        row.expires_at,
        row.failed_at,
        row.callback_url,
    )


def file_values(f: FileRow) -> tuple[Any, ...]:
    return (f.id, f.team_id, f.purpose, f.filename, f.bytes, f.created_at, f.expires_at)


class RequestValues:
    """A new batch's request rows in REQUEST_INSERT_COLS order, made as the store inserts them
    (the requests may be read from the input file meanwhile: none is held), counted on the way:
    `count` rows, `body_bytes` bytes of bodies."""

    def __init__(self, batch_id: str, requests: Iterable[NewRequest]) -> None:
        self.batch_id = batch_id
        self._requests = requests
        self.count = 0
        self.body_bytes = 0

    def __iter__(self) -> Iterator[tuple[str, str, int, str]]:
        for r in self._requests:
            body = r.body if isinstance(r.body, str) else json.dumps(r.body)
            self.count += 1
            self.body_bytes += len(body.encode())
            yield (self.batch_id, r.custom_id, r.line, body)


def callback_starts_at_creation(row: BatchRow) -> bool:
    """A batch that failed validation has nothing to run: its callback is due at once."""
    return bool(row.callback_url) and row.status == "failed"


def check_final(status: str) -> None:
    if status not in FINAL_STATUSES:
        raise ValueError(f"not a final status: {status}")


def callback_state(delivered: bool, next_at: float | None) -> str:
    return "delivered" if delivered else ("pending" if next_at is not None else "failed")


# -- rows back into records ------------------------------------------------------------------
def batch_row(r: Sequence[Any]) -> BatchRow:
    """A BATCH_COLS row (its request counts are columns of it, kept by `finish_request`: a
    listing never counts a batch's lines)."""
    rc = RequestCounts(total=r[10], completed=r[25], failed=r[26])
    return BatchRow(
        id=r[0],
        team_id=r[1],
        kind=r[2],
        endpoint=r[3],
        input_file_id=r[4],
        completion_window=r[5],
        status=r[6],
        priority=r[7],
        metadata=loads(r[8]),
        errors=loads(r[9]),
        total=r[10],
        output_file_id=r[11],
        error_file_id=r[12],
        created_at=r[13],
        in_progress_at=r[14],
        expires_at=r[15],
        finalizing_at=r[16],
        completed_at=r[17],
        failed_at=r[18],
        expired_at=r[19],
        cancelling_at=r[20],
        cancelled_at=r[21],
        callback_url=r[22],
        callback_state=r[23],
        callback_attempts=r[24],
        counts=rc,
    )


def claimed(r: Sequence[Any], attempts: int, request_id: str | None = None) -> Claimed:
    """A CLAIM_COLS row; `attempts` counts this claim (the stores read it before or after
    their update); `request_id`: the one the claim wrote when the row had none."""
    return Claimed(
        batch_id=r[0],
        custom_id=r[1],
        line=r[2],
        body=json.loads(r[3]),
        attempts=attempts,
        team_id=r[5],
        endpoint=r[6],
        request_id=r[7] or request_id or "",
    )


def new_request_id() -> str:
    return f"batch-{uuid.uuid4().hex}"


def result_row(r: Sequence[Any]) -> ResultRow:
    """A RESULT_COLS row."""
    return ResultRow(r[0], r[1], r[2], r[3], r[4], loads(r[5]), loads(r[6]))
