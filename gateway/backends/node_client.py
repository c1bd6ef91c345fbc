"""The gateway's client for the nodes' internal API: a prefill leg, a streamed decode (or
local) leg, and `/abort`. Turns every way a node call can go wrong into one of two answers:

- `NodeFailure`: the node is dead, slow, draining or broke (connection error, timeout, 5xx,
  an SSE error event, a stream cut short) — the caller may retry elsewhere;
- `APIError` with the node's own 4xx, or an SSE error event that says the request itself
  cannot be computed (`invalid_request_error` / `request_invalid`: every replica computes the
  same): the request is wrong, retrying or migrating cannot help.

Every call carries the request's X-Request-Id and its deadlines, each its own:
- connect: the TCP connect to a node (`connect_timeout_s`), and — on every connection, from
  its connect on — the time the node's kernel has to acknowledge what was sent (TCP_USER_TIMEOUT,
  with keepalive probes while the connection waits; the session's sockets are made so,
  node_silence.py): a partitioned node's connection, new or pooled, fails within it instead of
  hanging until the read deadline or the partition's end;
- read: the silence allowed before a stream's first chunk (`read_timeout_s`: a queue, a long
  prompt);
- stall: the silence allowed between chunks once they flow (`stall_timeout_s`): a node frozen
  mid-stream (SIGSTOP: its kernel still acknowledges, nothing streams) fails the stream so the
  caller migrates it.
A failure that says the node could not be reached or went silent is `NodeFailure.unreachable`:
the caller leaves the node out of its routing for a while (cluster/unreachable.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import AsyncIterator
from typing import TypeVar

import aiohttp
import msgspec

from gateway.backends.base import Shed
from gateway.backends.loop_lag import LoopLag
from gateway.backends.node_silence import acknowledgement_timeout, os_errno
from protocol.embeddings import NodeEmbeddingRequest, NodeEmbeddingResponse
from protocol.node_api import (
    AbortRequest,
    NodeCompletion,
    NodeCompletionChunk,
    NodeCompletionRequest,
)
from protocol.openai import APIError, ErrorDetail, parse_error
from protocol.sse import DataLines, read_to_end

log = logging.getLogger("duet.gateway.nodes")
_ENC = msgspec.json.Encoder()
#: (type, code) of a node's error that is the request's own (node/responder.py request_failed)
REQUEST_FAULT = ("invalid_request_error", "request_invalid")


def _local_exhaustion(e: BaseException) -> bool:
    return os_errno(e) in (errno.EMFILE, errno.ENFILE)


def _refused(e: BaseException) -> bool:
    return os_errno(e) == errno.ECONNREFUSED


def _unreachable(url: str, e: BaseException, leg: str = "") -> Exception:
    """What a failed call to a node raises: a NodeFailure (retry elsewhere) — unless this
    process is out of file descriptors (EMFILE/ENFILE), its own overload, not the node's
    failure: then the request is shed like any other overload (503 + Retry-After; the batch
    tier defers it) and no node is blamed."""
    if _local_exhaustion(e):
        return Shed(
            "the gateway has no file descriptor left for another connection to a node; retry "
            "shortly (operators: raise `ulimit -n` or lower [tiers] max_inflight)",
            1.0,
        )
    # no connect, no acknowledgement, no answer in time: the node is silent from here (a reset
    # or a disconnect of a pooled connection is not: the node may well be serving; nor is a
    # refused connect: the host answered, the process is gone — the next try costs nothing,
    # and a node restarted on its port must not stay left out)
    silent = isinstance(e, TimeoutError) or (
        isinstance(e, aiohttp.ClientConnectorError) and not _refused(e)
    )
    return NodeFailure(
        url, f"{leg}{type(e).__name__}: {e}", unreachable=silent or acknowledgement_timeout(e)
    )


def _event_error(url: str, err: ErrorDetail) -> Exception:
    """What a stream's error event raises: the request's own failure as the client's 400 with
    the node's words (no other node is tried, no stream migrated: each would compute the same
    and fail the same), anything else as the node's failure."""
    if err.type == REQUEST_FAULT[0] and err.code == REQUEST_FAULT[1]:
        return APIError(400, err.message, type_=err.type, param=err.param, code=err.code)
    return NodeFailure(url, f"error event: {err.message}")


class NodeFailure(Exception):
    def __init__(self, node: str, reason: str, unreachable: bool = False) -> None:
        super().__init__(f"{node}: {reason}")
        self.node = node
        self.reason = reason
        #: no answer at all (connect or acknowledgement timed out, refused, a stalled stream):
        #: the node, not only this request, is in trouble as seen from here
        self.unreachable = unreachable


_T = TypeVar("_T")
_CHUNK = msgspec.json.Decoder(NodeCompletionChunk)
_WHOLE = msgspec.json.Decoder(NodeCompletion)
_EMBEDDED = msgspec.json.Decoder(NodeEmbeddingResponse)
#: how long a node may take to end a body after its `[DONE]` before its connection is closed
DRAIN_TIMEOUT_S = 5.0
#: a connect timeout is this process's own when its loop stood still this share of it or more
OWN_STALL_SHARE = 0.5
#: the silence allowed between a stream's chunks (RoutingConfig.stall_timeout_s sets it)
STALL_TIMEOUT_S = 10.0
_NETWORK_ERRORS = (aiohttp.ClientError, TimeoutError, ConnectionError)


class NodeClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        connect_timeout_s: float,
        prefill_timeout_s: float,
        read_timeout_s: float,
        lag: LoopLag | None = None,
        auth: dict[str, str] | None = None,
    ) -> None:
        self.session = session
        #: the cluster secret's header (runtime/plane.py), on every request to a node and only
        #: there: the session is shared with the providers, which must never see it
        self._auth = auth or {}
        self._connect_timeout_s = connect_timeout_s
        self._lag = lag
        #: connects retried because this process's own stalled loop timed them out
        self.own_stall_retries = 0
        self._stall_logged = 0.0
        # sock_connect: the TCP connect itself; `connect` in aiohttp also counts the wait for a
        # free connection of the per-node pool, which is bounded by the leg's own timeout
        self._prefill_timeout = aiohttp.ClientTimeout(
            total=prefill_timeout_s, sock_connect=connect_timeout_s
        )
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None,
            connect=max(connect_timeout_s, read_timeout_s),
            sock_connect=connect_timeout_s,
            sock_read=read_timeout_s,
        )
        self._abort_timeout = aiohttp.ClientTimeout(total=max(2.0, connect_timeout_s))
        self.drain_timeout_s = DRAIN_TIMEOUT_S
        self.stall_timeout_s = STALL_TIMEOUT_S
        #: streams past [DONE] whose body's end is still being read (their connections go back
        #: to the pool when it arrives)
        self._draining: set[asyncio.Task[None]] = set()

    @property
    def draining(self) -> int:
        return len(self._draining)

    async def prefill(
        self, url: str, request_id: str, body: NodeCompletionRequest
    ) -> NodeCompletion:
        """The prefill leg; its answer carries `kv_transfer_params` for the decode node."""
        out = await self._whole(url, "/v1/completions", request_id, body, _WHOLE, "prefill leg")
        if out.kv_transfer_params is None or not out.kv_transfer_params.do_remote_prefill:
            raise NodeFailure(url, "prefill leg answered without kv_transfer_params")
        return out

    async def _whole(
        self,
        url: str,
        path: str,
        request_id: str,
        body: NodeCompletionRequest | NodeEmbeddingRequest,
        decoder: msgspec.json.Decoder[_T],
        what: str,
    ) -> _T:
        """One whole (unstreamed) answer under the prefill leg's timeout: a network error, a 5xx
        or a 429 is the node's failure (NodeFailure), another non-200 the request's (APIError)."""
        try:
            async with await self._post(url, request_id, body, self._prefill_timeout, path) as r:
                raw = await r.read()
        except _NETWORK_ERRORS as e:
            raise _unreachable(url, e, f"{what}: ") from None
        if r.status >= 500 or r.status == 429:
            raise NodeFailure(url, f"{what} answered {r.status}: {raw[:300]!r}")
        if r.status != 200:
            raise parse_error(r.status, raw)
        try:
            return decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise NodeFailure(url, f"{what}: unreadable answer: {e}") from None

    async def stream(
        self, url: str, request_id: str, body: NodeCompletionRequest
    ) -> AsyncIterator[tuple[NodeCompletionChunk, bool]]:
        """A streamed completion as `(chunk, more)`: `more` says the next chunk has already
        arrived (same network read), so a relay may hold this one and send both at once.
        Raises NodeFailure on any failure, APIError on a node's 4xx."""
        try:
            resp = await self._post(url, request_id, body, self._stream_timeout)
        except _NETWORK_ERRORS as e:
            raise _unreachable(url, e) from None
        finished = False  # [DONE] read, the body's end not yet: the connection may be kept
        try:
            if resp.status != 200:
                raw = await _read_quietly(resp)
                if resp.status >= 500 or resp.status == 429:
                    raise NodeFailure(url, f"answered {resp.status}: {raw[:300]!r}")
                raise parse_error(resp.status, raw)
            done = False
            lines = DataLines()
            flowing = False  # a chunk went out: from now on silence is bounded by the stall bound
            try:
                # Whatever has arrived, in one read (not a read per line): a burst of chunks
                # costs one wake-up here and one send to the client.
                while data := await self._read_some(url, resp, flowing):
                    try:
                        events = lines.feed(data)
                    except ValueError as e:
                        raise NodeFailure(url, str(e)) from None
                    for k, payload in enumerate(events):
                        if payload == b"[DONE]":
                            done = True
                            break
                        chunk = _CHUNK.decode(payload)
                        if chunk.error is not None:
                            raise _event_error(url, chunk.error)
                        flowing = True
                        yield chunk, k + 1 < len(events) and events[k + 1] != b"[DONE]"
                    if done:
                        break
            except (*_NETWORK_ERRORS, msgspec.DecodeError, msgspec.ValidationError) as e:
                silent = acknowledgement_timeout(e)
                raise NodeFailure(
                    url, f"stream broke: {type(e).__name__}: {e}", unreachable=silent
                ) from None
            if not done:
                raise NodeFailure(url, "stream ended before [DONE]")
            finished = not resp.content.is_eof()
        finally:
            if finished:
                self._drain(resp)
            else:
                resp.release()  # at the body's end: back to the pool; else (cut short) closed

    async def _read_some(self, url: str, resp: aiohttp.ClientResponse, flowing: bool) -> bytes:
        """What has arrived of a stream (b"" at its end); once chunks flow, a silence past the
        stall bound is the node's failure (frozen: its kernel acknowledges, nothing streams)."""
        if not flowing:
            return await resp.content.readany()  # bounded by the read deadline (sock_read)
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                return await resp.content.readany()
        except TimeoutError:
            raise NodeFailure(
                url,
                f"stalled: nothing streamed for {self.stall_timeout_s:g} s "
                "([routing] stall_timeout_s)",
                unreachable=True,
            ) from None

    async def _post(
        self,
        url: str,
        request_id: str,
        body: NodeCompletionRequest | NodeEmbeddingRequest,
        timeout: aiohttp.ClientTimeout,
        path: str = "/v1/completions",
    ) -> aiohttp.ClientResponse:
        """POST `path` (a leg's by default) with the cluster secret: every call to a node goes
        through here. A connect that timed out while this process's own event loop
        stood still for half the connect timeout or more is tried once more: the timeout was
        ours (loop_lag.py says how a burst does that), not the node's."""
        data = _ENC.encode(body)
        for attempt in (0, 1):
            t0 = time.monotonic()
            try:
                resp = await self.session.post(
                    f"{url}{path}",
                    data=data,
                    headers=_headers(request_id, body, self._auth),
                    timeout=timeout,
                )
                return resp
            except aiohttp.ConnectionTimeoutError:
                stalled = self._lag.stalled_since(t0) if self._lag is not None else 0.0
                if attempt or stalled < OWN_STALL_SHARE * self._connect_timeout_s:
                    raise
                self.own_stall_retries += 1
                if t0 - self._stall_logged > 10:
                    self._stall_logged = t0
                    log.warning(
                        "the gateway's event loop stood still %.1f s, so connects to nodes timed "
                        "out on its side (%s: retrying; %d so far); a burst larger than one "
                        "process takes at once does this — more gateway processes, or a lower "
                        "[tiers] max_inflight, avoid it",
                        stalled,
                        url,
                        self.own_stall_retries,
                    )
        raise AssertionError("unreachable")

    def _drain(self, resp: aiohttp.ClientResponse) -> None:
        """Read the rest of a stream whose `[DONE]` has been relayed, off the request's path.

        A chunked body ends with a zero-length chunk that may arrive in a later read than
        `[DONE]`. Releasing the response before it would close the connection (aiohttp cannot
        reuse one in the middle of a body), and the next request would pay a new TCP connection
        on its way to the first token — 4 in 10 requests did against a node that sent the two
        in separate writes."""

        async def finish() -> None:
            try:
                ended = await read_to_end(resp, self.drain_timeout_s)
            except asyncio.CancelledError:
                resp.close()
                raise
            if ended:
                resp.release()
            else:  # no end in time, or the node went: the connection goes
                log.debug("closing a connection whose body did not end after [DONE]")
                resp.close()

        task = asyncio.ensure_future(finish())
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def close(self) -> None:
        """Stop reading the ends of finished streams (at shutdown, before the session closes)."""
        for task in list(self._draining):
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)

    async def embed(
        self, url: str, request_id: str, body: NodeEmbeddingRequest
    ) -> NodeEmbeddingResponse:
        """`POST /v1/embeddings` on an embed node (protocol/embeddings.py), under the prefill
        leg's timeout (both are one prefill). NodeFailure / APIError as the legs."""
        return await self._whole(url, "/v1/embeddings", request_id, body, _EMBEDDED, "embeddings")

    async def abort(self, url: str, request_id: str) -> None:
        """Best effort: the node frees whatever it holds for the request (quietly on failure)."""
        with contextlib.suppress(*_NETWORK_ERRORS):
            async with self.session.post(
                f"{url}/abort",
                data=_ENC.encode(AbortRequest(request_id=request_id)),
                headers=_headers(request_id, None, self._auth),
                timeout=self._abort_timeout,
            ) as r:
                await r.read()
                log.info("aborted %s on %s: %s", request_id, url, r.status)


def _headers(
    request_id: str,
    body: NodeCompletionRequest | NodeEmbeddingRequest | None = None,
    auth: dict[str, str] | None = None,
) -> dict[str, str]:
    h = {"X-Request-Id": request_id, "Content-Type": "application/json", **(auth or {})}
    if (
        isinstance(body, NodeCompletionRequest) and body.resume is not None
    ):  # a migrated leg says so to logs and proxies
        h["X-Duet-Migration"] = str(body.resume.migration)
    return h


async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except _NETWORK_ERRORS:
        return b""
