"""A request's wall-time cap (`[server] request_timeout_s`): the deadline its answer's relay
(relay.py) must finish reading and writing by, counted from the request's arrival.

Write deadlines and reading ahead bound a client that stops reading; this bounds one that
reads a byte now and then, or a node that makes a token now and then: past the deadline the
relay stops, the reply is closed (the nodes' work aborted), the tier slot and the team's
concurrency are given back, and the request is billed once as `request_timeout` — its prompt
and the completion tokens the gateway had read for it, as for a client that leaves (the work
was done at its request; a client that reads slowly must not get what it made free). The batch
runner's lines are not capped (ledger.Caller.capped): the runner reads them as they come.
"""

from __future__ import annotations

import asyncio
import time

from protocol.openai import APIError

#: the answer's error code past the cap (a stream's error event, a whole answer's 504)
CODE = "request_timeout"


def deadline(t0: float, cap_s: float) -> float | None:
    """The monotonic time by which a request that arrived at `t0` must be answered (None: the
    cap is off, `cap_s` 0)."""
    return t0 + cap_s if cap_s > 0 else None


def timer(at: float | None) -> asyncio.Timeout:
    """An `asyncio.timeout` that expires at monotonic time `at` (None: never). Its `expired()`
    tells the cap's TimeoutError from another one raised inside."""
    if at is None:
        return asyncio.timeout(None)
    return asyncio.timeout(max(0.0, at - time.monotonic()))


def timed_out(cap_s: float) -> APIError:
    """The answer of a request past the cap: a 504 (an error event once its stream is open)."""
    return APIError(
        504,
        f"the request ran past the gateway's cap on a request's time ({cap_s:g} s, "
        "[server] request_timeout_s); what was made for it so far is billed",
        type_="timeout_error",
        code=CODE,
    )
