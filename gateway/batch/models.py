"""Wire shapes of the batch tier: OpenAI's File, Batch and list objects, one input and one
output line of a batch file, and the seed's simple `/v1/batch` form.

Field names and meanings are OpenAI's, so the official SDK parses every response; fields OpenAI
marks nullable are always present (None), never omitted.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
#: statuses after which nothing about the batch changes (except its callback delivery)
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
FilePurpose = Literal["batch", "batch_output"]


class FileObject(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class RequestCounts(msgspec.Struct, frozen=True, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[BatchError]


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


class ListPage(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[Any]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class CreateBatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    #: accepted as OpenAI's SDK may send it; output files here live until deleted
    output_expires_after: dict[str, Any] | None = None


class InputLine(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class OutputResponse(msgspec.Struct, frozen=True, kw_only=True):
    status_code: int
    request_id: str
    body: dict[str, Any]


class OutputError(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    message: str


class OutputLine(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    custom_id: str
    response: OutputResponse | None
    error: OutputError | None


class SimpleRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request of the simple form: an OpenAI body, with the endpoint and id optional."""

    body: dict[str, Any]
    custom_id: str | None = None
    url: str | None = None


class SimpleBatchCreate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    requests: list[Any]  # checked one by one, so errors name their line
    callback_url: str | None = None
    priority: Literal["low", "normal", "high"] = "normal"
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class SimpleBatchCreated(msgspec.Struct, frozen=True, kw_only=True):
    batch_id: str
    status: str
    estimated_completion: int  # unix seconds


class SimpleBatchStatus(msgspec.Struct, frozen=True, kw_only=True):
    batch_id: str
    status: str
    created_at: int
    estimated_completion: int | None
    request_counts: RequestCounts
    output_file_id: str | None
    error_file_id: str | None
    errors: BatchErrors | None = None
    #: once the batch has ended, a page of its output lines (gateway/batch/results_page.py):
    #: the output file's, then the error file's, each in input order
    results: list[msgspec.Raw] | None = None
    #: `after` for the next page of results; None on the last
    next_after: str | None = None


class CallbackPayload(msgspec.Struct, frozen=True, kw_only=True):
    type: str  # "batch.completed" | "batch.failed" | "batch.expired" | "batch.cancelled"
    batch_id: str
    status: str
    request_counts: RequestCounts
    output_file_id: str | None
    error_file_id: str | None
    metadata: dict[str, str] | None = None


PRIORITIES = {"low": 0, "normal": 1, "high": 2}
