"""Settings of the batch tier: limits, windows, runner concurrency and leases, retries, and
who may receive callbacks. One frozen value built at start-up; nothing here does I/O.

Defaults follow OpenAI's Batch API (50,000 requests and 200 MB per file, a 24 h window) and
are safe for production: callbacks to loopback or private addresses are refused unless an
operator allows them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config_tables import BatchLimits

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def default_worker_id() -> str:
    # Host + pid: unique among live processes, so one gateway's claims never look like another's.
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True, kw_only=True)
class BatchConfig(BatchLimits):
    """The runner's and the routes' settings: `[batch]`'s bounds (`BatchLimits`) and what the
    gateway works out for them (where the files live, the models and priorities allowed)."""

    data_dir: Path  # input/output file contents live under data_dir/files
    #: the highest batch priority (models.PRIORITIES value) a team may ask for: per team, else
    #: the default (a team right, not the client's choice)
    max_priority: int = 1
    max_priorities: dict[str, int] = field(default_factory=dict)
    endpoints: tuple[str, ...] = ENDPOINTS
    #: model names a batch line may ask for; None accepts any (the executor then refuses)
    models: frozenset[str] | None = None
    #: seconds each accepted `completion_window` value grants
    completion_windows: dict[str, float] = field(default_factory=lambda: {"24h": 86_400.0})
    retry_max_s: float = 60.0
    callback_timeout_s: float = 10.0
    callback_max_attempts: int = 8
    callback_retry_base_s: float = 2.0
    callback_retry_max_s: float = 300.0
    #: a guess used for `estimated_completion` before any request of the tier has finished
    default_request_s: float = 2.0
    worker_id: str = field(default_factory=default_worker_id)

    def max_priority_for(self, team_id: str) -> int:
        return self.max_priorities.get(team_id, self.max_priority)

    def callback_secret_for(self, team_id: str) -> str | None:
        return self.callback_secrets.get(team_id, self.callback_secret)

    @property
    def files_dir(self) -> Path:
        return Path(self.data_dir) / "files"

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt + 1` of a request (attempt counts from 1)."""
        return min(self.retry_max_s, self.retry_base_s * 2 ** max(attempt - 1, 0))

    def callback_backoff(self, attempt: int) -> float:
        return min(self.callback_retry_max_s, self.callback_retry_base_s * 2 ** max(attempt - 1, 0))
