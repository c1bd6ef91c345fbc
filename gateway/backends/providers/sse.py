"""Server-sent events read from an aiohttp response, with the first-byte and idle timeouts.

Yields `(event, data)` per event (`event` is None when the provider sends only `data:` lines,
as OpenAI does). The first event must arrive before `first_deadline` (an event-loop time), each
later read within `idle_s`; a line longer than `max_line` bytes is refused, so a misbehaving
upstream cannot grow our memory without bound. Timeouts raise `TimeoutError`; connection
errors propagate as aiohttp raises them; the caller classifies both.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp

from gateway.backends.providers.errors import ProviderError

MAX_LINE = 8 << 20


async def sse_events(
    content: aiohttp.StreamReader, first_deadline: float, idle_s: float, max_line: int = MAX_LINE
) -> AsyncIterator[tuple[str | None, str]]:
    loop = asyncio.get_running_loop()
    buf = b""
    event: str | None = None
    data: list[str] = []
    seen_event = False
    while True:
        timeout = idle_s if seen_event else max(0.0, first_deadline - loop.time())
        async with asyncio.timeout(timeout):
            piece = await content.readany()
        if not piece:
            return  # EOF; a partial event without its blank line is dropped, as the spec says
        buf += piece
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > max_line:
                    raise ProviderError(
                        502,
                        f"an SSE line longer than {max_line} bytes",
                        retryable=True,
                        kind="invalid_response",
                    )
                break
            line = buf[:nl].rstrip(b"\r").decode("utf-8", errors="replace")
            buf = buf[nl + 1 :]
            if not line:
                if data or event is not None:
                    seen_event = True
                    yield event, "\n".join(data)
                event, data = None, []
                continue
            if line.startswith(":"):
                continue  # comment / keep-alive
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
