"""`ClusterBackend`: serve a request on duet's own nodes (DESIGN §1 steps 2-5).

route → prefill leg on P (unless the route says "prefill on D") → decode leg on D, streamed.
Failure answers, all under the same X-Request-Id:
- P fails before the transfer → route again without P (another P, or prefill locally on D);
- D fails before its first token → abort what the try touched (P's held blocks included) and
  route again without D;
- D fails after the first token → `MidStreamError` (the API layer sends an SSE error event);
- the request ends any way but complete (error, client gone, cancelled) → `POST /abort` on
  every node it touched, in a task the client's cancellation cannot stop.

`n > 1`: the nodes take one sample per request, so sample 0 runs the P → D legs; once its
first token is out its prompt KV sits in D's prefix cache, and samples 1..n-1 run on the same
D as local legs (ids `<X-Request-Id>.<i>`) whose prompt is served from that cache (its full
blocks: only the last partial block is recomputed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from gateway.backend import Accounting, Attempt, Backend, MidStreamError, Piece, Reply
from gateway.config import RoutingConfig, Tier
from gateway.node_client import NodeClient, NodeFailure
from gateway.providers.fallback import Reason
from gateway.requests import Endpoint, Request
from gateway.routing import NodeLoad, Router
from gateway.tiers import Shed
from protocol.block_hash import block_hashes
from protocol.kv_params import KVTransferParams
from protocol.node_api import NodeCompletionChunk, NodeCompletionRequest
from protocol.openai import APIError
from protocol.route import RouteRequest

log = logging.getLogger("duet.gateway.cluster")


class _Touched:
    """(url, request id) pairs a request reached, to abort if it does not complete."""

    def __init__(self) -> None:
        self.items: set[tuple[str, str]] = set()


#: errors that mean "no node can serve this model now" (router and ClusterBackend codes)
_NO_NODES = {(503, "no_capacity"), (503, "upstream_unavailable"), (404, "model_not_found")}
#: the prefill leg asks P to compute the prompt and hold its KV for a decode node
_TO_DECODE = KVTransferParams(do_remote_decode=True)


def leg_request(request: Request, attempt: Attempt, **leg: object) -> NodeCompletionRequest:
    """The node request of one leg: the prompt's ids, the client's sampling fields, the tier as
    the node's priority, and the leg's own fields (stream, max_tokens, seed, kv params)."""
    s = request.sampling
    fields: dict[str, object] = {
        "prompt": attempt.prompt_ids, "max_tokens": attempt.max_tokens, "priority": attempt.tier,
        "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed, "top_k": s.top_k,
        "ignore_eos": bool(s.ignore_eos), "min_tokens": s.min_tokens or 0, "stop": list(s.stop) or None,
        "logprobs": s.logprobs, **leg}  # fmt: skip
    return NodeCompletionRequest(**fields)  # type: ignore[arg-type]


class ClusterBackend(Backend):
    uses_tier_queues = True

    def __init__(self, nodes: NodeClient, router: Router, load: NodeLoad, cfg: RoutingConfig,
                 on_retry: Callable[[str], None] = lambda _: None) -> None:  # fmt: skip
        self.nodes = nodes
        self.router = router
        self.load = load
        self.cfg = cfg
        self._on_retry = on_retry
        self._cleanup: set[asyncio.Task[None]] = set()  # strong refs to abort tasks

    def usable_for(self, endpoint: Endpoint, n: int) -> bool:
        return True

    def fallback_reason(self, err: APIError, tier: Tier) -> Reason | None:
        if isinstance(err, Shed):  # the admission queue: batch requests are there to wait
            return Reason.SATURATED if tier == "interactive" else None
        return Reason.NO_HEALTHY_NODES if (err.status, err.code) in _NO_NODES else None

    def open(self, request: Request, attempt: Attempt) -> Reply:
        return Reply(lambda acc: self._stream(request, attempt, acc), prompt_tokens=len(attempt.prompt_ids))

    async def _stream(self, request: Request, attempt: Attempt, out: Accounting) -> AsyncIterator[Piece]:
        touched = _Touched()
        complete = False
        try:
            async for piece in self._run(request, attempt, out, touched):
                yield piece
            complete = True
        finally:
            if not complete and touched.items:
                task = asyncio.ensure_future(self._abort(touched.items))
                self._cleanup.add(task)
                task.add_done_callback(self._cleanup.discard)

    async def drain(self) -> None:
        """Wait for pending aborts (at shutdown)."""
        if self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)

    async def _abort(self, items: set[tuple[str, str]]) -> None:
        await asyncio.gather(*(self.nodes.abort(url, rid) for url, rid in items))

    async def _run(self, request: Request, job: Attempt, out: Accounting, touched: _Touched) -> AsyncIterator[Piece]:
        rid = job.request_id
        hashes = block_hashes(job.prompt_ids, job.model.block_size)
        exclude: list[str] = []
        failures: list[str] = []
        out.model_used = job.model.name
        for attempt in range(self.cfg.max_attempts):
            if attempt:
                self._on_retry("route")
            route = await self.router.route(RouteRequest(
                model=job.model.cluster_name, block_hashes=hashes, num_prompt_tokens=len(job.prompt_ids),
                max_tokens=job.max_tokens, tier=job.tier,
                exclude=list(exclude), request_id=rid))  # fmt: skip
            kv: KVTransferParams | None = None
            tried: list[tuple[str, str]] = []
            if route.prefill is not None:
                p = route.prefill
                tried.append((p.url, rid))
                touched.items.add((p.url, rid))
                self.load.acquire(p.url)
                try:
                    out.prompt_sent = True
                    answer = await self.nodes.prefill(p.url, rid, leg_request(  # logprobs come from D
                        request, job, max_tokens=1, stream=False, logprobs=None, kv_transfer_params=_TO_DECODE))  # fmt: skip
                    kv = answer.kv_transfer_params
                except NodeFailure as e:
                    log.warning("%s: prefill on %s failed (%s); routing again without it", rid, p.node_id, e.reason)
                    failures.append(str(e))
                    exclude.append(p.node_id)
                    await self._abort(set(tried))
                    continue
                finally:
                    self.load.release(p.url)
            d = route.decode
            touched.items.add((d.url, rid))
            tried.append((d.url, rid))
            first = _Sample(self, d.url, rid, 0, leg_request(request, job, stream=True, kv_transfer_params=kv))
            try:
                out.prompt_sent = True
                head = await first.start()
            except NodeFailure as e:
                log.warning("%s: decode on %s failed before its first token (%s); routing again without it",
                            rid, d.node_id, e.reason)  # fmt: skip
                failures.append(str(e))
                exclude.append(d.node_id)
                await self._abort(set(tried))
                continue
            if route.prefill is not None:
                out.nodes.append(route.prefill.node_id)
            out.nodes.append(d.node_id)
            async for piece in self._samples(request, job, out, touched, (d.url, first, head)):
                yield piece
            return
        raise APIError(503, f"the request failed on every node tried ({self.cfg.max_attempts} attempts): "
                            + "; ".join(failures), type_="service_unavailable", code="upstream_unavailable")  # fmt: skip

    async def _samples(self, request: Request, job: Attempt, out: Accounting, touched: _Touched,
                       started: tuple[str, _Sample, tuple[NodeCompletionChunk, bool]]) -> AsyncIterator[Piece]:  # fmt: skip
        d_url, first, head = started
        if request.n == 1:  # the common case: no queue, no extra task per request
            it = first.chunks(head)
            try:
                async for chunk, more in it:
                    pieces = self._pieces(0, chunk, out)
                    for piece in pieces:
                        piece.more = more or piece is not pieces[-1]
                        yield piece
            except Exception as e:
                raise _midstream(e) from None
            finally:
                await it.aclose()  # now, not at GC: frees the node's load count and connection
            return
        samples = [first]
        seed = request.sampling.seed
        for i in range(1, request.n):
            srid = f"{job.request_id}.{i}"
            touched.items.add((d_url, srid))
            # distinct samples, still reproducible
            body = leg_request(request, job, stream=True, seed=None if seed is None else seed + i)
            samples.append(_Sample(self, d_url, srid, i, body))
        queue: asyncio.Queue[tuple[int, NodeCompletionChunk | BaseException | None]] = asyncio.Queue()
        tasks = [asyncio.ensure_future(s.pump(queue, head if s is first else None)) for s in samples]
        try:
            running = len(samples)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise _midstream(item)
                for piece in self._pieces(i, item, out):
                    yield piece
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _pieces(self, i: int, chunk: NodeCompletionChunk, out: Accounting) -> list[Piece]:
        pieces = []
        for c in chunk.choices:
            n = len(c.token_ids or ())
            if n and out.first_token_at is None:
                out.first_token_at = time.monotonic()
            out.completion_tokens[i] = out.completion_tokens.get(i, 0) + n
            if c.text or c.finish_reason or c.logprobs:
                pieces.append(Piece(index=i, text=c.text, finish_reason=c.finish_reason, logprobs=c.logprobs))
        if chunk.usage is not None:
            out.completion_tokens[i] = chunk.usage.completion_tokens
            if i == 0:
                out.prompt_tokens = chunk.usage.prompt_tokens
                out.cached_tokens = (chunk.usage.prompt_tokens_details or {}).get("cached_tokens", 0)
        return pieces


class _Sample:
    """One node stream (one sample) on one node, with its load counted while it runs."""

    def __init__(self, backend: ClusterBackend, url: str, request_id: str, index: int,
                 body: NodeCompletionRequest) -> None:  # fmt: skip
        self.backend = backend
        self.url = url
        self.request_id = request_id
        self.index = index
        self.body = body
        self._it: AsyncIterator[tuple[NodeCompletionChunk, bool]] | None = None
        self._counted = False

    def _open(self) -> AsyncIterator[tuple[NodeCompletionChunk, bool]]:
        self.backend.load.acquire(self.url)
        self._counted = True
        return self.backend.nodes.stream(self.url, self.request_id, self.body)

    def _close_count(self) -> None:
        if self._counted:
            self._counted = False
            self.backend.load.release(self.url)

    async def start(self) -> tuple[NodeCompletionChunk, bool]:
        """Open the stream and read up to the first chunk that carries tokens."""
        self._it = self._open()
        try:
            async for chunk, more in self._it:
                if any(c.token_ids or c.finish_reason for c in chunk.choices):
                    return chunk, more
            raise NodeFailure(self.url, "stream ended without a token")
        except BaseException:
            self._close_count()
            raise

    async def chunks(self, head: tuple[NodeCompletionChunk, bool] | None) -> AsyncIterator[tuple[NodeCompletionChunk, bool]]:
        """`head` (what start() read), then the rest of the stream; the node's load is
        released and the stream closed however this ends."""
        try:
            if head is not None:
                yield head
            if self._it is None:
                self._it = self._open()
            async for item in self._it:
                yield item
        finally:
            self._close_count()
            aclose = getattr(self._it, "aclose", None)
            if aclose is not None:
                await aclose()

    async def pump(self, queue: asyncio.Queue[tuple[int, NodeCompletionChunk | BaseException | None]],
                   head: tuple[NodeCompletionChunk, bool] | None) -> None:  # fmt: skip
        try:
            async for chunk, _ in self.chunks(head):
                await queue.put((self.index, chunk))
            await queue.put((self.index, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await queue.put((self.index, e))


def _midstream(e: BaseException) -> MidStreamError:
    if isinstance(e, APIError):
        return MidStreamError(e.status, e.message, e.type, e.param, e.code)
    return MidStreamError(502, f"the decode node failed mid-stream: {e}", type_="upstream_error",
                          code="upstream_failed_midstream")  # fmt: skip
