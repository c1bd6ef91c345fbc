"""A chat or completions request's tries along its model's fallback chain (the `Attempts` of
generate.py's call).

Each try is one `Attempt` (backends/base.py) on one model: it takes a tier admission slot when
its backend uses the tier queues (an interactive request with a usable fallback waits at most
`[tiers] interactive_fallback_wait_s`), opens the backend's `Reply`, parses a self-hosted
model's tool calls out of it (tool_reply.py), and relays it (relay.py): streamed into the
sink, or as one body. A fallback trigger before the first piece (pool saturated, no healthy
node, open breaker, provider 5xx/429) moves the request to the next model of the chain,
counted and logged; the answer names the model that answered (`x-duet-model-used`), and the
usage record holds it and its cost at that model's prices.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from gateway.accounts.ledger import Ledger
from gateway.accounts.usage import Accounting
from gateway.backends.base import Attempt, MidStreamError, Reply, ServedModel
from gateway.backends.providers.fallback import FallbackDecision, Reason
from gateway.serving.choice import Need
from gateway.serving.context import Serving
from gateway.serving.fair_queue import Claim, share_weight
from gateway.serving.features import features
from gateway.serving.measure import Measured, measure
from gateway.serving.openai_format import Formatter
from gateway.serving.pipeline import Admitted, Answer
from gateway.serving.relay import EventSink, Relay
from gateway.serving.requests import Endpoint, Request
from gateway.serving.spans import client_span
from gateway.serving.tool_reply import with_tool_calls
from gateway.tools.plan import ToolMode, ToolPlan
from protocol.openai import APIError
from runtime.tracing import (
    GEN_AI_CHOICE_COUNT,
    GEN_AI_FINISH_REASONS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_RESPONSE_ID,
    GEN_AI_RESPONSE_MODEL,
    Attrs,
)

log = logging.getLogger("duet.gateway")


class Tries:
    """The attempts of one request along its model's fallback chain; `accounting` is the
    current attempt's (what the ledger settles from when the request ends abnormally)."""

    def __init__(self, serving: Serving, req: Request, ledger: Ledger, a: Admitted) -> None:
        self.serving, self.req, self.ledger = serving, req, ledger
        self.tier, self.policy, self.headers = a.tier, a.policy, a.headers
        self.reply: Reply | None = None
        #: the current attempt's relay (what it sent to the client)
        self.relay: Relay | None = None
        self.tried: list[str] = []
        #: the current attempt's tool handling (its model's format; None: no tools)
        self.tools: ToolPlan | None = None
        #: the current attempt's answer id (chatcmpl-…/cmpl-…), once it relays
        self.response_id = ""

    @property
    def accounting(self) -> Accounting | None:
        return self.reply.accounting if self.reply is not None else None

    def settled(self) -> Attrs:
        sent = self.relay.sent if self.relay is not None else None
        if sent is None or not sent.finish_reasons:
            return {}
        reasons = [sent.finish_reasons[i] for i in sorted(sent.finish_reasons)]
        return {GEN_AI_FINISH_REASONS: reasons, GEN_AI_RESPONSE_ID: self.response_id}

    def _next(self, origin: str, reason: Reason, n_prompt: int) -> FallbackDecision:
        req = self.req
        need = Need(
            req.endpoint, req.n, self.tier, self.policy, n_prompt, req.max_tokens, features(req)
        )
        return self.serving.choice.next(origin, reason, need, self.tried)

    async def run(self, served: ServedModel, size: Measured, sink: EventSink | None) -> Answer:
        """Serve on `served`; a fallback trigger before the first piece moves the request to the
        next model of the chain (counted, logged), until one answers or the chain is dry."""
        origin, n_prompt = served.config.name, size.n_prompt
        while True:
            try:
                if self.tried:  # a fallback target counts and checks the prompt its own way
                    domain = self.serving.config.cache_domain(self.ledger.caller.team.id)
                    size = await measure(served, self.req, self.serving.guides, domain)
                return await self._attempt(served, size, sink, origin, n_prompt)
            except APIError as e:
                served = self._fallback(e, served, origin, n_prompt)

    async def _attempt(
        self, served: ServedModel, size: Measured, sink: EventSink | None, origin: str, n: int
    ) -> Answer:
        serving = self.serving
        self.ledger.attempt(served.config, len(size.ids))
        self.reply = self.relay = None
        self.tools = size.tools
        # A batch line, or a client's request under an Idempotency-Key, runs under one id however
        # often it runs (its usage key: billed once); each run's legs get their own (Caller.leg_id)
        attempt = Attempt(
            request_id=self.ledger.caller.leg_id(),
            model=served.config,
            prompt_ids=size.ids,
            max_tokens=size.max_tokens,
            tier=self.tier,
            cache_domain=serving.config.cache_domain(self.ledger.caller.team.id),
            guide=self.req.guide_on(served.config.closed_objects)
            or (size.tools.guide if size.tools else None),
            retain=size.retain,
            reserved_prompt_tokens=size.n_prompt,
        )
        headers = {**self.headers, "x-duet-model-used": served.config.name}
        if not served.generator().uses_tier_queues:  # they guard the self-hosted pool only
            return await self._respond(served, attempt, headers, sink)
        wait = None
        if (
            self.tier == "interactive"
            and serving.choice.has_chain(origin)
            and self._next(origin, Reason.SATURATED, n).to_model is not None
        ):
            wait = serving.config.tiers.interactive_fallback_wait_s
        team = self.ledger.caller.team
        weight = share_weight(team.weight, self.policy.weight)
        claim = Claim(team=team.id, weight=weight, tokens=len(size.ids))
        async with serving.admission.slot(self.tier, claim, wait) as turn:
            headers["x-duet-queue-ms"] = turn.queue_ms
            self.ledger.record.queue_s = round(turn.queued_s, 6)

            def done() -> None:  # what it served counts against its team's share
                acc = self.accounting
                turn.output(acc.total_completion_tokens if acc is not None else 0)
                turn.release()

            try:  # a stream gives the slot back once the node is done (relay.py, read ahead)
                return await self._respond(served, attempt, headers, sink, done)
            finally:  # however it ended
                done()
                if self.relay is not None:  # `done` holds this Tries: no cycle left to collect
                    self.relay.ended = None

    async def _respond(
        self,
        served: ServedModel,
        attempt: Attempt,
        headers: dict[str, str],
        sink: EventSink | None,
        node_done: Callable[[], None] | None = None,
    ) -> Answer:
        self.reply = reply = served.generator().open(self.req, attempt)
        reply.accounting.retained_tokens = attempt.retain.tokens if attempt.retain else 0
        if self.tools is not None and self.tools.mode != ToolMode.NONE:
            reply = with_tool_calls(reply, self.tools)
        req = self.req
        fmt = Formatter(
            req.endpoint,
            self.ledger.record.request_id,
            served.config.name,
            self.tier,
            attempt.prompt_ids if req.return_token_ids else None,
        )
        self.response_id = fmt.id  # the answer's id as the client gets it (gen_ai.response.id)
        ahead = self.serving.config.tiers.stream_read_ahead_bytes
        cap_s = self.serving.config.server.request_timeout_s if self.ledger.caller.capped else 0.0
        self.relay = relay = Relay(
            self.ledger, reply, fmt, node_done if req.stream else None, ahead, cap_s
        )
        traced = self.serving.tracing.enabled  # off: no generator per request (bench's CPU)
        with self._inference(served, self.reply.accounting) if traced else contextlib.nullcontext():
            if req.stream:
                assert sink is not None  # the pipeline's admit refused a stream without one
                await relay.stream(sink, headers, req.include_usage)
                return Answer(200, None, headers)
            body = await relay.whole(req.n)
        return Answer(
            200, body, {**headers, "x-duet-cost-usd": f"{self.ledger.record.cost_usd:.8f}"}
        )

    def _inference(
        self, served: ServedModel, acc: Accounting
    ) -> contextlib.AbstractContextManager[None]:
        """The GenAI inference span of this attempt (spans.py: `chat {model}`, the model that
        answers and what it served; a fallback's first model ends with the trigger's code as its
        `error.type`)."""
        name = served.config.name

        def usage() -> Attrs | None:
            if not acc.served:  # what a node or provider served (nobody reached: nothing)
                return None
            return {
                GEN_AI_RESPONSE_MODEL: acc.model_used or name,
                GEN_AI_INPUT_TOKENS: acc.prompt_tokens,
                GEN_AI_OUTPUT_TOKENS: acc.total_completion_tokens,
            }

        return client_span(
            self.serving.tracing,
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
        serving, name, acc = self.serving, served.config.name, self.accounting
        if (
            self.ledger.settled
            or isinstance(e, MidStreamError)
            or (acc is not None and acc.first_token_at is not None)
            or not serving.choice.has_chain(origin)
        ):
            raise e
        reason = serving.choice.trigger(e, served, self.tier)
        if reason is None:
            raise e
        self.tried.append(name)
        d = self._next(origin, reason, n_prompt)
        serving.fallbacks.count_fallback(name, d.to_model, d.reason)  # from: the one that failed
        rid = self.ledger.record.request_id
        if d.to_model is None:
            skipped = f" (skipped {dict(d.skipped)})" if d.skipped else ""
            log.warning(
                "%s: %s failed (%s: %s); no fallback left%s", rid, name, reason, e.message, skipped
            )
            raise e
        log.info("%s: %s → %s (%s: %s)", rid, name, d.to_model, reason, e.message)
        now = time.time_ns()
        serving.tracing.record(
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
        return serving.models[d.to_model]
