"""Serving one `/v1/chat/completions` or `/v1/completions` request: parse → choose → attempt →
fallback.

auth (the HTTP handler) → parse and check (`requests.Request`) → tier → model (`auto` picks
one: choice.py) → measure (tokenize with the chat template, fit the context: measure.py) →
reserve quota (`ledger.Ledger`) → tier admission (backends that use the tier queues) →
`Backend.open(request, attempt)` → relay (relay.py) → settle. A fallback trigger before the
first piece (pool saturated, no healthy node, open breaker, provider 5xx/429) moves the request
along its model's fallback chain (`_Tries`). The answer names the model that answered
(`model`, `x-duet-model-used`); the usage record holds it and its cost at that model's prices.

`run` returns a typed `Answer`: the HTTP handlers render it, the batch executor reads it as it
is. A streamed answer went to the `EventSink` already (its `Answer.body` is None).

Invariants:
- the ledger settles exactly once, whatever happens (an exception, the client leaving, a shed
  request): no reservation leaks;
- the request id is the gateway's own (`req-…`), never the client's: it names engine requests
  on shared nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field

import msgspec

from gateway.accounts.ledger import Caller, Ledger, Order, UsageStatus
from gateway.backends.base import Accounting, Attempt, MidStreamError, Reply, ServedModel
from gateway.backends.providers.fallback import FallbackDecision, Reason
from gateway.config import AUTO, TeamPolicy, Tier
from gateway.serving.choice import Need
from gateway.serving.features import features, refuse_missing
from gateway.serving.measure import Measured, estimate_tokens, measure
from gateway.serving.openai_format import Formatter
from gateway.serving.relay import EventSink, relay_stream, relay_whole
from gateway.serving.requests import Endpoint, Request, parse_chat, parse_completion
from gateway.serving.spans import client_span
from gateway.serving.tiers import team_tier
from gateway.serving.tool_reply import with_tool_calls
from gateway.state import GatewayState
from gateway.tools.plan import ToolMode, ToolPlan
from protocol.openai import APIError
from runtime.tracing import (
    GEN_AI_CHOICE_COUNT,
    GEN_AI_FINISH_REASONS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_MAX_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_PROVIDER,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_RESPONSE_ID,
    GEN_AI_RESPONSE_MODEL,
)

log = logging.getLogger("duet.gateway")
_ENC = msgspec.json.Encoder()


@dataclass(frozen=True)
class Answer:
    """What a request got: a status, the JSON body's struct (None: streamed to the sink), and
    the headers (x-ratelimit-*, X-Request-Id, the tier, the model used, the cost)."""

    status: int
    body: object | None
    headers: dict[str, str] = field(default_factory=dict)


async def run(
    state: GatewayState,
    caller: Caller,
    raw: bytes,
    endpoint: Endpoint,
    *,
    tier_header: str | None = None,
    sink: EventSink | None = None,
) -> Answer:
    """One request of an authenticated caller: what the HTTP handlers and the batch executor
    (gateway/batch/wiring.py; no sink, so no streaming) both call."""
    req = parse_chat(raw) if endpoint == Endpoint.CHAT else parse_completion(raw)
    # the grammar engine's check of its constraint: off the event loop, bounded in time (a
    # pathological schema must not stall every other request; text/guide_compile.py)
    await state.guides.check(req.guide, req.guide_param or "response_format")
    if req.stream and sink is None:
        raise APIError(400, "stream is not supported here", param="stream")
    policy = state.config.team_policy(caller.team.id)
    tier = team_tier(tier_header, req.service_tier, caller.team, policy)
    headers: dict[str, str] = {}
    served = (
        _auto(state, req, tier, policy, headers)
        if _is_auto(state, req)
        else _named(state, req, caller, policy)
    )
    if served.config.kind == "embedding":
        raise APIError(
            400,
            f"{req.model!r} is an embedding model: use POST /v1/embeddings",
            param="model",
            code="wrong_model_kind",
        )
    refuse_missing(req, served.config)
    # Cheap refusals before the tokenizer spends CPU on the prompt (the store decides the rest).
    state.admission.check_team(caller.team, state.config.quotas.default_max_concurrent)
    with state.admission.teams.running(caller.team.id):
        return await _measured(state, caller, req, tier, policy, served, headers, sink)


async def _measured(
    state: GatewayState,
    caller: Caller,
    req: Request,
    tier: Tier,
    policy: TeamPolicy,
    served: ServedModel,
    headers: dict[str, str],
    sink: EventSink | None,
) -> Answer:
    """The rest of `run`, from tokenizing on."""
    tr = state.tracing
    tr.annotate(
        {
            GEN_AI_OPERATION: "chat" if req.endpoint == Endpoint.CHAT else "text_completion",
            GEN_AI_PROVIDER: "duet",
            GEN_AI_REQUEST_MODEL: req.model,
            "duet.request_id": caller.request_id,
            "duet.team": caller.team.id,
            "duet.tier": tier,
            "duet.stream": req.stream,
        }
    )
    with tr.span("gateway.tokenize", {GEN_AI_REQUEST_MODEL: served.config.name}) as span:
        size = await measure(served, req, state.guides)
        if span is not None:
            span.set_attribute(GEN_AI_INPUT_TOKENS, size.n_prompt)
    tr.annotate({GEN_AI_MAX_TOKENS: size.max_tokens})
    order = Order(
        endpoint=req.endpoint.value,
        model_requested=req.model,
        user=req.user,
        tier=tier,
        model=served.config,
        chain=state.choice.chain(served.config.name),
        prompt_tokens=size.n_prompt,
        counted_prompt_tokens=len(size.ids),
        completion_tokens=req.n * size.max_tokens,
    )
    with tr.span("gateway.quota.reserve", {"duet.team": caller.team.id}):
        ledger = await Ledger.reserve(state.books, caller, order)
    state.admission.teams.started(caller.team)
    headers.update({**ledger.headers, "X-Request-Id": caller.request_id, "x-duet-tier": tier})
    tries = _Tries(state, req, ledger, tier, policy)
    try:
        return await tries.run(served, size, headers, sink)
    except APIError as e:
        ledger.submit(
            UsageStatus.SHED if e.status == 503 and e.code == "overloaded" else UsageStatus.ERROR,
            tries.accounting,
        )
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        # The client left: its handler is cancelled, or — when a write to it fails first —
        # the write raises (aiohttp's ClientConnectionResetError is a ConnectionResetError).
        ledger.submit(UsageStatus.CLIENT_DISCONNECTED, tries.accounting)
        raise
    finally:
        ledger.submit(UsageStatus.ERROR, tries.accounting)  # a no-op once settled
        if tr.enabled:
            r = ledger.record
            tr.annotate(
                {
                    GEN_AI_RESPONSE_MODEL: r.model_used,
                    GEN_AI_INPUT_TOKENS: r.prompt_tokens,
                    GEN_AI_OUTPUT_TOKENS: r.completion_tokens,
                    "duet.cached_tokens": r.cached_tokens,
                    "duet.status": r.status,
                    "duet.cost_usd": r.cost_usd,
                    "duet.nodes": list(r.nodes),
                    "duet.migrations": r.migrations,
                    "duet.ttft_s": r.ttft_s if r.ttft_s is not None else -1.0,
                }
            )
            acc = tries.accounting
            if acc is not None and acc.finish_reasons:
                tr.annotate(
                    {
                        GEN_AI_FINISH_REASONS: [
                            acc.finish_reasons[i] for i in sorted(acc.finish_reasons)
                        ],
                        GEN_AI_RESPONSE_ID: tries.response_id,
                    }
                )


def _is_auto(state: GatewayState, req: Request) -> bool:
    return req.model == AUTO and state.choice.serves_auto


def _named(state: GatewayState, req: Request, caller: Caller, policy: TeamPolicy) -> ServedModel:
    found = state.models.get(req.model)
    if found is None:
        served_names = sorted(state.models) + ([AUTO] if state.config.auto is not None else [])
        raise APIError(
            404,
            f"the model {req.model!r} does not exist (served: {', '.join(served_names)})",
            param="model",
            code="model_not_found",
        )
    if req.model in policy.forbid:
        raise APIError(
            403,
            f"team {caller.team.id!r} may not use model {req.model!r}",
            type_="permission_error",
            param="model",
            code="model_forbidden",
        )
    return found


def _auto(
    state: GatewayState, req: Request, tier: Tier, policy: TeamPolicy, headers: dict[str, str]
) -> ServedModel:
    """The model `auto` picks for this request (its label goes out in `x-duet-auto-label`)."""
    if req.messages is not None:
        messages = req.messages
    elif isinstance(req.prompt, str):
        messages = [{"role": "user", "content": req.prompt}]
    else:
        raise APIError(
            400,
            "model 'auto' needs a text prompt (token ids belong to one model's tokenizer)",
            param="prompt",
        )
    c = state.choice.auto(
        messages,
        Need(
            req.endpoint, req.n, tier, policy, estimate_tokens(req), req.max_tokens, features(req)
        ),
    )
    if c.model is None:
        why = "; ".join(f"{m}: {r}" for m, r in c.skipped)
        unavailable = any(r == "unavailable" for _, r in c.skipped)
        raise APIError(
            503 if unavailable else 400,
            f"model 'auto': no model can take this request ({why})",
            type_="service_unavailable" if unavailable else "invalid_request_error",
            param="model",
            code="no_model_available",
        )
    headers["x-duet-auto-label"] = c.label
    log.debug("auto: label=%s → %s (%s)", c.label, c.model, c.reason)
    return state.models[c.model]


class _Tries:
    """The attempts of one request along its model's fallback chain; `accounting` is the
    current attempt's (what the ledger settles from when the request ends abnormally)."""

    def __init__(
        self, state: GatewayState, req: Request, ledger: Ledger, tier: Tier, policy: TeamPolicy
    ) -> None:
        self.state, self.req, self.ledger, self.tier, self.policy = state, req, ledger, tier, policy
        self.reply: Reply | None = None
        self.tried: list[str] = []
        #: the current attempt's tool handling (its model's format; None: no tools)
        self.tools: ToolPlan | None = None
        #: the current attempt's answer id (chatcmpl-…/cmpl-…), once it relays
        self.response_id = ""

    @property
    def accounting(self) -> Accounting | None:
        return self.reply.accounting if self.reply is not None else None

    def _next(self, origin: str, reason: Reason, n_prompt: int) -> FallbackDecision:
        need = Need(
            self.req.endpoint,
            self.req.n,
            self.tier,
            self.policy,
            n_prompt,
            self.req.max_tokens,
            features(self.req),
        )
        return self.state.choice.next(origin, reason, need, self.tried)

    async def run(
        self, served: ServedModel, size: Measured, headers: dict[str, str], sink: EventSink | None
    ) -> Answer:
        """Serve on `served`; a fallback trigger before the first piece moves the request to the
        next model of the chain (counted, logged), until one answers or the chain is dry."""
        origin, first = served.config.name, size
        while True:
            try:
                if self.tried:  # a fallback target counts and checks the prompt its own way
                    size = await measure(served, self.req, self.state.guides)
                return await self._attempt(
                    served,
                    size,
                    {**headers, "x-duet-model-used": served.config.name},
                    sink,
                    origin,
                    first.n_prompt,
                )
            except APIError as e:
                served = self._fallback(e, served, origin, first.n_prompt)

    async def _attempt(
        self,
        served: ServedModel,
        size: Measured,
        headers: dict[str, str],
        sink: EventSink | None,
        origin: str,
        n_prompt: int,
    ) -> Answer:
        state, rid = self.state, self.ledger.record.request_id
        self.ledger.attempt(served.config, len(size.ids))
        self.reply = None
        self.tools = size.tools
        # A batch line runs under one id however often it runs (its usage key: billed once); a
        # rerun may reach a node still holding the dead run's request of that id, and a node
        # refuses an id in use, so each run's legs get their own. The answer keeps `rid`.
        leg_rid = f"{rid}.{secrets.token_hex(3)}" if self.ledger.caller.idempotent else rid
        attempt = Attempt(
            request_id=leg_rid,
            model=served.config,
            prompt_ids=size.ids,
            max_tokens=size.max_tokens,
            tier=self.tier,
            cache_domain=state.config.cache_domain(self.ledger.caller.team.id),
            guide=self.req.guide or (size.tools.guide if size.tools else None),
        )
        if not served.backend.uses_tier_queues:  # the tier queues guard the self-hosted pool only
            return await self._respond(served, attempt, headers, sink)
        wait = None
        if (
            self.tier == "interactive"
            and state.choice.has_chain(origin)
            and self._next(origin, Reason.SATURATED, n_prompt).to_model is not None
        ):
            wait = state.config.tiers.interactive_fallback_wait_s
        async with state.admission.slot(self.tier, wait):
            return await self._respond(served, attempt, headers, sink)

    async def _respond(
        self, served: ServedModel, attempt: Attempt, headers: dict[str, str], sink: EventSink | None
    ) -> Answer:
        self.reply = reply = served.backend.open(self.req, attempt)
        if self.tools is not None and self.tools.mode != ToolMode.NONE:
            reply = with_tool_calls(reply, self.tools)
        fmt = Formatter(
            self.req.endpoint, self.ledger.record.request_id, served.config.name, self.tier
        )
        self.response_id = (
            fmt.id
        )  # the answer's id as the client gets it (the trace's gen_ai.response.id)
        traced = self.state.tracing.enabled  # off: no generator per request (bench.gateway's CPU)
        with self._inference(served, self.reply.accounting) if traced else contextlib.nullcontext():
            if self.req.stream:
                assert sink is not None
                await relay_stream(self.ledger, reply, fmt, sink, headers, self.req.include_usage)
                return Answer(200, None, headers)
            body = await relay_whole(self.ledger, reply, fmt, self.req.n)
        return Answer(
            200, body, {**headers, "x-duet-cost-usd": f"{self.ledger.record.cost_usd:.8f}"}
        )

    def _inference(
        self, served: ServedModel, acc: Accounting
    ) -> contextlib.AbstractContextManager[None]:
        """The GenAI inference span of this attempt (gateway/serving/spans.py: `chat {model}`, the
        model that answers and what it served; a fallback's first model ends with the trigger's
        code as its `error.type`)."""
        name = served.config.name

        def usage() -> dict[str, str | int] | None:
            if (
                not acc.served
            ):  # what a node or provider served (a model nobody reached served nothing)
                return None
            return {
                GEN_AI_RESPONSE_MODEL: acc.model_used or name,
                GEN_AI_INPUT_TOKENS: acc.prompt_tokens,
                GEN_AI_OUTPUT_TOKENS: acc.total_completion_tokens,
            }

        return client_span(
            self.state.tracing,
            "chat" if self.req.endpoint == Endpoint.CHAT else "text_completion",
            name,
            served.config.provider or "duet",
            {GEN_AI_CHOICE_COUNT: self.req.n} if self.req.n != 1 else None,
            usage,
        )

    def _fallback(
        self, e: APIError, served: ServedModel, origin: str, n_prompt: int
    ) -> ServedModel:
        """The next model to try after `e`, or `e` raised again (no fallback)."""
        state, name = self.state, served.config.name
        acc = self.accounting
        if (
            self.ledger.settled
            or isinstance(e, MidStreamError)
            or (acc is not None and acc.first_token_at is not None)
            or not state.choice.has_chain(origin)
        ):
            raise e
        reason = state.choice.trigger(e, served, self.tier)
        if reason is None:
            raise e
        self.tried.append(name)
        d = self._next(origin, reason, n_prompt)
        state.fallbacks.count_fallback(name, d.to_model, d.reason)  # from: the one that failed
        rid = self.ledger.record.request_id
        if d.to_model is None:
            log.warning(
                "%s: %s failed (%s: %s); no fallback left%s",
                rid,
                name,
                reason,
                e.message,
                f" (skipped {dict(d.skipped)})" if d.skipped else "",
            )
            raise e
        log.info("%s: %s → %s (%s: %s)", rid, name, d.to_model, reason, e.message)
        now = time.time_ns()
        state.tracing.record(
            "gateway.fallback",
            now,
            now,
            {
                "duet.fallback.from": name,
                "duet.fallback.to": d.to_model,
                "duet.fallback.reason": str(reason),
                "duet.error": e.message,
            },
        )
        return state.models[d.to_model]
