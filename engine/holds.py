"""The hold ledger: which finished prefills still hold their KV blocks for a decode node, readable
and claimable from the event loop without waiting for the engine thread's current step.

Why: a decode node's pull is confirmed by `/kv/release` (a 200 proves the blocks were still held,
so the bytes it read were not stale). If the release had to wait for the engine thread, it would
wait for P's current forward pass — hundreds of milliseconds under prefill load, seconds on a
loaded machine — and D's time to first token would carry it. The ledger answers at once.

Invariants (one lock guards every entry):
- an entry exists from the moment the engine holds the blocks until it is claimed, expires or
  is dropped — whichever comes first wins; the others find nothing;
- `claim` refuses a hold whose deadline has passed (the engine may be freeing it right now), so
  a successful claim always means the blocks were intact when the reader finished;
- a claimed hold is never freed by expiry: its blocks are freed by the release command the
  claimer queues for the engine thread (the scheduler's `held` entry stays until then).
"""

from __future__ import annotations

import enum
import threading


class Claim(enum.Enum):
    OK = "ok"
    NOT_HELD = "not_held"  # never held, released, expired or aborted
    NOT_THEIRS = "not_theirs"  # the block ids given are not this request's


class HoldLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: dict[str, tuple[list[int], float | None]] = {}

    def add(self, request_id: str, block_ids: list[int], expiry: float | None) -> None:
        with self._lock:
            self._holds[request_id] = (list(block_ids), expiry)

    def claim(self, request_id: str, block_ids: list[int] | None, now: float) -> tuple[Claim, int]:
        """Take the hold for a release (any thread). Returns (outcome, number of blocks)."""
        with self._lock:
            entry = self._holds.get(request_id)
            if entry is None:
                return Claim.NOT_HELD, 0
            blocks, expiry = entry
            if expiry is not None and expiry <= now:
                return Claim.NOT_HELD, 0
            if block_ids is not None and list(block_ids) != blocks:
                return Claim.NOT_THEIRS, 0
            del self._holds[request_id]
            return Claim.OK, len(blocks)

    def expire(self, request_id: str) -> bool:
        """Engine thread, deadline passed: True if the hold was still unclaimed (free it now)."""
        with self._lock:
            return self._holds.pop(request_id, None) is not None

    def drop(self, request_id: str) -> None:
        """Engine thread: the hold ended another way (released, aborted)."""
        with self._lock:
            self._holds.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._holds
