"""Waiting in tests: on a condition with a deadline, never on a clock.

A test lets something happen by polling the condition that says it happened; the sleeps here
only pace the polling. Both helpers fail with an AssertionError that names `what` once
`timeout` seconds have passed, and return the condition's first truthy value.

- `until(cond, timeout, what)` in async tests; `cond` is a function or a coroutine function;
- `wait_for(cond, timeout, what)` in synchronous code.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

#: how often a condition is polled (seconds)
POLL_S = 0.02


async def until(
    cond: Callable[[], Any | Awaitable[Any]], timeout: float = 30.0, what: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(POLL_S)


def wait_for(cond: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(POLL_S)
