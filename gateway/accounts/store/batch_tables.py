"""The batch tier's tables behind the one store: files, batches and, while a batch has not
ended, one row per request (its claim and, once finished, its result; `finish_batch` deletes
them once the results are in the batch's files, so the table holds open batches' lines only).
`BatchTables` is their interface; the SQLite and the PostgreSQL store implement it beside the
accounts' tables (base.py `Store`), and the rows and their mapping to columns are
gateway/batch/rows.py's, shared by both.

Invariants:
- (batch_id, custom_id) is the primary key of `batch_requests`: one row, hence at most one
  result and one output line, per custom_id.
- A request runs only while claimed: `state='running'`, `claimed_by` = the runner, and
  `lease_until` in the future. A result is written only by the runner that holds the claim
  (`finish_request` checks it in the same statement), so a runner whose lease was taken over
  cannot write a second result.
- Every state change is one transaction that takes the write lock before it reads (SQLite's
  `BEGIN IMMEDIATE`, PostgreSQL's row locks): several gateway processes may share the
  database. A deferred `BEGIN` would let a second claim read while the first is between its
  read and its write; its write would then meet a stale snapshot and fail
  (`database is locked`) — tests/security/test_batch_store_immediate.py.
- Teams are isolated here, not in the handlers: every read a client can cause names its team.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from gateway.batch.rows import BatchRow, Claimed, FileRow, NewRequest, ResultRow

#: batch states that hold a team's open-batch allowance (`[batch] max_open_batches`)
OPEN = ("validating", "in_progress", "finalizing", "cancelling")


class Conflict(Exception):
    """The batch is in a state that does not allow the change."""


class TeamLimit(Exception):
    """A write would take the team past one of its batch-tier bounds (`[batch] max_team_bytes`,
    `max_open_batches`). Checked in the write's own transaction, under a lock on the team's
    writes (SQLite's write lock; a per-team advisory lock on PostgreSQL), so requests racing
    each other, on one gateway or several, cannot pass a bound together."""

    def __init__(self, kind: Literal["bytes", "open_batches"], held: int) -> None:
        super().__init__(f"{kind}: {held} held")
        self.kind = kind
        #: what the team held before this write (bytes stored, or batches not yet ended)
        self.held = held


class BatchTables(ABC):
    """What the batch routes and the runner need from storage: the batch tier's part of the one
    `Store` (base.py), also usable alone (sqlite_batch.py, postgres_batch.py). `now` is unix
    seconds (the caller's clock, so tests and several gateways agree on one source)."""

    @abstractmethod
    async def insert_file(self, row: FileRow, max_team_bytes: int | None = None) -> None:
        """Store a file's row; with `max_team_bytes`, raise TeamLimit (nothing written) if the
        team's live files would then hold more."""

    @abstractmethod
    async def get_file(self, team_id: str, file_id: str) -> FileRow | None: ...
    @abstractmethod
    async def list_files(
        self, team_id: str, purpose: str | None, after: str | None, limit: int
    ) -> tuple[list[FileRow], bool]: ...
    @abstractmethod
    async def delete_file(self, team_id: str, file_id: str) -> bool: ...
    @abstractmethod
    async def purge_expired_files(self, now: float, limit: int = 100) -> list[str]:
        """Mark up to `limit` files expired by `now` deleted and return their ids (their contents
        on disk are the caller's to remove): an expired file no longer counts in its team's
        storage, so its bytes must not stay on disk either."""

    @abstractmethod
    async def create_batch(
        self,
        row: BatchRow,
        requests: Iterable[NewRequest],
        max_open: int | None = None,
        max_team_bytes: int | None = None,
    ) -> None:
        """Write a batch and its requests (consumed once, as they are inserted: they may be
        read from the input file meanwhile); with `max_open`, raise TeamLimit (nothing written)
        if an open batch would make the team's open batches more than `max_open`; with
        `max_team_bytes`, if the requests' bodies would take the team's storage past it (the
        bodies count until the batch ends, when `finish_batch` deletes them)."""

    @abstractmethod
    async def get_batch(self, team_id: str | None, batch_id: str) -> BatchRow | None: ...
    @abstractmethod
    async def list_batches(
        self, team_id: str, after: str | None, limit: int
    ) -> tuple[list[BatchRow], bool]: ...
    @abstractmethod
    async def cancel_batch(self, team_id: str, batch_id: str, now: float) -> BatchRow | None: ...
    @abstractmethod
    async def release_claims(self, worker: str) -> int: ...
    @abstractmethod
    async def claim_requests(
        self, worker: str, n: int, lease_s: float, now: float
    ) -> list[Claimed]: ...
    @abstractmethod
    async def renew_leases(
        self, worker: str, keys: Sequence[tuple[str, str]], until: float
    ) -> None: ...
    @abstractmethod
    async def finish_request(
        self,
        worker: str,
        batch_id: str,
        custom_id: str,
        *,
        ok: bool,
        status_code: int | None,
        request_id: str | None,
        response: dict[str, Any] | None,
        error: dict[str, Any] | None,
        now: float,
    ) -> bool: ...
    @abstractmethod
    async def retry_request(
        self,
        worker: str,
        batch_id: str,
        custom_id: str,
        not_before: float,
        error: dict[str, Any],
        *,
        spent: bool = True,
    ) -> bool:
        """Back to pending until `not_before`, keeping the line's request id (its usage key:
        the retry's record replaces the failed run's); `spent=False` gives the claim's attempt
        back (the request never ran: a quota window or load shedding deferred it)."""

    @abstractmethod
    async def claim_finalizable(self, worker: str, lease_s: float, now: float) -> list[str]: ...
    @abstractmethod
    async def results(self, batch_id: str) -> list[ResultRow]: ...
    @abstractmethod
    async def finish_batch(
        self,
        worker: str,
        batch_id: str,
        status: str,
        files: Sequence[FileRow],
        output_file_id: str | None,
        error_file_id: str | None,
        now: float,
    ) -> bool:
        """End the batch held by `worker` with `status`, its `files` (the output and error
        files, every line's outcome) stored, and its request rows deleted; False (nothing
        written) when `worker` no longer holds it."""

    @abstractmethod
    async def claim_callbacks(self, worker: str, lease_s: float, now: float) -> list[BatchRow]: ...
    @abstractmethod
    async def callback_result(
        self,
        worker: str,
        batch_id: str,
        *,
        delivered: bool,
        next_at: float | None,
        error: str | None,
    ) -> None: ...
    @abstractmethod
    async def mean_request_seconds(self, since: float) -> float | None: ...
    @abstractmethod
    async def pending_requests(self) -> int:
        """The lines of running batches without an outcome yet, from the batches' own counts
        (no line is read)."""

    @abstractmethod
    async def team_holdings(self, team_id: str) -> tuple[int, int]:
        """(bytes of the team's stored files and of the request bodies and results its batches
        hold, its batches not yet ended): its per-team limits."""
        ...
