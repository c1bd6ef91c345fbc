"""`ClusterBackend`: serve a request on duet's own nodes (DESIGN §1 steps 2-5).

route → prefill leg on P (unless the route says "prefill on D") → decode leg on D, streamed.
Failure answers, all under the same X-Request-Id:
- P fails before the transfer → route again without P (another P, or prefill locally on D);
- D fails before its first token → abort what the try touched (P's held blocks included) and
  route again without D;
- D fails after the first token → the stream migrates (`_migrate`): the prompt plus the tokens
  streamed go to another node, whose leg carries `Resume` (protocol/resume.py) and continues the
  text where the client's stops (a guided request's prefill leg carries it too: P's token is
  the output's next, issue #24); at most [routing] max_migrations times, within
  migration_deadline_s, else `MidStreamError` (the API layer sends an SSE error event). The
  same for a whole (non-streamed) answer, which reads the same stream. With n > 1 every
  sample not finished migrates on its own (its own streamed ids, seed and limits), the others
  stream on meanwhile;
- the request ends any way but complete (error, client gone, cancelled) → `POST /abort` on
  every node it touched, in a task the client's cancellation cannot stop.

`n > 1`: the nodes take one sample per request, so sample 0 runs the P → D legs; once its
first token is out its prompt KV sits in D's prefix cache, and samples 1..n-1 run on the same
D as local legs (ids `<X-Request-Id>.<i>`) whose prompt is served from that cache (its full
blocks: only the last partial block is recomputed). A migrated sample's leg is `<its id>.m<N>`.

Usage: the prompt is billed once, with the cached tokens the answering leg of sample 0
reported (a migrated leg's node reports them against the original prompt, as it does its
prompt tokens); a leg that died never reported any. Each piece carries the tokens whose output
it delivers (`Piece.tokens`): a node delta with no text (an unfinished UTF-8 character) passes
its tokens on to the sample's next piece, across a migration too (the new leg emits the text
the dead one held back), so an answer that breaks off bills only what reached its client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.backends.base import Accounting, Attempt, Backend, MidStreamError, Piece, Reply, Shed
from gateway.backends.node_client import NodeClient, NodeFailure
from gateway.backends.providers.fallback import Reason
from gateway.backends.routing import NodeLoad, Router
from gateway.config import RoutingConfig, Tier
from gateway.serving.requests import Endpoint, Request
from protocol.block_hash import block_hashes, domain_root
from protocol.kv_params import KVTransferParams
from protocol.node_api import NodeCompletionChunk, NodeCompletionRequest
from protocol.openai import APIError, CompletionChoice
from protocol.resume import Resume
from protocol.route import RouteRequest, RouteResponse
from runtime.tracing import GEN_AI_INPUT_TOKENS, GEN_AI_OUTPUT_TOKENS, SERVER_ADDRESS, Tracing

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
    """The node request of one leg: the prompt's ids, the client's sampling fields (penalties,
    logit_bias and the guide included: the same on P and D), the tier as the node's priority,
    the caller's cache domain, and the leg's own fields (stream, max_tokens, seed, kv params)."""
    s = request.sampling
    fields: dict[str, object] = {
        "prompt": attempt.prompt_ids,
        "max_tokens": attempt.max_tokens,
        "priority": attempt.tier,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "seed": s.seed,
        "top_k": s.top_k,
        "ignore_eos": bool(s.ignore_eos),
        "min_tokens": s.min_tokens or 0,
        "stop": list(s.stop) or None,
        "logprobs": s.logprobs,
        "cache_salt": attempt.cache_domain or None,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "repetition_penalty": s.repetition_penalty,
        "min_p": s.min_p,
        "logit_bias": s.logit_bias,
        "guide": attempt.guide,
        **leg,
    }
    return NodeCompletionRequest(**fields)  # type: ignore[arg-type]


def _p_leg(job: Attempt, trip: _Trip) -> dict[str, object]:
    """The prefill leg's own fields. P makes one token. A guided request's is the output's
    first (D emits it: prefill/leg.py), so P samples it as D would have: with the sample's own
    seed and, on a migrated leg, `resume` (its grammar state, penalties and seeded draws after
    the streamed tokens), which needs the request's max_tokens (a node counts the streamed
    tokens in it; the prefill leg still makes one). An unguided P's token is not used."""
    if job.guide is None:
        return {"max_tokens": 1}
    own: dict[str, object] = {"seed": trip.seed} if trip.index else {}
    if trip.resume is None:
        return {"max_tokens": 1, **own}
    return {"max_tokens": job.max_tokens, "resume": trip.resume, **own}


class ClusterBackend(Backend):
    uses_tier_queues = True

    def __init__(
        self,
        nodes: NodeClient,
        router: Router,
        load: NodeLoad,
        cfg: RoutingConfig,
        on_retry: Callable[[str], None] = lambda _: None,
        tracing: Tracing | None = None,
    ) -> None:
        self.nodes = nodes
        self.tracing = tracing or Tracing.off()
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
        return Reply(
            lambda acc: self._stream(request, attempt, acc), prompt_tokens=len(attempt.prompt_ids)
        )

    async def _stream(
        self, request: Request, attempt: Attempt, out: Accounting
    ) -> AsyncIterator[Piece]:
        touched = _Touched()
        complete = False
        try:
            async for piece in self._run(request, attempt, out, touched):
                yield piece
            complete = True
        finally:
            if not complete and touched.items:
                self._abort_later(touched.items)

    def _abort_later(self, items: set[tuple[str, str]]) -> None:
        """`POST /abort` to each, in a task the client's cancellation cannot stop."""
        task = asyncio.ensure_future(self._abort(set(items)))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def drain(self) -> None:
        """Wait for pending aborts (at shutdown)."""
        if self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)

    async def _abort(self, items: set[tuple[str, str]]) -> None:
        await asyncio.gather(*(self.nodes.abort(url, rid) for url, rid in items))

    async def _run(
        self, request: Request, job: Attempt, out: Accounting, touched: _Touched
    ) -> AsyncIterator[Piece]:
        out.model_used = job.model.name
        trip = _Trip(t0=time.monotonic())
        leg = await self._open_leg(request, job, out, touched, trip)
        if request.n > 1:  # samples 1..n-1 start on sample 0's node; each migrates on its own
            async for piece in self._samples(request, job, out, touched, leg, trip):
                yield piece
            return
        while True:
            trip.failure = None
            async for piece in self._follow(leg, out, trip):
                yield piece
            if trip.failure is None:
                return
            leg = await self._migrate(request, job, out, touched, trip, trip.failure)

    async def _open_leg(
        self, request: Request, job: Attempt, out: Accounting, touched: _Touched, trip: _Trip
    ) -> _Started:
        """Route, prefill on P (unless the route says D), start the decode leg on D up to its
        first token: retried on other nodes up to max_attempts. A migrated leg's decode
        request carries `trip.resume`."""
        rid = job.request_id
        hashes = block_hashes(
            job.prompt_ids, job.model.block_size, parent=domain_root(job.cache_domain)
        )
        exclude, failures = trip.exclude, []
        for attempt in range(self.cfg.max_attempts):
            if attempt:
                self._on_retry("route")
            route = await self._route(
                RouteRequest(
                    model=job.model.cluster_name,
                    block_hashes=hashes,
                    num_prompt_tokens=len(job.prompt_ids),
                    max_tokens=job.max_tokens,
                    tier=job.tier,
                    exclude=list(exclude),
                    request_id=rid,
                ),
                attempt,
            )
            tried: list[tuple[str, str]] = []
            try:
                kv = await self._prefill(request, job, out, touched, route, tried, trip)
            except NodeFailure as e:
                assert route.prefill is not None
                log.warning(
                    "%s: prefill on %s failed (%s); routing again without it",
                    rid,
                    route.prefill.node_id,
                    e.reason,
                )
                failures.append(str(e))
                exclude.append(route.prefill.node_id)
                await self._abort(set(tried))
                continue
            d = route.decode
            touched.items.add((d.url, rid))
            tried.append((d.url, rid))
            own_seed = {"seed": trip.seed} if trip.index else {}  # sample i > 0 draws from seed + i
            first = _Sample(
                self,
                d.url,
                rid,
                trip.index,
                leg_request(
                    request,
                    job,
                    stream=True,
                    kv_transfer_params=kv,
                    resume=trip.resume,
                    # the node computing the prompt pulls its prefix from the route's KV source
                    kv_source=route.kv_source if route.prefill is None else None,
                    **own_seed,
                ),
            )
            tr = self.tracing
            span = tr.start(
                "gateway.decode_leg",
                {
                    "duet.node_id": d.node_id,
                    SERVER_ADDRESS: d.url,
                    "duet.cached_tokens": d.cached_tokens,
                },
                kind="CLIENT",
            )
            t_start = time.time_ns()
            try:
                out.prompt_sent = True
                with tr.current(span):  # its POST carries this span's traceparent
                    head = await first.start()
            except NodeFailure as e:
                tr.end(span, error=e.reason)
                log.warning(
                    "%s: decode on %s failed before its first token (%s); routing again without it",
                    rid,
                    d.node_id,
                    e.reason,
                )
                failures.append(str(e))
                exclude.append(d.node_id)
                await self._abort(set(tried))
                continue
            except BaseException as e:
                tr.end(span, error=type(e).__name__)
                raise
            tr.record("gateway.first_token", t_start, time.time_ns(), parent=span)
            if route.prefill is not None:
                out.nodes.append(route.prefill.node_id)
            out.nodes.append(d.node_id)
            trip.node_id, trip.leg, trip.span = d.node_id, (d.url, rid), span
            return d.url, first, head
        raise APIError(
            503,
            f"the request failed on every node tried ({self.cfg.max_attempts} attempts): "
            + "; ".join(failures),
            type_="service_unavailable",
            code="upstream_unavailable",
        )

    async def _route(self, req: RouteRequest, attempt: int) -> RouteResponse:
        """The router's placement, in a span that says where and why."""
        tr = self.tracing
        with tr.span(
            "gateway.route", {"duet.attempt": attempt, "duet.exclude": list(req.exclude)}
        ) as span:
            route = await self.router.route(req)
            if span is not None:
                p = route.prefill
                span.set_attributes(
                    {
                        "duet.route.reason": route.reason,
                        "duet.decode.node_id": route.decode.node_id,
                        "duet.prefill.node_id": p.node_id if p is not None else "",
                        "duet.cached_tokens": max(
                            route.decode.cached_tokens, p.cached_tokens if p is not None else 0
                        ),
                    }
                )
            return route

    async def _prefill(
        self,
        request: Request,
        job: Attempt,
        out: Accounting,
        touched: _Touched,
        route: RouteResponse,
        tried: list[tuple[str, str]],
        trip: _Trip,
    ) -> KVTransferParams | None:
        """The prefill leg on the route's P, if it names one: P's KV handle for D (a guided
        request's with the first token P sampled, which D continues from)."""
        p = route.prefill
        if p is None:
            return None
        rid = job.request_id
        tried.append((p.url, rid))
        touched.items.add((p.url, rid))
        self.load.acquire(p.url)
        tr = self.tracing
        try:
            with tr.span(
                "gateway.prefill_leg",
                {
                    "duet.node_id": p.node_id,
                    SERVER_ADDRESS: p.url,
                    "duet.cached_tokens": p.cached_tokens,
                },
                kind="CLIENT",
            ) as span:
                out.prompt_sent = True
                answer = await self.nodes.prefill(
                    p.url,
                    rid,
                    leg_request(  # logprobs come from D
                        request,
                        job,
                        stream=False,
                        logprobs=None,
                        kv_transfer_params=_TO_DECODE,
                        kv_source=route.kv_source,
                        **_p_leg(job, trip),
                    ),
                )
                if span is not None and answer.usage is not None:
                    span.set_attribute(GEN_AI_INPUT_TOKENS, answer.usage.prompt_tokens)
            return answer.kv_transfer_params
        finally:
            self.load.release(p.url)

    async def _follow(self, leg: _Started, out: Accounting, trip: _Trip) -> AsyncIterator[Piece]:
        """Sample 0's pieces from one decode leg. A node failure before its last token ends them
        with `trip.failure` set (the caller migrates the stream); any other failure raises
        MidStreamError."""
        _, sample, head = leg
        it = sample.chunks(head)
        try:
            async for chunk, more in it:
                pieces = self._pieces(0, chunk, out, trip)
                for piece in pieces:
                    piece.more = more or piece is not pieces[-1]
                    yield piece
        except NodeFailure as e:
            if not trip.finished:  # a node that died after its last token owes nothing
                trip.failure = e
        except Exception as e:
            self.tracing.end(trip.span, error=type(e).__name__)
            trip.span = None
            raise _midstream(e) from None
        finally:
            await it.aclose()  # now, not at GC: frees the node's load count and connection
            out.leg_tokens.append(len(trip.ids) - trip.base)
            self.tracing.end(
                trip.span,
                {GEN_AI_OUTPUT_TOKENS: len(trip.ids) - trip.base},
                error=trip.failure.reason if trip.failure is not None else None,
            )
            trip.span = None

    async def _migrate(
        self,
        request: Request,
        job: Attempt,
        out: Accounting,
        touched: _Touched,
        trip: _Trip,
        failure: NodeFailure,
    ) -> _Started:
        """Stream migration: the decode node died after tokens went out. The prompt plus the
        tokens streamed go to another node (routed like any request, the dead node excluded:
        prefix cache and P/D as usual) under the request id `<id>.m<N>`, with `Resume` telling
        it where the output stands; the client's stream goes on. Bounded by [routing]
        max_migrations and migration_deadline_s (past them: MidStreamError)."""
        n = trip.migrations + 1
        if n > self.cfg.max_migrations:
            raise MidStreamError(
                502,
                f"the decode node failed mid-stream ({failure}) and the stream was migrated "
                f"{trip.migrations} times already ([routing] max_migrations)",
                type_="upstream_error",
                code="migration_limit_reached",
            )
        if time.monotonic() - trip.t0 > self.cfg.migration_deadline_s:
            raise MidStreamError(
                502,
                f"the decode node failed mid-stream ({failure}) past the request's migration "
                f"deadline ([routing] migration_deadline_s = {self.cfg.migration_deadline_s})",
                type_="upstream_error",
                code="migration_deadline_exceeded",
            )
        log.warning(
            "%s: decode on %s failed mid-stream after %d tokens (%s); migrating the stream (%d of at most %d)",
            job.request_id,
            trip.node_id,
            len(trip.ids),
            failure.reason,
            n,
            self.cfg.max_migrations,
        )
        self._on_retry("migration")
        self._abort_later({trip.leg})  # a node that only stalled must not go on decoding for nobody
        trip.migrations = n
        out.migrations += 1  # every sample's migrations
        trip.exclude.append(trip.node_id)
        trip.base = len(trip.ids)
        trip.resume = (
            Resume(output_tokens=len(trip.ids), text_chars=trip.chars, migration=n)
            if trip.ids
            else None
        )
        leg_job = replace(
            job, request_id=f"{job.request_id}.m{n}", prompt_ids=job.prompt_ids + trip.ids
        )
        try:
            with self.tracing.span(
                "gateway.migration",
                {
                    "duet.migration": n,
                    "duet.failed_node_id": trip.node_id,
                    "duet.reason": failure.reason,
                    "duet.streamed_tokens": len(trip.ids),
                },
            ):
                return await self._open_leg(request, leg_job, out, touched, trip)
        except APIError as e:
            raise MidStreamError(
                502,
                f"the decode node failed mid-stream ({failure}) and no node could continue "
                f"the stream: {e.message}",
                type_="upstream_error",
                code="upstream_failed_midstream",
            ) from None

    async def _samples(
        self,
        request: Request,
        job: Attempt,
        out: Accounting,
        touched: _Touched,
        started: _Started,
        trip0: _Trip,
    ) -> AsyncIterator[Piece]:
        """n > 1: sample 0's stream and samples 1..n-1 on the same node, interleaved. A sample
        whose node fails before its last token migrates alone (`_migrate`, with its own trip),
        in a task of its own; the others' pieces go on meanwhile."""
        d_url, first, head = started
        seed = request.sampling.seed
        trips = [trip0]
        samples = [first]
        for i in range(1, request.n):
            srid = f"{job.request_id}.{i}"
            touched.items.add((d_url, srid))
            # distinct samples, still reproducible
            trip = _Trip(
                t0=trip0.t0,
                index=i,
                seed=None if seed is None else seed + i,
                node_id=trip0.node_id,
                leg=(d_url, srid),
                exclude=list(trip0.exclude),
            )
            trips.append(trip)
            samples.append(
                _Sample(
                    self, d_url, srid, i, leg_request(request, job, stream=True, seed=trip.seed)
                )
            )
        queue: asyncio.Queue[tuple[int, NodeCompletionChunk | BaseException | None]] = (
            asyncio.Queue()
        )
        tasks = [
            asyncio.ensure_future(s.pump(queue, head if s is first else None)) for s in samples
        ]
        try:
            running = len(samples)
            while running:
                i, item = await queue.get()
                trip = trips[i]
                if item is None or (isinstance(item, NodeFailure) and trip.finished):
                    running -= 1  # (a node that died after the sample's last token owes nothing)
                    self._leg_done(out, trip)
                    continue
                if isinstance(item, NodeFailure):  # every piece before it went out: trip is whole
                    self._leg_done(out, trip, item)
                    job_i = job if i == 0 else replace(job, request_id=f"{job.request_id}.{i}")
                    tasks.append(
                        asyncio.ensure_future(
                            self._migrate_sample(request, job_i, out, touched, trip, item, queue)
                        )
                    )
                    continue
                if isinstance(item, BaseException):
                    raise _midstream(item)
                for piece in self._pieces(i, item, out, trip):
                    yield piece
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for trip in trips:  # legs still open: the request ended early
                self.tracing.end(
                    trip.span,
                    {GEN_AI_OUTPUT_TOKENS: len(trip.ids) - trip.base},
                    error="ended early",
                )
                trip.span = None

    def _leg_done(self, out: Accounting, trip: _Trip, failure: NodeFailure | None = None) -> None:
        """A decode leg of one sample ended (complete, or its node failed): its tokens, and its
        span (a leg `_open_leg` opened: sample 0's first, any sample's migrated ones) with them."""
        if trip.index == 0:  # the record's leg_tokens are sample 0's
            out.leg_tokens.append(len(trip.ids) - trip.base)
        self.tracing.end(
            trip.span,
            {GEN_AI_OUTPUT_TOKENS: len(trip.ids) - trip.base},
            error=failure.reason if failure is not None else None,
        )
        trip.span = None

    async def _migrate_sample(
        self,
        request: Request,
        job: Attempt,
        out: Accounting,
        touched: _Touched,
        trip: _Trip,
        failure: NodeFailure,
        queue: asyncio.Queue[tuple[int, NodeCompletionChunk | BaseException | None]],
    ) -> None:
        """One sample of n > 1 moves to another node; its pieces join the queue from there."""
        try:
            _, sample, head = await self._migrate(request, job, out, touched, trip, failure)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await queue.put((trip.index, e))
            return
        await sample.pump(queue, head)

    def _pieces(
        self, i: int, chunk: NodeCompletionChunk, out: Accounting, trip: _Trip | None = None
    ) -> list[Piece]:
        """The chunk's pieces; its tokens counted (and, for a migratable stream, remembered)."""
        pieces = []
        for c in chunk.choices:
            n = len(c.token_ids or ())
            if n and out.first_token_at is None:
                out.first_token_at = time.monotonic()
            out.completion_tokens[i] = out.completion_tokens.get(i, 0) + n
            unsent = n
            if trip is not None:
                trip.add(c)
                unsent, trip.unsent = trip.unsent + n, 0
            if c.text or c.finish_reason or c.logprobs:
                pieces.append(
                    Piece(
                        index=i,
                        text=c.text,
                        finish_reason=c.finish_reason,
                        logprobs=c.logprobs,
                        tokens=unsent,
                    )
                )
            elif trip is not None:  # nothing to show yet: its tokens go with the next piece
                trip.unsent = unsent
        if chunk.usage is not None:
            # A migrated leg reports its own new tokens, and the original prompt's tokens and
            # cached tokens (node/responder.py: the streamed ids it re-prefilled are neither):
            # the prompt is billed once, with the answering leg's cache hits — the leg that
            # died never reported its own.
            base = trip.base if trip is not None else 0
            out.completion_tokens[i] = base + chunk.usage.completion_tokens
            if i == 0:
                out.prompt_tokens = chunk.usage.prompt_tokens
                out.cached_tokens = (chunk.usage.prompt_tokens_details or {}).get(
                    "cached_tokens", 0
                )
        return pieces


#: a decode leg once started: (node url, its stream, the first chunk read)
_Started = tuple[str, "_Sample", tuple[NodeCompletionChunk, bool]]


@dataclass
class _Trip:
    """A sample's journey across nodes (sample 0's unless `index`): what it streamed so far (the ids and the characters the
    client has), the nodes excluded, and its migrations."""

    t0: float
    ids: list[int] = field(default_factory=list)
    chars: int = 0
    finished: bool = False
    #: tokens streamed before the current leg
    base: int = 0
    migrations: int = 0
    node_id: str = ""
    #: (url, request id) of the current decode leg
    leg: tuple[str, str] = ("", "")
    exclude: list[str] = field(default_factory=list)
    resume: Resume | None = None
    #: which sample of the request (n > 1) this trip is, and its seed (None: the request's)
    index: int = 0
    seed: int | None = None
    #: why the current leg ended early (None: it ended complete)
    failure: NodeFailure | None = None
    #: the current decode leg's span (None when tracing is off)
    span: Any = None
    #: tokens streamed whose deltas showed nothing yet (no text): the next piece delivers them
    unsent: int = 0

    def add(self, c: CompletionChoice) -> None:
        self.ids.extend(c.token_ids or ())
        self.chars += len(c.text)
        self.finished = self.finished or c.finish_reason is not None


class _Sample:
    """One node stream (one sample) on one node, with its load counted while it runs."""

    def __init__(
        self,
        backend: ClusterBackend,
        url: str,
        request_id: str,
        index: int,
        body: NodeCompletionRequest,
    ) -> None:
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

    async def chunks(
        self, head: tuple[NodeCompletionChunk, bool] | None
    ) -> AsyncIterator[tuple[NodeCompletionChunk, bool]]:
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

    async def pump(
        self,
        queue: asyncio.Queue[tuple[int, NodeCompletionChunk | BaseException | None]],
        head: tuple[NodeCompletionChunk, bool] | None,
    ) -> None:
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
    return MidStreamError(
        502,
        f"the decode node failed mid-stream: {e}",
        type_="upstream_error",
        code="upstream_failed_midstream",
    )
