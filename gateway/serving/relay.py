"""Relaying a backend's `Reply` to the client: as SSE into an `EventSink`, or as one JSON body.

Invariants (both forms):
- the usage record is committed (the ledger's `commit`) before the answer's finishing chunks
  (those carrying a `finish_reason`), the usage chunk and `[DONE]` go out — or before the JSON
  body is returned — so a response a client saw whole always has its record;
- a reply that breaks after its first piece (`MidStreamError`) is committed as
  `error_midstream`: a stream ends with an SSE error event and `[DONE]`, a whole answer is a
  502 (or the 4xx of a failure that is the request's own: a batch line is not run again); it
  bills the completion tokens of the pieces written to the client (`Piece.tokens`, counted in
  the relay's own `SentLog` as each write goes out), never tokens made but not
  delivered: those of a piece still held back (a finishing chunk of n > 1, a delta that showed
  no text yet) or of a whole answer (its client gets none of them). A reply that breaks before
  any piece went out is a plain HTTP error, as one that fails before its first piece;
- the reply is closed on every way out (`aclose` now, not at GC: the backend aborts its work on
  the nodes there);
- a request past its wall-time cap (wall_clock.py) stops being relayed: it is committed as
  `request_timeout` with what was read for it, its reply closed, and a stream ends with a
  `request_timeout` error event and `[DONE]` (a whole answer, or a stream that sent nothing
  yet, is a 504); the stream's node slot is given back before that last write.

Chunks whose successor has already arrived (`Piece.more`) are written together, and the SSE
headers leave with the first chunk: the client wakes once for its first token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from aiohttp import web

from gateway.accounts.ledger import Ledger, UsageStatus
from gateway.accounts.usage import SentLog
from gateway.backends.base import MidStreamError, Piece, Reply
from gateway.serving.openai_format import Formatter, usage
from gateway.serving.read_ahead import ReadAhead
from gateway.serving.wall_clock import deadline, timed_out, timer
from protocol.openai import APIError, CompletionLogprobs, Usage
from protocol.sse import DONE, SSE_HEADERS, error_event
from protocol.tools import ToolCallDelta

log = logging.getLogger("duet.gateway")


class EventSink(Protocol):
    """Where a streamed answer goes: opened with its headers at the first chunk, then written,
    then ended with the last bytes in the same send."""

    @property
    def opened(self) -> bool: ...

    def could_wait(self, n: int) -> bool:
        """Whether writing `n` more bytes could wait for the client (its buffer nearly full)."""
        ...

    async def open(self, headers: dict[str, str]) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self, data: bytes) -> None: ...


class _EventStream(web.StreamResponse):
    """An SSE response whose headers leave with its first chunk, in one send (aiohttp's
    StreamResponse sends them at `prepare()`, a send of their own). It is prepared only when
    the first chunk is in hand, so holding the headers delays nothing; the client wakes once
    for its first token instead of twice. (`web.Response` sets the same class attribute.)"""

    _send_headers_immediately = False


#: the app's write deadline in seconds (`[server] write_timeout_s`; 0: none)
WRITE_TIMEOUT = web.AppKey("write_timeout_s", float)
#: the deadline of an app that sets none
WRITE_TIMEOUT_S = 60.0
#: bytes a send adds besides its data (the headers with the first chunk, chunked framing)
_SLACK = 16 * 1024


class HttpEventStream:
    """The `EventSink` of an HTTP request: an SSE response, prepared at `open`.

    Every send has a write deadline: a client that takes nothing for `write_timeout_s` (its
    receive window shut, the gateway's buffers full) has its connection closed, and the send
    raises ConnectionResetError, as for a client that left (the pipeline bills it so). A slow
    reader that keeps reading keeps its stream; one that stops cannot hold a request open."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.write_timeout_s = request.config_dict.get(WRITE_TIMEOUT, WRITE_TIMEOUT_S)

    @property
    def opened(self) -> bool:
        return self.response is not None

    def could_wait(self, n: int) -> bool:
        """A send waits only when the transport's buffer passes its high-water mark (the
        kernel's socket buffer full too); below it the send returns at once."""
        if (t := self.request.transport) is None:
            return False  # a closed connection: the send fails at once, it cannot wait
        return t.get_write_buffer_size() + n + _SLACK > t.get_write_buffer_limits()[1]

    async def open(self, headers: dict[str, str]) -> None:
        self.response = _EventStream(headers={**SSE_HEADERS, **headers})
        await self._send(self.response.prepare(self.request), 0)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self._send(self.response.write(data), len(data))

    async def end(self, data: bytes) -> None:
        assert self.response is not None
        await self._send(self.response.write_eof(data), len(data))

    async def _send(self, send: Awaitable[object], n: int) -> None:
        # a send that cannot wait needs no deadline (no timer per chunk of a client that keeps up)
        if not self.write_timeout_s or not self.could_wait(n):
            await send
            return
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await send
        except TimeoutError:
            if (transport := self.request.transport) is not None:
                transport.abort()
            log.info(
                "%s: the client took nothing for %g s: its connection is closed",
                self.request.remote,
                self.write_timeout_s,
            )
            raise ConnectionResetError(
                f"the client read nothing for {self.write_timeout_s:g} s"
            ) from None


def broke_off(e: MidStreamError) -> APIError:
    """A whole answer's error for a reply that broke off after its first piece: a 502 (the
    backend's failure: a batch line runs again later), unless the failure is the request's own
    (a 4xx: the node could not compute what it asked for, nor could any other), which stays
    the client's error with the node's words, so no one runs it again."""
    if e.status < 500:
        return APIError(e.status, e.message, e.type, e.param, e.code)
    return APIError(502, f"the answer broke off: {e.message}", type_="upstream_error", code=e.code)


class Relay:
    """One reply relayed to its client: `whole` or `stream`. It owns what it sent (`sent`, a
    `SentLog`), which the ledger reads beside the reply's own accounting."""

    def __init__(
        self,
        ledger: Ledger,
        reply: Reply,
        fmt: Formatter,
        ended: Callable[[], None] | None = None,
        read_ahead_bytes: int = 0,
        cap_s: float = 0.0,
    ) -> None:
        """`ended`: called as soon as a stream's reply has ended, its rest (at most
        `read_ahead_bytes`, read ahead of the client) still being written to its client: what
        holds the node's admission slot gives it back there. `cap_s`: the request's wall-time
        cap (`[server] request_timeout_s`, from its arrival; 0: none)."""
        self.ledger, self.reply, self.fmt = ledger, reply, fmt
        self.ended, self.read_ahead_bytes = ended, read_ahead_bytes
        self.cap_s, self.deadline = cap_s, deadline(ledger.caller.t0, cap_s)
        self.sent = SentLog()

    def _written(self, pieces: list[Piece]) -> None:
        """`pieces` were written to the client: their tokens are sent (and `pieces` emptied)."""
        sent = self.sent.sent
        for p in pieces:
            sent[p.index] = sent.get(p.index, 0) + p.tokens
        pieces.clear()

    def _usage(self) -> Usage:
        a = self.reply.accounting
        return usage(
            a.prompt_tokens, a.total_completion_tokens, a.cached_tokens, a.cache_write_tokens
        )

    async def whole(self, n: int) -> object:
        """The whole answer's body (a struct), its usage record committed."""
        reply, ledger = self.reply, self.ledger
        texts: dict[int, list[str]] = {i: [] for i in range(n)}
        finish: dict[int, str | None] = {}
        logprobs: dict[int, list[CompletionLogprobs]] = {}
        calls: dict[int, list[ToolCallDelta]] = {}
        ids: dict[int, list[int]] = {i: [] for i in range(n)}
        cap = timer(self.deadline)
        try:
            async with cap:
                async for p in reply:
                    texts[p.index].append(p.text)
                    ids[p.index].extend(p.token_ids)
                    if p.reasoning or p.thinking:
                        self.fmt.reasoned(p)
                    if p.logprobs is not None:
                        logprobs.setdefault(p.index, []).append(p.logprobs)
                    if p.tool_calls:
                        calls.setdefault(p.index, []).extend(p.tool_calls)
                    if p.finish_reason:
                        finish[p.index] = self.sent.finish_reasons[p.index] = p.finish_reason
        except MidStreamError as e:
            # nothing was sent: a 502 carries none of the tokens
            await ledger.commit(UsageStatus.ERROR_MIDSTREAM, reply.accounting, self.sent)
            raise broke_off(e) from None
        except TimeoutError:
            if not cap.expired():
                raise
            await reply.aclose()  # the nodes stop before the record is written
            await self._cut(None)
        finally:
            await reply.aclose()
        await ledger.commit(UsageStatus.OK, reply.accounting)
        return self.fmt.body(texts, finish, self._usage(), logprobs or None, calls or None, ids)

    async def stream(self, sink: EventSink, headers: dict[str, str], include_usage: bool) -> None:
        """The answer as SSE into `sink` (opened with `headers` at the first piece; errors
        before it are plain HTTP errors, raised)."""
        reply, ledger, fmt = self.reply, self.ledger, self.fmt
        ledger.streaming(self.sent)  # a dead gateway's booking bills what this sends
        held: list[Piece] = []  # finishing chunks wait for the usage record's commit
        pending: list[bytes] = []  # chunks whose successor has already arrived: one write
        unsent: list[Piece] = []  # the pieces of `pending`, counted sent once written
        # read ahead of a slow client (bounded) from the first write that could wait for it, so
        # the node's slot is free once the node is done; a client that keeps up needs none
        ended = self.ended if self.read_ahead_bytes > 0 else None
        pieces: ReadAhead | None = None
        source: AsyncIterator[Piece] = aiter(reply)
        cap = timer(self.deadline)  # the pieces only: a committed answer's end is not cut
        try:
            async with cap:
                while True:
                    async for p in source:
                        if not sink.opened:
                            await sink.open(headers)
                        if p.finish_reason:
                            self.sent.finish_reasons[p.index] = p.finish_reason
                            held.append(p)
                            continue
                        pending.append(fmt.chunk(p))
                        unsent.append(p)
                        if p.more:
                            continue
                        data = pending[0] if len(pending) == 1 else b"".join(pending)
                        if ended is not None and pieces is None and sink.could_wait(len(data)):
                            break  # read the rest ahead before this write waits for the client
                        await sink.write(data)
                        pending.clear()
                        self._written(unsent)
                    else:
                        break  # the reply has ended
                    assert ended is not None
                    pieces = ReadAhead(source, ended, self.read_ahead_bytes)
                    source = pieces
                    await sink.write(data)
                    pending.clear()
                    self._written(unsent)
            if ended is not None and pieces is None:
                ended()  # the reply ended with the client keeping up: no reading ahead to do it
        except TimeoutError:
            await _close(reply, pieces)
            if not cap.expired():
                raise
            await self._cut(sink)
            return
        except MidStreamError as e:
            await _close(reply, pieces)
            self._written(unsent)  # they leave with the error event, in the same send
            await self._broke_off(sink, e, pending)
            return
        except BaseException:
            await _close(reply, pieces)
            raise
        await ledger.commit(UsageStatus.OK, reply.accounting)
        await self._end(sink, headers, [*pending, *(fmt.chunk(p) for p in held)], include_usage)

    async def _broke_off(self, sink: EventSink, e: MidStreamError, pending: list[bytes]) -> None:
        """A stream whose reply broke off (closed; `pending`: its chunks not written yet):
        committed as such, then ended with the error event (raised: no piece went out yet)."""
        await self.ledger.commit(UsageStatus.ERROR_MIDSTREAM, self.reply.accounting, self.sent)
        log.warning("%s: mid-stream failure: %s", self.ledger.record.request_id, e.message)
        if not sink.opened:  # no piece went out (the deltas showed no text): a plain error
            raise e
        await sink.end(b"".join([*pending, error_event(e), DONE]))

    async def _cut(self, sink: EventSink | None) -> None:
        """The request ran past its cap (its reply closed): its node slot is given back and
        its record committed before anything more is written to its client (whose last write
        has only the write deadline); then a stream ends with the error event, and a whole
        answer or a stream that sent nothing yet raises it (a 504)."""
        if self.ended is not None:
            self.ended()
        acc = self.reply.accounting
        log.info(
            "%s: past the request's cap of %g s: ended (%d completion tokens made, %d sent)",
            self.ledger.record.request_id,
            self.cap_s,
            acc.total_completion_tokens,
            self.sent.total,
        )
        await self.ledger.commit(UsageStatus.REQUEST_TIMEOUT, acc, self.sent)
        err = timed_out(self.cap_s)
        if sink is None or not sink.opened:  # nothing went out: a plain error
            raise err
        # (a write the cap cut had its chunk buffered whole: only the wait for it is cut)
        await sink.end(error_event(err) + DONE)

    async def _end(
        self, sink: EventSink, headers: dict[str, str], tail: list[bytes], include_usage: bool
    ) -> None:
        """The stream's end after its commit: `tail` (the chunks held back), the usage chunk,
        [DONE] and the body's end leave in one send (not five): a client that stops reading at
        [DONE] then finds the body ended and can keep its connection for the next request."""
        if not sink.opened:
            await sink.open(headers)
        if include_usage:
            tail.append(self.fmt.usage_chunk(self._usage()))
        tail.append(DONE)
        await sink.end(b"".join(tail))


async def _close(reply: Reply, pieces: ReadAhead | None) -> None:
    """Close `reply` now (its reading ahead ended first: a running generator cannot close)."""
    if pieces is not None:
        await pieces.stop()
    await reply.aclose()
