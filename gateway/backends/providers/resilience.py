"""Retry policy: exponential backoff with jitter, honouring the provider's Retry-After.

Only errors marked `retryable` are retried (429, 5xx, connect errors, timeouts), and only while
nothing has reached the caller: `Provider.chat_stream` stops retrying once it has yielded a
chunk, so a retry can never duplicate streamed tokens. The delay before attempt n+1 is
`min(max_delay, base × multiplier^(n-1))` scaled by a random factor in [1-jitter, 1+jitter],
and never shorter than the provider's Retry-After; a Retry-After longer than
`max_retry_after_s` ends the retries at once (the caller may fall back instead of waiting).
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Callable, Mapping

from gateway.backends.providers.config import RetryConfig
from gateway.backends.providers.errors import ProviderError


def parse_retry_after(
    headers: Mapping[str, str], now: Callable[[], float] = time.time
) -> float | None:
    """Seconds to wait from `retry-after-ms` (OpenAI), or `Retry-After` as seconds or an
    HTTP-date; None when absent or unreadable. Never negative."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            v = float(ms) / 1000
            if v == v and v >= 0:  # not NaN
                return v
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        v = float(raw)
        return max(0.0, v) if v == v and v != float("inf") else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - now())


class RetryPolicy:
    def __init__(self, config: RetryConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self._rng = rng or random.Random()

    def backoff(self, attempt: int) -> float:
        """Delay after failed attempt number `attempt` (1-based), before Retry-After."""
        c = self.config
        base = min(c.max_delay_s, c.base_delay_s * c.multiplier ** (attempt - 1))
        return base * (1 + self._rng.uniform(-c.jitter, c.jitter))

    def delay(self, attempt: int, error: ProviderError) -> float | None:
        """Seconds to wait before the next attempt, or None when the error must be raised."""
        if not error.retryable or attempt >= self.config.max_attempts:
            return None
        ra = error.retry_after
        if ra is not None and ra > self.config.max_retry_after_s:
            return None
        return max(self.backoff(attempt), ra or 0.0)
