"""Server-sent events as every duet process speaks them (OpenAI's stream shape).

Writing: `sse(obj)` is one `data: <json>` event, `named_sse(event)` one with an `event:` line
naming it (the Anthropic and Responses streams), `DONE` the last one, `error_event(err)` the
event a stream carries when it fails after its headers went out (OpenAI's error body; `[DONE]`
follows it). Reading: `DataLines` cuts a stream of `data:` events into payloads as network
reads arrive (no read per line), and `read_to_end` reads what is left of a body after its
`[DONE]`, so the connection can be kept.

Invariants: a `DataLines` line that grows past `max_line` bytes without ending is refused
(ValueError): a broken peer cannot grow the reader's memory without bound; `read_to_end` is
bounded by its timeout, and whatever arrives after `[DONE]` is dropped, never parsed.
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
from aiohttp import web

from protocol.openai import APIError

_ENC = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
#: an SSE line longer than this is a broken stream
MAX_LINE = 16 * 2**20


def sse(obj: object) -> bytes:
    """One event: `data: <obj as JSON>` and the blank line that ends it."""
    return b"data: " + _ENC.encode(obj) + b"\n\n"


def named_sse(event: msgspec.Struct) -> bytes:
    """One named event, as Anthropic's and OpenAI's Responses streams send them: `event: <the
    struct's tag>` and `data: <json>` (the JSON carries the same name as its `type`)."""
    name = type(event).__struct_config__.tag
    return b"event: " + str(name).encode() + b"\ndata: " + _ENC.encode(event) + b"\n\n"


def error_event(err: APIError) -> bytes:
    """The event of a stream that failed after its headers went out (then `[DONE]`): an event
    carrying only `error`, OpenAI's error object."""
    return sse(err.body())


async def end_stream(resp: web.StreamResponse, last: bytes = b"") -> None:
    """`last` (if any), `[DONE]` and the body's end in one send. A client that stops reading at
    `[DONE]` (the gateway, the openai SDK) then finds the body ended and keeps the connection for
    its next request; with `[DONE]` and the end in two sends it often finds the body unfinished
    and must close the connection."""
    await resp.write_eof(last + DONE)


class DataLines:
    """The payloads of `data:` lines, fed one network read at a time. Everything that arrived in
    one read comes back in one list, which is how a relay knows a chunk's successor is already
    here. (Providers' full SSE — `event:` fields, comments — is
    gateway/backends/providers/sse.py.)"""

    def __init__(self, max_line: int | None = None) -> None:
        self.max_line = MAX_LINE if max_line is None else max_line
        self._rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        lines = (self._rest + data).split(b"\n") if self._rest else data.split(b"\n")
        self._rest = lines.pop()
        if len(self._rest) > self.max_line:
            raise ValueError(f"an SSE line over {self.max_line} bytes")
        return [ln[6:].strip() for ln in lines if ln.startswith(b"data: ")]


async def read_to_end(resp: aiohttp.ClientResponse, timeout_s: float) -> bool:
    """Read what is left of a response after its `[DONE]`. A chunked body ends with a
    zero-length chunk that may arrive in a later read than `[DONE]` (vLLM's server sends it as a
    message of its own); a client that releases the response before that end makes aiohttp
    close the connection, and its next request pays a new one on the way to its first token.

    True once the body has ended (the connection may go back to the pool); False when it did not
    end within `timeout_s` or the connection broke (it must be closed)."""
    try:
        async with asyncio.timeout(timeout_s):
            while await resp.content.readany():
                pass  # nothing is expected after [DONE]
    except (TimeoutError, aiohttp.ClientError, ConnectionError):
        return False
    return True
