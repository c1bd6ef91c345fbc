"""Backoff with jitter and Retry-After parsing."""

from __future__ import annotations

import random

from gateway.backends.providers.config import RetryConfig
from gateway.backends.providers.errors import ProviderError
from gateway.backends.providers.resilience import RetryPolicy, parse_retry_after


def test_parse_retry_after_forms() -> None:
    assert parse_retry_after({"retry-after": "3"}) == 3
    assert parse_retry_after({"retry-after": "1.5"}) == 1.5
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert (
        parse_retry_after(
            {"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT"}, now=lambda: 1445412480.0
        )
        == 10
    )
    assert (
        parse_retry_after(
            {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, now=lambda: 1445412490.0
        )
        == 0
    )
    assert parse_retry_after({"retry-after": "-4"}) == 0
    for junk in ("soon", "nan", "inf", ""):
        assert parse_retry_after({"retry-after": junk}) is None
    assert parse_retry_after({}) is None


def test_backoff_grows_caps_and_jitters() -> None:
    p = RetryPolicy(
        RetryConfig(base_delay_s=1, multiplier=2, max_delay_s=5, jitter=0.2, max_attempts=10),
        random.Random(1),
    )
    seen = [p.backoff(n) for n in range(1, 7)]
    for d, base in zip(seen, (1, 2, 4, 5, 5, 5), strict=True):
        assert 0.8 * base <= d <= 1.2 * base
    assert len({round(d, 6) for d in seen[3:]}) == 3  # jitter spreads equal bases


def test_delay_rules() -> None:
    p = RetryPolicy(RetryConfig(max_attempts=3, base_delay_s=0.1, jitter=0, max_retry_after_s=10))
    assert p.delay(1, ProviderError(503, "x", retryable=True)) == 0.1
    assert p.delay(1, ProviderError(429, "x", retryable=True, retry_after=4)) == 4
    assert p.delay(1, ProviderError(429, "x", retryable=True, retry_after=11)) is None
    assert p.delay(3, ProviderError(503, "x", retryable=True)) is None
    assert p.delay(1, ProviderError(400, "x")) is None
