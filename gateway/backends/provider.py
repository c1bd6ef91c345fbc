"""`ProviderBackend`: an external model (a commercial API) behind the gateway's `Backend` seam.

One per `kind = "external"` model, wrapping its `Provider` (gateway/backends/providers/). An
`Attempt` of a `Request` becomes a chat request (the client's messages — tool calls and tool results
included —, max_tokens, the sampling fields, penalties and logit_bias, tools, tool_choice,
parallel_tool_calls and response_format, as the client sent them; vLLM's guided_json / guided_regex
/ guided_choice / structured_outputs as vLLM's `structured_outputs`, for a model whose features list
them: gateway/serving/features.py); the provider passes them on (OpenAI-compatible) or translates
them (Anthropic: tools and tool results both ways; response_format, structured_outputs and
logit_bias are refused with a 400 naming them). A streaming attempt is relayed chunk by chunk, a
whole one is one call; the provider's tool calls come back as the pieces' `tool_calls` deltas, in
OpenAI's stream shape, and its reasoning (`reasoning_content`, an Anthropic model's signed
`thinking_blocks`) as the pieces' `reasoning` and `thinking`.

Errors follow the seam's contract:
- before the first piece reached the client: `ProviderFailure`, an `APIError` that keeps the
  `ProviderError` so the fallback loop can tell a trigger (5xx, 429, open breaker) from the
  request's own fault. The status is the client's view: the provider refusing the gateway's
  credentials is a 502 (not the client's 401), a timeout 504, an open breaker 503;
- after it: `MidStreamError`. The provider never retries a stream once a chunk was yielded
  (providers/base.py), so nothing the client saw is ever sent twice; a stream cut before any
  text reached the client is still a `ProviderFailure` (nothing to duplicate).

The reply's Accounting holds the provider's own token counts (its usage chunk), so the request is
charged at this model's prices; `nodes` names the provider only once it answered, so a
provider that failed costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from gateway.backends.base import Accounting, Attempt, Backend, MidStreamError, Piece, Reply
from gateway.backends.provider_slots import ProviderSlots
from gateway.backends.provider_usage import (
    answer_abandoned,
    answered,
    split,
    stream_abandoned,
    usage_chunk,
)
from gateway.backends.providers.base import Provider
from gateway.backends.providers.breaker import BreakerState
from gateway.backends.providers.cost import estimate_tokens
from gateway.backends.providers.errors import ProviderError
from gateway.backends.providers.fallback import Reason, error_trigger
from gateway.config import ModelConfig, Tier
from gateway.serving.requests import Endpoint, Request
from protocol.chat import ThinkingBlock
from protocol.openai import APIError
from protocol.tools import ToolCallDelta

log = logging.getLogger("duet.gateway.providers")
#: the sampling fields the providers' chat APIs understand (node-only ones like ignore_eos are
#: dropped)
_SAMPLING = (
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
)


class ProviderFailure(APIError):
    """A provider call that failed before any piece reached the client."""

    def __init__(self, model: str, err: ProviderError) -> None:
        status, type_, code = _client_view(err)
        super().__init__(
            status,
            f"model {model!r}: {tenant_message(err)}",
            type_=type_,
            code=code,
            retry_after_s=err.retry_after,
        )
        self.error = err
        log.warning(
            "model %r: provider %r failed (%r): %r", model, err.provider, err.kind, err.message
        )


def tenant_message(e: ProviderError) -> str:
    """What a tenant is told of a provider's failure. The provider's own text (an account id, a
    quota of the operator's, another tenant's request) is never passed on: it goes to the log;
    only the gateway's own words reach the client."""
    if e.kind == "invalid_request":  # the gateway's own words: what this provider cannot express
        return e.message
    if e.kind == "breaker_open":
        return "the provider is unavailable for now (it failed repeatedly); retry later"
    if e.kind == "timeout":
        return "the provider did not answer in time"
    if e.kind == "connect":
        return "the provider could not be reached, or dropped the connection"
    if e.kind == "stream_interrupted":
        return "the provider's stream was interrupted"
    if e.kind == "invalid_response":
        return "the provider's answer could not be read"
    if e.status == 429:
        return "the provider is rate limiting this gateway; retry later"
    if 400 <= e.status < 500:
        return f"the provider refused the request (HTTP {e.status})"
    return f"the provider failed (HTTP {e.status})"


def _client_view(e: ProviderError) -> tuple[int, str, str]:
    if e.kind == "breaker_open":
        return 503, "service_unavailable", "provider_unavailable"
    if e.kind == "invalid_request" and e.status == 400:
        return 400, "invalid_request_error", "unsupported_by_model"
    if e.kind == "timeout":
        return 504, "upstream_error", "provider_timeout"
    if e.status == 429:
        return 429, "rate_limit_error", "provider_rate_limited"
    if e.status in (400, 404, 413, 422):
        return e.status, "invalid_request_error", "provider_refused"
    # 401/403: the gateway's own key was refused, 5xx, a dropped connection: not the client's fault
    return 502, "upstream_error", "provider_error"


class ProviderBackend(Backend):
    def __init__(self, model: ModelConfig, provider: Provider, slots: ProviderSlots) -> None:
        self.model = model
        self.provider = provider
        #: the gateway's bound on provider calls, shared by every external model
        self.slots = slots

    def usable_for(self, endpoint: Endpoint, n: int) -> bool:
        """Whether this model can take such a request at all (external APIs speak chat; Anthropic
        has no n > 1)."""
        return endpoint == Endpoint.CHAT and (n == 1 or self.provider.kind != "anthropic")

    def available(self) -> bool:
        return self.provider.breaker.state is not BreakerState.OPEN

    def fallback_reason(self, err: APIError, tier: Tier) -> Reason | None:
        return error_trigger(err.error) if isinstance(err, ProviderFailure) else None

    def _body(self, request: Request, attempt: Attempt) -> dict[str, Any]:
        if request.endpoint != Endpoint.CHAT or request.messages is None:
            raise APIError(
                400,
                f"model {self.model.name!r} is an external chat model: use /v1/chat/completions",
                param="model",
                code="unsupported_endpoint",
            )
        s = request.sampling
        if s.logprobs is not None:  # not every provider has them: refused for all, by name
            raise APIError(
                400,
                f"model {self.model.name!r} is an external model: logprobs are served by duet's "
                "own models only",
                param="logprobs",
                code="unsupported_by_model",
            )
        body: dict[str, Any] = {"messages": request.messages, "max_tokens": attempt.max_tokens}
        body.update({k: getattr(s, k) for k in _SAMPLING if getattr(s, k) is not None})
        if s.stop:
            body["stop"] = list(s.stop)
        if request.n > 1:
            body["n"] = request.n
        t = request.tools
        if t.defs:
            body["tools"] = [_unset_dropped(d) for d in t.defs]
            body["tool_choice"] = (
                {"type": "function", "function": {"name": t.named}} if t.named else t.choice
            )
            if not t.parallel:
                body["parallel_tool_calls"] = False
        if request.response_format is not None:
            body["response_format"] = _unset_dropped(request.response_format)
        if request.structured_outputs is not None:
            # vLLM's extras, normalized: one field set (gateway/serving/constraint.py)
            body["structured_outputs"] = msgspec.to_builtins(request.structured_outputs)
        if request.thinking is not None:  # only an Anthropic model takes it (features.py)
            body["thinking"] = msgspec.to_builtins(request.thinking)
        return body

    def open(self, request: Request, attempt: Attempt) -> Reply:
        return Reply(lambda acc: self._stream(request, attempt, acc))

    async def _stream(
        self, request: Request, attempt: Attempt, out: Accounting
    ) -> AsyncGenerator[Piece, None]:
        body = self._body(request, attempt)
        # taken before the prompt is sent, held to the call's end (aclosing: a client that
        # leaves ends the provider's stream, and gives the slot back, now, not at GC)
        with self.slots.slot(self.model.name, attempt.tier):
            async with contextlib.aclosing(self._call(request, attempt, body, out)) as pieces:
                async for piece in pieces:
                    yield piece

    async def _call(
        self, request: Request, attempt: Attempt, body: dict[str, Any], out: Accounting
    ) -> AsyncGenerator[Piece, None]:
        out.model_used = self.model.name
        # the provider counts; this estimate stands only if a stream breaks before its usage
        # chunk (a provider that answered nothing charges nothing: `nodes` stays empty)
        shown = [str(m.get("content") or "") for m in request.messages or []]
        if request.tools.defs:  # tool definitions are prompt the provider bills
            shown.append(msgspec.json.encode(request.tools.defs).decode())
        out.prompt_tokens = estimate_tokens("\n".join(shown))
        if not request.stream:
            out.prompt_sent = True
            call = asyncio.ensure_future(self.provider.chat(body))
            try:  # shielded: a client that leaves does not stop the provider's answer, it is paid
                result = await asyncio.shield(call)
            except ProviderError as e:
                raise ProviderFailure(self.model.name, e) from None
            except asyncio.CancelledError:
                await answer_abandoned(call, out, attempt, request.n, self.provider.name)
                raise
            pieces = []
            for c in result.response.get("choices") or []:
                i = c.get("index", 0) if isinstance(c, dict) else 0
                msg = c.get("message") or {}
                try:
                    calls = _calls(msg.get("tool_calls"), whole=True)
                    reasoning, thinking = _reasoning(msg)
                except ProviderError as e:
                    raise ProviderFailure(self.model.name, e) from None
                pieces.append(
                    Piece(
                        index=i,
                        text=str(msg.get("content") or ""),
                        finish_reason=c.get("finish_reason") or "stop",
                        tool_calls=calls,
                        reasoning=reasoning,
                        thinking=thinking,
                    )
                )
            answered(out, result.usage, self.provider.name)
            out.first_token_at = time.monotonic()
            for p in pieces:
                yield p
                out.completion_tokens.setdefault(p.index, 0)
            out.completion_tokens = split(result.usage.completion_tokens, out.completion_tokens)
            return
        sent = False
        out.prompt_sent = True
        it = self.provider.chat_stream(body)
        try:
            while True:
                # each read shielded: a client that leaves while the gateway waits for the
                # provider leaves the stream readable, for its usage (`_stream_abandoned`)
                step = asyncio.ensure_future(anext(it, None))
                try:
                    chunk = await asyncio.shield(step)
                except asyncio.CancelledError:
                    await stream_abandoned(it, step, out, attempt, request.n, self.provider.name)
                    raise
                if chunk is None:
                    break
                if usage_chunk(out, chunk, self.provider.name):
                    continue
                for c in chunk.get("choices") or []:
                    delta = c.get("delta") or {}
                    text, finish = delta.get("content") or "", c.get("finish_reason")
                    calls = _calls(delta.get("tool_calls"), whole=False)
                    reasoning, thinking = _reasoning(delta)
                    said = text or calls or reasoning or thinking
                    if not said and not finish:
                        continue
                    i = c.get("index", 0)
                    if said:
                        out.completion_tokens[i] = (
                            out.completion_tokens.get(i, 0) + 1
                        )  # refined by usage
                        if out.first_token_at is None:
                            out.first_token_at = time.monotonic()
                    if not sent:
                        sent = True
                        out.nodes.append(f"provider:{self.provider.name}")
                    try:
                        yield Piece(
                            index=i,
                            text=text,
                            finish_reason=finish,
                            tool_calls=calls,
                            tokens=1 if said else 0,
                            reasoning=reasoning,
                            thinking=thinking,
                        )
                    except GeneratorExit:  # the relay closed the reply: its client left
                        await stream_abandoned(
                            it, None, out, attempt, request.n, self.provider.name
                        )
                        raise
        except ProviderError as e:
            if not sent:  # nothing reached the client: a plain failure, free to fall back
                if e.kind == "stream_interrupted":
                    e = ProviderError(e.status, e.message, kind="connect", provider=e.provider)
                raise ProviderFailure(self.model.name, e) from None
            log.warning(
                "model %r: provider %r failed mid-stream (%r): %r",
                self.model.name,
                e.provider,
                e.kind,
                e.message,
            )
            raise MidStreamError(
                502,
                f"model {self.model.name!r}: {tenant_message(e)}",
                type_="upstream_error",
                code="upstream_failed_midstream",
            ) from None
        finally:
            await it.aclose()


def _unset_dropped(obj: msgspec.Struct) -> dict[str, Any]:
    """A request struct as the client sent it: fields it left unset (None) are not sent (a
    provider may refuse `"description": null`); what a field holds — a JSON Schema, whose
    nulls mean something — is passed as it is."""
    return {
        f: _unset_dropped(v) if isinstance(v, msgspec.Struct) else msgspec.to_builtins(v)
        for f in obj.__struct_fields__
        if (v := getattr(obj, f)) is not None
    }


def _reasoning(msg: Any) -> tuple[str, list[ThinkingBlock] | None]:
    """A provider's reasoning in a message or a chunk delta: its text (`reasoning_content`)
    and its blocks (`thinking_blocks`, an Anthropic model's, translated)."""
    text = msg.get("reasoning_content")
    raw = msg.get("thinking_blocks")
    try:
        blocks = msgspec.convert(raw, list[ThinkingBlock]) if raw else None
    except msgspec.ValidationError as e:
        raise ProviderError(
            502, f"the provider's thinking blocks are malformed: {e}", kind="invalid_response"
        ) from None
    return (text if isinstance(text, str) else ""), blocks


def _calls(raw: Any, whole: bool) -> list[ToolCallDelta] | None:
    """A provider's `tool_calls` (a message's, or a chunk delta's) as stream deltas; a whole
    message's calls have no `index`, so they are numbered in order."""
    if not isinstance(raw, list) or not raw:
        return None
    if whole:
        raw = [
            {"index": i, "id": c.get("id"), "type": "function", "function": c.get("function")}
            for i, c in enumerate(raw)
            if isinstance(c, dict)
        ]
    try:
        return msgspec.convert(raw, list[ToolCallDelta])
    except msgspec.ValidationError as e:
        raise ProviderError(
            502, f"the provider's tool calls are malformed: {e}", kind="invalid_response"
        ) from None
