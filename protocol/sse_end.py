"""Reading what is left of an SSE response after its `[DONE]`, so its connection can be kept.

A chunked body ends with a zero-length chunk that may arrive in a later read than `[DONE]`
(vLLM's server sends it as a message of its own). A client that releases the response before
that end makes aiohttp close the connection, and its next request pays a new one on the way
to its first token. The gateway's node client (off the request's path) and the bench's
clients both read to the end with `read_to_end` first.

Invariant: bounded by `timeout_s`; whatever arrives after `[DONE]` is dropped, never parsed.
"""

from __future__ import annotations

import asyncio

import aiohttp


async def read_to_end(resp: aiohttp.ClientResponse, timeout_s: float) -> bool:
    """True once the body has ended (the connection may go back to the pool); False when it did
    not end within `timeout_s` or the connection broke (it must be closed)."""
    try:
        async with asyncio.timeout(timeout_s):
            while await resp.content.readany():
                pass  # nothing is expected after [DONE]
    except (TimeoutError, aiohttp.ClientError, ConnectionError):
        return False
    return True
