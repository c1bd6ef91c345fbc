"""Serving one `/v1/chat/completions` or `/v1/completions` request, start to end.

auth → parse/validate → model → tier → tokenize (chat template) → reserve quota (store) →
tier admission → backend stream → relay → settle + usage record.

Invariants:
- the reservation is settled exactly once, in `finally`, whatever happens (an exception, the
  client leaving, a shed request): no reservation leaks;
- the usage record is committed before the response's finishing chunks (those carrying a
  `finish_reason`), the usage chunk and `[DONE]` go out — or before the JSON body — so a
  response a client saw whole always has its record;
- the request id is the gateway's own (`req-…`), never the client's: it names engine
  requests on shared nodes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from aiohttp import web

from gateway.auth import authenticate
from gateway.backend import Job, MidStreamError, Outcome, Piece
from gateway.pricing import cost_usd, worst_case_usd
from gateway.requests import Parsed, parse_chat, parse_completion
from gateway.responses import DONE, Formatter, sse, usage
from gateway.state import GatewayState, ServedModel
from gateway.store.base import (
    ApiKey,
    RateState,
    Refusal,
    ReserveRequest,
    Settlement,
    Team,
    UsageRecord,
)
from protocol.openai import APIError
from protocol.tokenizer import ChatTemplateError

log = logging.getLogger("duet.gateway")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: prompts longer than this (characters) are tokenized off the event loop
_BIG_PROMPT = 16_384


class RateLimited(APIError):
    def __init__(self, refusal: Refusal) -> None:
        code = "budget_exceeded" if refusal.kind.endswith("budget") else "rate_limit_exceeded"
        super().__init__(429, refusal.message, type_="rate_limit_error" if code == "rate_limit_exceeded"
                         else "insufficient_quota", code=code, param=refusal.kind)  # fmt: skip
        self.headers = {**rate_headers(refusal.rate), "Retry-After": str(max(1, math.ceil(refusal.retry_after_s)))}


def _reset(s: float) -> str:
    return f"{s:.3f}s" if s < 60 else f"{int(s // 60)}m{s % 60:.0f}s"


def rate_headers(r: RateState) -> dict[str, str]:
    h = {}
    if r.limit_requests is not None:
        h.update({"x-ratelimit-limit-requests": str(r.limit_requests),
                  "x-ratelimit-remaining-requests": str(max(0, r.remaining_requests or 0)),
                  "x-ratelimit-reset-requests": _reset(r.reset_requests_s)})  # fmt: skip
    if r.limit_tokens is not None:
        h.update({"x-ratelimit-limit-tokens": str(r.limit_tokens),
                  "x-ratelimit-remaining-tokens": str(max(0, r.remaining_tokens or 0)),
                  "x-ratelimit-reset-tokens": _reset(r.reset_tokens_s)})  # fmt: skip
    return h


TIER_ALIASES = {"interactive": "interactive", "batch": "batch", "priority": "interactive", "flex": "batch"}


def resolve_tier(header: str | None, service_tier: str | None, default: str) -> str:
    if header is not None:
        if header not in ("interactive", "batch"):
            raise APIError(400, f"x-duet-tier must be 'interactive' or 'batch', got {header!r}", param="x-duet-tier")
        return header
    if service_tier is None or service_tier in ("auto", "default"):
        return default
    if service_tier not in TIER_ALIASES:
        raise APIError(400, f"service_tier must be one of auto, default, interactive, batch, priority, flex; "
                            f"got {service_tier!r}", param="service_tier")  # fmt: skip
    return TIER_ALIASES[service_tier]


async def prompt_ids(served: ServedModel, p: Parsed) -> list[int]:
    tok = served.tokenizer
    if tok is None:
        return []
    try:
        if p.messages is not None:
            size = sum(len(m["content"]) for m in p.messages)
            enc = lambda: tok.encode_chat(p.messages)  # noqa: E731
        elif isinstance(p.prompt, str):
            size = len(p.prompt)
            enc = lambda: tok.encode(p.prompt)  # type: ignore[arg-type]  # noqa: E731
        else:
            ids = list(p.prompt or [])
            bad = [t for t in ids if not 0 <= t < tok.vocab_size]
            if bad:
                raise APIError(400, f"prompt token ids out of the vocabulary (size {tok.vocab_size}): {bad[:5]}",
                               param="prompt")  # fmt: skip
            return ids
        return await asyncio.to_thread(enc) if size > _BIG_PROMPT else enc()
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


def estimate_tokens(p: Parsed) -> int:
    """Prompt tokens of a request no local tokenizer can count (external models): one token
    per 3 characters over-counts English for common tokenizers, so the reservation holds."""
    if p.messages is not None:
        return sum(len(m["content"]) // 3 + 4 for m in p.messages) + 3
    return len(p.prompt) if isinstance(p.prompt, list) else len(p.prompt or "") // 3 + 1


def context_check(served: ServedModel, n_prompt: int, max_tokens: int | None) -> int:
    """The max_tokens to use; 400 when the prompt (+ max_tokens) does not fit the context."""
    limit = served.max_model_len
    if max_tokens is None:
        max_tokens = min(served.config.default_max_tokens, limit - n_prompt)
    if n_prompt + max(max_tokens, 1) > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but {n_prompt + max_tokens} "
                            f"were requested ({n_prompt} in the prompt, {max_tokens} for the completion)",
                       param="messages" if max_tokens <= 0 else "max_tokens", code="context_length_exceeded")  # fmt: skip
    return max_tokens


@dataclass
class _Ctx:
    state: GatewayState
    served: ServedModel
    parsed: Parsed
    record: UsageRecord
    out: Outcome
    reservation_id: str
    t0: float
    #: the batch discount (1.0: the model's prices)
    price_factor: float = 1.0
    settled: bool = False

    def fill(self, status: str) -> Settlement:
        r, o = self.record, self.out
        r.status = status
        r.prompt_tokens = o.prompt_tokens or r.prompt_tokens
        r.completion_tokens = o.total_completion_tokens
        r.cached_tokens = o.cached_tokens
        served = bool(o.nodes) or o.first_token_at is not None
        # A request no node served (refused by a node, shed, every try failed) costs nothing.
        r.cost_usd = cost_usd(self.served.config, r.prompt_tokens, r.completion_tokens,
                              r.cached_tokens) * self.price_factor if served else 0.0  # fmt: skip
        r.ttft_s = (o.first_token_at - self.t0) if o.first_token_at is not None else None
        r.latency_s = time.monotonic() - self.t0
        r.nodes = list(o.nodes)
        r.model_used = o.model_used or r.model_used
        r.created_at = time.time()
        return Settlement(self.reservation_id, r, window_tokens=None if served else 0)

    def observe(self) -> None:
        r, m = self.record, self.state.metrics
        log.info("%s team=%s model=%s tier=%s status=%s prompt=%d cached=%d completion=%d cost=$%.6f ttft=%s "
                 "latency=%.3fs nodes=%s", r.request_id, r.team_id, r.model_requested, r.tier, r.status,
                 r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.cost_usd,
                 f"{r.ttft_s:.3f}s" if r.ttft_s is not None else "-", r.latency_s, ",".join(r.nodes) or "-")  # fmt: skip
        m.requests.labels(team=r.team_id, model=r.model_requested, tier=r.tier, status=r.status).inc()
        m.spend.labels(team=r.team_id, model=r.model_requested).inc(r.cost_usd)
        m.tokens.labels(team=r.team_id, model=r.model_requested, kind="prompt").inc(r.prompt_tokens)
        m.tokens.labels(team=r.team_id, model=r.model_requested, kind="completion").inc(r.completion_tokens)
        m.e2e.labels(model=r.model_requested).observe(r.latency_s)
        if r.ttft_s is not None:
            m.ttft.labels(model=r.model_requested).observe(r.ttft_s)

    async def commit(self, status: str) -> None:
        s = self.fill(status)
        self.settled = True
        self.observe()
        await self.state.writer.commit(s)

    def submit(self, status: str) -> None:
        s = self.fill(status)
        self.settled = True
        self.observe()
        self.state.writer.submit(s)


async def handle(state: GatewayState, request: web.Request, endpoint: str, request_id: str) -> web.StreamResponse:
    t0 = time.monotonic()
    key, team = await authenticate(state, request)
    raw = await request.read()
    return await run(state, key, team, raw, endpoint, request_id, request=request,
                     tier_header=request.headers.get("x-duet-tier"), t0=t0)  # fmt: skip


async def run(state: GatewayState, key: ApiKey, team: Team, raw: bytes, endpoint: str, request_id: str, *,
              request: web.Request | None = None, tier_header: str | None = None, price_factor: float = 1.0,
              t0: float | None = None) -> web.StreamResponse:  # fmt: skip
    """One request of an authenticated caller: what the HTTP handlers and the batch executor
    (gateway/batch_wiring.py; no `request`, so no streaming) both call. `price_factor`
    scales the reservation and the recorded cost (the batch discount)."""
    t0 = time.monotonic() if t0 is None else t0
    parsed = parse_chat(raw) if endpoint == "chat" else parse_completion(raw)
    if parsed.stream and request is None:
        raise APIError(400, "stream is not supported here", param="stream")
    served = state.models.get(parsed.model)
    if served is None:
        raise APIError(404, f"the model {parsed.model!r} does not exist (served: {', '.join(sorted(state.models))})",
                       param="model", code="model_not_found")  # fmt: skip
    tier = resolve_tier(tier_header, parsed.service_tier, team.default_tier)
    ids = await prompt_ids(served, parsed)
    if served.tokenizer is not None:
        n_prompt = len(ids)
        max_tokens = context_check(served, n_prompt, parsed.max_tokens)
    else:  # an external model: its provider counts; reserve on a generous estimate
        n_prompt = estimate_tokens(parsed)
        max_tokens = parsed.max_tokens or served.config.default_max_tokens
    m = served.config
    reserve = ReserveRequest(team_id=team.id, key_id=key.id, request_id=request_id,
                             tokens=n_prompt + parsed.n * max_tokens,
                             cost_usd=worst_case_usd(m, n_prompt, parsed.n * max_tokens) * price_factor,
                             ttl_s=state.config.quotas.reservation_ttl_s)  # fmt: skip
    res = await state.store.reserve(reserve)
    if isinstance(res, Refusal):
        state.metrics.rejections.labels(team=team.id, kind=res.kind).inc()
        log.info("%s: team %s refused (%s): %s", request_id, team.id, res.kind, res.message)
        raise RateLimited(res)
    headers = {**rate_headers(res.rate), "X-Request-Id": request_id, "x-duet-tier": tier}
    record = UsageRecord(request_id=request_id, team_id=team.id, key_id=key.id, model_requested=parsed.model,
                         model_used=parsed.model, tier=tier, status="error", prompt_tokens=len(ids),
                         endpoint=endpoint)  # fmt: skip
    ctx = _Ctx(state, served, parsed, record, Outcome(prompt_tokens=len(ids)), res.id, t0, price_factor)
    try:
        async with state.admission.slot(tier):
            job = Job(request_id=request_id, model=m, endpoint=endpoint, prompt_ids=ids, messages=parsed.messages,
                      params={**parsed.params, "max_tokens": max_tokens}, n=parsed.n, tier=tier,
                      prompt=parsed.prompt)  # fmt: skip
            fmt = Formatter(endpoint, request_id, parsed.model, tier)
            if parsed.stream:
                assert request is not None
                return await _stream(ctx, request, job, fmt, headers)
            return await _whole(ctx, job, fmt, headers)
    except APIError as e:
        if not ctx.settled:
            ctx.submit("shed" if e.status == 503 and e.code == "overloaded" else "error")
        raise
    except asyncio.CancelledError:
        if not ctx.settled:
            ctx.submit("client_disconnected")
        raise
    finally:
        if not ctx.settled:
            ctx.submit("error")


def _usage(ctx: _Ctx) -> object:
    o = ctx.out
    return usage(o.prompt_tokens, o.total_completion_tokens, o.cached_tokens)


async def _whole(ctx: _Ctx, job: Job, fmt: Formatter, headers: dict[str, str]) -> web.Response:
    texts: dict[int, list[str]] = {i: [] for i in range(job.n)}
    finish: dict[int, str | None] = {}
    it = ctx.served.backend.stream(job, ctx.out)
    try:
        async for p in it:
            texts[p.index].append(p.text)
            if p.finish_reason:
                finish[p.index] = p.finish_reason
    except MidStreamError as e:
        await ctx.commit("error_midstream")
        raise APIError(502, f"the answer broke off: {e.message}", type_="upstream_error", code=e.code) from None
    finally:
        await it.aclose()  # type: ignore[attr-defined]  # now, not at GC: it aborts on the nodes
    await ctx.commit("ok")
    body = fmt.body(texts, finish, _usage(ctx))  # type: ignore[arg-type]
    return web.Response(body=body, content_type="application/json",
                        headers={**headers, "x-duet-cost-usd": f"{ctx.record.cost_usd:.8f}"})  # fmt: skip


async def _stream(ctx: _Ctx, request: web.Request, job: Job, fmt: Formatter,
                  headers: dict[str, str]) -> web.StreamResponse:  # fmt: skip
    resp: web.StreamResponse | None = None
    held: list[Piece] = []  # finishing chunks wait for the usage record's commit
    it = ctx.served.backend.stream(job, ctx.out)
    try:
        async for p in it:
            if resp is None:  # errors before the first piece are plain HTTP errors
                resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
                await resp.prepare(request)
            if p.finish_reason:
                held.append(p)
            else:
                await resp.write(fmt.chunk(p))
    except MidStreamError as e:
        await it.aclose()  # type: ignore[attr-defined]
        await ctx.commit("error_midstream")
        assert resp is not None
        log.warning("%s: mid-stream failure: %s", job.request_id, e.message)
        await resp.write(sse(e.body()))
        await resp.write(DONE)
        return resp
    except BaseException:
        await it.aclose()  # type: ignore[attr-defined]  # now, not at GC: it aborts on the nodes
        raise
    await ctx.commit("ok")
    if resp is None:
        resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await resp.prepare(request)
    for p in held:
        await resp.write(fmt.chunk(p))
    if ctx.parsed.include_usage:
        await resp.write(fmt.usage_chunk(_usage(ctx)))  # type: ignore[arg-type]
    await resp.write(DONE)
    return resp
