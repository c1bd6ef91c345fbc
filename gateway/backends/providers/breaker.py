"""Circuit breaker per provider: closed → open → half-open → closed.

- closed: calls go through; `failure_threshold` consecutive failures open the breaker.
- open: calls are refused without contacting the provider until `cooldown_s` has passed.
- half-open: up to `half_open_max_calls` probes go through at once; `success_threshold`
  successes close the breaker, one failure re-opens it (for another full cool-down).

Every admitted call must end in exactly one of `record_success`, `record_failure` or
`record_neutral` (a call abandoned by its client, or failed through the request's own fault):
that is what frees a half-open probe slot. The state is computed on read from an injectable
monotonic clock, so open → half-open needs no timer and tests need no sleeps.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from gateway.backends.providers.config import BreakerConfig


class BreakerState(enum.IntEnum):
    """Values are the gauge's: higher is worse."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._probes = 0
        #: how many times the breaker opened (for logs and tests)
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        if (
            self._state is BreakerState.OPEN
            and self._clock() - self._opened_at >= self.config.cooldown_s
        ):
            self._state = BreakerState.HALF_OPEN
            self._successes = 0
            self._probes = 0
        return self._state

    def retry_after(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when not open)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self.config.cooldown_s - (self._clock() - self._opened_at))

    def allow(self) -> bool:
        """Admit one call (and, in half-open, take a probe slot) or refuse it."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and self._probes < self.config.half_open_max_calls:
            self._probes += 1
            return True
        return False

    def record_success(self) -> None:
        if self._state is BreakerState.HALF_OPEN:
            self._probes = max(0, self._probes - 1)
            self._successes += 1
            if self._successes >= self.config.success_threshold:
                self._close()
        else:
            self._failures = 0

    def record_failure(self) -> None:
        if self._state is BreakerState.HALF_OPEN:
            self._open()
            return
        if self._state is BreakerState.CLOSED:
            self._failures += 1
            if self._failures >= self.config.failure_threshold:
                self._open()

    def record_neutral(self) -> None:
        if self._state is BreakerState.HALF_OPEN:
            self._probes = max(0, self._probes - 1)

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._failures = 0
        self._probes = 0
        self.times_opened += 1

    def _close(self) -> None:
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._successes = 0
        self._probes = 0
