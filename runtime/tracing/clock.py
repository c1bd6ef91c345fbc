"""Span times: spans carry unix nanoseconds, while the processes measure most steps on the
monotonic clock."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


@contextlib.contextmanager
def timed_ns() -> Iterator[list[int]]:
    """[start_ns, end_ns] of the block in unix ns (for `record`)."""
    out = [time.time_ns(), 0]
    try:
        yield out
    finally:
        out[1] = time.time_ns()


def mono_to_unix_ns(t_mono: float) -> int:
    """A time.monotonic() reading as unix ns (spans' clock), by today's offset."""
    return time.time_ns() - int((time.monotonic() - t_mono) * 1e9)
