"""What the gateway provides to the batch tier: an executor that runs one request through the
gateway's normal path, and a way to know the caller's team. Kept apart so every module (and
the gateway) imports them without pulling in the rest of the package."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

#: statuses (and any exception) after which a request is tried again, later: the node or the
#: cluster was busy or lost, not the request wrong
RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class Executor(Protocol):
    """Runs one request the way an interactive one runs (quotas, accounting at the batch price,
    routing at batch priority) and returns (HTTP status, JSON response body). Raising means the
    request could not be run (e.g. no node reachable) and is retried like a 503."""

    async def __call__(
        self,
        team_id: str,
        endpoint: str,
        body: dict[str, Any],
        *,
        tier: str = "batch",
        request_id: str,
    ) -> tuple[int, dict[str, Any]]: ...


class Defer(Exception):
    """Raised by an executor when a request was not run at all — its team's rate window is
    full, or the gateway shed it for interactive load — and should be tried again after
    `after_s` seconds without spending one of its `max_attempts`."""

    def __init__(self, after_s: float, reason: str) -> None:
        super().__init__(reason)
        self.after_s = after_s
        self.reason = reason


def is_final(status: int, body: dict[str, Any]) -> bool:
    """A retryable status whose answer is final anyway: 429 `insufficient_quota` (a spent
    budget; OpenAI's clients do not retry it either). Such a line fails at once rather than
    burning its retries — the rest of its batch fails fast too, and the batch completes."""
    err = body.get("error") if isinstance(body, dict) else None
    return status == 429 and isinstance(err, dict) and err.get("type") == "insufficient_quota"


#: the caller's team id for a request, or raise `protocol.openai.APIError(401, ...)`
Authenticate = Callable[[web.Request], "str | Awaitable[str]"]

#: True while batch work may start; the gateway answers False while interactive queues wait
MayRun = Callable[[], bool]
