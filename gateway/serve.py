"""Serving one `/v1/chat/completions` or `/v1/completions` request, start to end.

auth → parse/validate → model → tier → tokenize (chat template) → reserve quota (store) →
tier admission → backend stream → relay → settle + usage record. `model: "auto"` picks the
model first (choice.py); a fallback trigger before the first piece (pool saturated, no healthy
node, open breaker, provider 5xx/429) moves the request along its model's fallback chain
(`_serve`). The response names the model that answered (`model`, `x-duet-model-used`); the usage
record holds it and its cost at that model's prices.

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
from gateway.config import AUTO, TeamPolicy, Tier
from gateway.pricing import cost_usd, worst_case_usd
from gateway.providers.fallback import FallbackDecision, Reason
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
from protocol.openai import APIError, CompletionLogprobs
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
        log.info("%s team=%s model=%s used=%s tier=%s status=%s prompt=%d cached=%d completion=%d cost=$%.6f ttft=%s "
                 "latency=%.3fs nodes=%s", r.request_id, r.team_id, r.model_requested, r.model_used, r.tier, r.status,
                 r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.cost_usd,
                 f"{r.ttft_s:.3f}s" if r.ttft_s is not None else "-", r.latency_s, ",".join(r.nodes) or "-")  # fmt: skip
        m.requests.labels(team=r.team_id, model=r.model_requested, tier=r.tier, status=r.status).inc()
        # spend and tokens go to the model that served (a fallback is paid at its prices)
        m.spend.labels(team=r.team_id, model=r.model_used).inc(r.cost_usd)
        m.tokens.labels(team=r.team_id, model=r.model_used, kind="prompt").inc(r.prompt_tokens)
        m.tokens.labels(team=r.team_id, model=r.model_used, kind="completion").inc(r.completion_tokens)
        m.e2e.labels(model=r.model_requested).observe(r.latency_s)
        if r.ttft_s is not None:
            m.ttft.labels(model=r.model_requested).observe(r.ttft_s)

    async def commit(self, status: str) -> None:
        s = self.fill(status)
        self.settled = True
        # metrics and the log line once the answer's last bytes are out, not before them
        asyncio.get_running_loop().call_soon(self.observe)
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
    tier = resolve_tier(tier_header, parsed.service_tier, team.default_tier)
    policy = state.config.team_policy(team.id)
    headers: dict[str, str] = {}
    if parsed.model == AUTO and state.choice is not None and state.choice.router is not None:
        served = _auto(state, parsed, tier, policy, headers)
    else:
        found = state.models.get(parsed.model)
        if found is None:
            served_names = sorted(state.models) + ([AUTO] if state.config.auto is not None else [])
            raise APIError(404, f"the model {parsed.model!r} does not exist (served: {', '.join(served_names)})",
                           param="model", code="model_not_found")  # fmt: skip
        if parsed.model in policy.forbid:
            raise APIError(403, f"team {team.id!r} may not use model {parsed.model!r}", type_="permission_error",
                           param="model", code="model_forbidden")  # fmt: skip
        served = found
    ids, n_prompt, max_tokens = await _measure(served, parsed)
    m = served.config
    reserve = ReserveRequest(team_id=team.id, key_id=key.id, request_id=request_id,
                             tokens=n_prompt + parsed.n * max_tokens,
                             cost_usd=_worst_case(state, m.name, n_prompt, parsed.n * max_tokens) * price_factor,
                             ttl_s=state.config.quotas.reservation_ttl_s)  # fmt: skip
    res = await state.store.reserve(reserve)
    if isinstance(res, Refusal):
        state.metrics.rejections.labels(team=team.id, kind=res.kind).inc()
        log.info("%s: team %s refused (%s): %s", request_id, team.id, res.kind, res.message)
        raise RateLimited(res)
    headers.update({**rate_headers(res.rate), "X-Request-Id": request_id, "x-duet-tier": tier})
    record = UsageRecord(request_id=request_id, team_id=team.id, key_id=key.id, model_requested=parsed.model,
                         model_used=m.name, tier=tier, status="error", prompt_tokens=len(ids),
                         endpoint=endpoint, user=parsed.user)  # fmt: skip
    ctx = _Ctx(state, served, parsed, record, Outcome(prompt_tokens=len(ids)), res.id, t0, price_factor)
    try:
        return await _serve(ctx, request, _Plan(endpoint, tier, policy, n_prompt, ids, max_tokens), headers)
    except APIError as e:
        if not ctx.settled:
            ctx.submit("shed" if e.status == 503 and e.code == "overloaded" else "error")
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        # The client left: its handler is cancelled, or — when a write to it fails first —
        # the write raises (aiohttp's ClientConnectionResetError is a ConnectionResetError).
        if not ctx.settled:
            ctx.submit("client_disconnected")
        raise
    finally:
        if not ctx.settled:
            ctx.submit("error")


def _auto(state: GatewayState, p: Parsed, tier: str, policy: TeamPolicy, headers: dict[str, str]) -> ServedModel:
    """The model `auto` picks for this request (its label goes out in `x-duet-auto-label`)."""
    assert state.choice is not None
    if p.messages is not None:
        messages = p.messages
    elif isinstance(p.prompt, str):
        messages = [{"role": "user", "content": p.prompt}]
    else:
        raise APIError(400, "model 'auto' needs a text prompt (token ids belong to one model's tokenizer)",
                       param="prompt")  # fmt: skip
    c = state.choice.auto(messages, endpoint=p.endpoint, n=p.n, tier=tier, policy=policy,  # type: ignore[arg-type]
                          prompt_tokens=estimate_tokens(p), max_tokens=p.max_tokens)  # fmt: skip
    if c.model is None:
        why = "; ".join(f"{m}: {r}" for m, r in c.skipped)
        unavailable = any(r == "unavailable" for _, r in c.skipped)
        raise APIError(503 if unavailable else 400, f"model 'auto': no model can take this request ({why})",
                       type_="service_unavailable" if unavailable else "invalid_request_error", param="model",
                       code="no_model_available")  # fmt: skip
    headers["x-duet-auto-label"] = c.label
    log.debug("auto: label=%s → %s (%s)", c.label, c.model, c.reason)
    return state.models[c.model]


async def _measure(served: ServedModel, p: Parsed) -> tuple[list[int], int, int]:
    """(prompt ids, prompt tokens, max_tokens) of `p` on `served`."""
    ids = await prompt_ids(served, p)
    if served.tokenizer is not None:
        return ids, len(ids), context_check(served, len(ids), p.max_tokens)
    # an external model: its provider counts; reserve on a generous estimate
    return ids, estimate_tokens(p), p.max_tokens or served.config.default_max_tokens


def _worst_case(state: GatewayState, model: str, prompt: int, completion: int) -> float:
    """The reservation's cost: the dearest model the request may end on (its fallback chain)."""
    names = [model, *(state.choice.chains.chains.get(model, ()) if state.choice else ())]
    return max(worst_case_usd(state.models[n].config, prompt, completion) for n in names if n in state.models)


@dataclass(frozen=True)
class _Plan:
    endpoint: str
    tier: str
    policy: TeamPolicy
    #: prompt tokens as first counted (fallback targets must fit them)
    n_prompt: int
    ids: list[int]
    max_tokens: int


async def _serve(ctx: _Ctx, request: web.Request, plan: _Plan, headers: dict[str, str]) -> web.StreamResponse:
    """Serve on the chosen model; a fallback trigger before the first piece moves the request
    to the next model of the chain (counted, logged), until one answers or the chain is dry."""
    state, parsed = ctx.state, ctx.parsed
    origin = ctx.served.config.name
    tried: list[str] = []
    ids, max_tokens = plan.ids, plan.max_tokens
    tier: Tier = plan.tier  # type: ignore[assignment]

    def next_model(reason: Reason) -> FallbackDecision:
        assert state.choice is not None
        return state.choice.next(origin, reason, endpoint=plan.endpoint, n=parsed.n, tier=tier, policy=plan.policy,
                                 prompt_tokens=plan.n_prompt, max_tokens=parsed.max_tokens, tried=tried)  # fmt: skip

    while True:
        served = ctx.served
        name = served.config.name
        try:
            if tried:  # a fallback target counts and checks the prompt its own way
                ids, _, max_tokens = await _measure(served, parsed)
            ctx.out = Outcome(prompt_tokens=len(ids))
            ctx.record.model_used, ctx.record.prompt_tokens = name, len(ids)
            job = Job(request_id=ctx.record.request_id, model=served.config, endpoint=plan.endpoint, prompt_ids=ids,
                      messages=parsed.messages, params={**parsed.params, "max_tokens": max_tokens}, n=parsed.n,
                      tier=tier, prompt=parsed.prompt, stream=parsed.stream)  # fmt: skip
            fmt = Formatter(plan.endpoint, ctx.record.request_id, name, tier)
            h = {**headers, "x-duet-model-used": name}
            if served.config.kind != "cluster":  # the tier queues guard the self-hosted pool only
                return await _respond(ctx, request, job, fmt, h)
            wait = None
            if tier == "interactive" and state.choice is not None and state.choice.has_chain(origin) \
                    and next_model(Reason.SATURATED).to_model is not None:  # fmt: skip
                wait = state.config.tiers.interactive_fallback_wait_s
            async with state.admission.slot(tier, wait):
                return await _respond(ctx, request, job, fmt, h)
        except APIError as e:
            if ctx.settled or isinstance(e, MidStreamError) or ctx.out.first_token_at is not None \
                    or state.choice is None or not state.choice.has_chain(origin):  # fmt: skip
                raise
            reason = state.choice.trigger(e, served, tier)
            if reason is None:
                raise
            tried.append(name)
            d = next_model(reason)
            if state.provider_metrics is not None:  # "from": the model that could not answer
                state.provider_metrics.count_fallback(name, d.to_model, d.reason)
            if d.to_model is None:
                log.warning("%s: %s failed (%s: %s); no fallback left%s", ctx.record.request_id, name, reason,
                            e.message, f" (skipped {dict(d.skipped)})" if d.skipped else "")  # fmt: skip
                raise
            log.info("%s: %s → %s (%s: %s)", ctx.record.request_id, name, d.to_model, reason, e.message)
            ctx.served = state.models[d.to_model]


async def _respond(ctx: _Ctx, request: web.Request, job: Job, fmt: Formatter,
                   headers: dict[str, str]) -> web.StreamResponse:  # fmt: skip
    if job.stream:
        return await _stream(ctx, request, job, fmt, headers)
    return await _whole(ctx, job, fmt, headers)


def _usage(ctx: _Ctx) -> object:
    o = ctx.out
    return usage(o.prompt_tokens, o.total_completion_tokens, o.cached_tokens)


async def _whole(ctx: _Ctx, job: Job, fmt: Formatter, headers: dict[str, str]) -> web.Response:
    texts: dict[int, list[str]] = {i: [] for i in range(job.n)}
    finish: dict[int, str | None] = {}
    logprobs: dict[int, list[CompletionLogprobs]] = {}
    it = ctx.served.backend.stream(job, ctx.out)
    try:
        async for p in it:
            texts[p.index].append(p.text)
            if p.logprobs is not None:
                logprobs.setdefault(p.index, []).append(p.logprobs)
            if p.finish_reason:
                finish[p.index] = p.finish_reason
    except MidStreamError as e:
        await ctx.commit("error_midstream")
        raise APIError(502, f"the answer broke off: {e.message}", type_="upstream_error", code=e.code) from None
    finally:
        await it.aclose()  # type: ignore[attr-defined]  # now, not at GC: it aborts on the nodes
    await ctx.commit("ok")
    body = fmt.body(texts, finish, _usage(ctx), logprobs or None)  # type: ignore[arg-type]
    return web.Response(body=body, content_type="application/json",
                        headers={**headers, "x-duet-cost-usd": f"{ctx.record.cost_usd:.8f}"})  # fmt: skip


class _EventStream(web.StreamResponse):
    """An SSE response whose headers leave with its first chunk, in one send (aiohttp's
    StreamResponse sends them at `prepare()`, a send of their own). It is prepared only when
    the first chunk is in hand, so holding the headers delays nothing; the client wakes once
    for its first token instead of twice. (`web.Response` sets the same class attribute.)"""

    _send_headers_immediately = False


async def _stream(ctx: _Ctx, request: web.Request, job: Job, fmt: Formatter,
                  headers: dict[str, str]) -> web.StreamResponse:  # fmt: skip
    resp: web.StreamResponse | None = None
    held: list[Piece] = []  # finishing chunks wait for the usage record's commit
    pending: list[bytes] = []  # chunks whose successor has already arrived: one write for all
    it = ctx.served.backend.stream(job, ctx.out)
    try:
        async for p in it:
            if resp is None:  # errors before the first piece are plain HTTP errors
                resp = _EventStream(headers={**SSE_HEADERS, **headers})
                await resp.prepare(request)
            if p.finish_reason:
                held.append(p)
                continue
            pending.append(fmt.chunk(p))
            if not p.more:
                await resp.write(pending[0] if len(pending) == 1 else b"".join(pending))
                pending.clear()
    except MidStreamError as e:
        await it.aclose()  # type: ignore[attr-defined]
        await ctx.commit("error_midstream")
        assert resp is not None
        log.warning("%s: mid-stream failure: %s", job.request_id, e.message)
        await resp.write_eof(b"".join([*pending, sse(e.body()), DONE]))
        return resp
    except BaseException:
        await it.aclose()  # type: ignore[attr-defined]  # now, not at GC: it aborts on the nodes
        raise
    await ctx.commit("ok")
    if resp is None:
        resp = _EventStream(headers={**SSE_HEADERS, **headers})
        await resp.prepare(request)
    # The finishing chunks, the usage chunk, [DONE] and the body's end leave in one send (not
    # five): a client that stops reading at [DONE] then finds the body ended and can keep its
    # connection for the next request.
    tail = [*pending, *(fmt.chunk(p) for p in held)]
    if ctx.parsed.include_usage:
        tail.append(fmt.usage_chunk(_usage(ctx)))  # type: ignore[arg-type]
    tail.append(DONE)
    await resp.write_eof(b"".join(tail))
    return resp
