"""A reply's pieces read ahead of a slow client, so the node's work and its admission slot end
when the node has finished, not when the client has read it all.

A client that reads a byte now and then held its tier admission slot for as long as it took to
read its answer: slots are few (`[tiers] max_inflight`), so a few such clients locked every
other team out. `ReadAhead` reads the reply in a task of its own into a buffer bounded in bytes
(`max_bytes`, `[tiers] stream_read_ahead_bytes`: past it the reading waits, as it did before, and
the write deadline of the sink ends a client that makes no progress); when the reply ends, `ended`
is called at once (the slot is given back) while the writer still drains the buffer at the client's
pace. The relay starts one only when a write could wait for its client (the transport's buffer
near its high-water mark): a client that keeps up is written straight from the reply, with no
task and no hand-off per piece.

Invariants: pieces come out in the order the reply gave them; a reply's failure is raised to
the writer after the pieces before it, as the reply raised it; `stop` ends the reading task
before anyone closes the reply (an async generator cannot be closed while it runs).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterable, Callable

from gateway.backends.base import Piece

#: about the bytes a piece holds besides its text (its fields, a token id, a logprob entry)
_PIECE, _ID, _LOGPROB = 64, 8, 48


def _size(p: Piece) -> int:
    """About the memory `p` holds (what the bound counts)."""
    n = len(p.text) + _PIECE + _ID * len(p.token_ids)
    if (lp := p.logprobs) is not None:
        n += _LOGPROB * (len(lp.tokens) + sum(len(t) for t in lp.top_logprobs if t))
    return n


class ReadAhead:
    """`reply`'s pieces, read ahead up to `max_bytes`; `ended()` once the reply has ended
    without a failure."""

    def __init__(
        self,
        reply: AsyncIterable[Piece],
        ended: Callable[[], None],
        max_bytes: int,
    ) -> None:
        self._reply, self._ended, self._max = reply, ended, max_bytes
        self._held: deque[Piece] = deque()
        self._bytes = 0
        self._done = False
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for p in self._reply:
                self._held.append(p)
                self._bytes += _size(p)
                self._ready.set()
                while self._bytes > self._max:
                    self._room.clear()
                    await self._room.wait()
        except Exception as e:  # the writer raises it, after the pieces before it
            self._error = e
        else:
            self._ended()
        finally:
            self._done = True
            self._ready.set()

    def __aiter__(self) -> ReadAhead:
        return self

    async def __anext__(self) -> Piece:
        while not self._held:
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        p = self._held.popleft()
        self._bytes -= _size(p)
        if self._bytes <= self._max:
            self._room.set()
        return p

    async def stop(self) -> None:
        """End the reading (the reply can be closed after)."""
        if not self._task.done():
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
