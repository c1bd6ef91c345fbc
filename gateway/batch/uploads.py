"""How many uploads and batch creations run at once: each reads and checks a whole file (up to
`[batch] max_file_bytes`), on a thread, then writes it to disk or the store. A team may run
`max_team_uploads` of them at once and the gateway `max_uploads`; one more is refused at once
with 429 `too_many_uploads` (OpenAI's error shape), never queued, so a flood of uploads holds
neither memory nor threads while it waits.

Invariant: a slot is held from before the request's body is read to its answer, and always
given back (a context manager); the counts live on the event loop, so no lock is needed.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from gateway.batch.config import BatchConfig
from protocol.openai import APIError


class UploadSlots:
    """The gateway's uploads and batch creations in progress, in all and per team."""

    def __init__(self, config: BatchConfig) -> None:
        self.total = config.max_uploads
        self.per_team = config.max_team_uploads
        self._held: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, team_id: str) -> Iterator[None]:
        """A slot for one upload or batch creation of `team_id`, or APIError 429."""
        if self._held[team_id] >= self.per_team:
            raise _busy(
                f"team {team_id!r} already has {self._held[team_id]} uploads or batch creations "
                f"in progress (limit {self.per_team}); retry when one has finished"
            )
        if sum(self._held.values()) >= self.total:
            raise _busy(
                f"the gateway has {self.total} uploads or batch creations in progress; retry "
                "shortly"
            )
        self._held[team_id] += 1
        try:
            yield
        finally:
            self._held[team_id] -= 1
            if not self._held[team_id]:
                del self._held[team_id]


def _busy(message: str) -> APIError:
    return APIError(429, message, type_="rate_limit_error", code="too_many_uploads")
