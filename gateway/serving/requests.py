"""Parsing and checking the public request bodies (`/v1/chat/completions`, `/v1/completions`).

Nothing from the client is trusted: the raw JSON's keys are checked first, and a field the
gateway does not support (images, audio, …) is a 400 that names it — unless it
carries its neutral value (`null`, `false`, `0`, `[]`, `{}`), which changes nothing. Types
come from msgspec; meaning (ranges, n ≤ 8, stop ≤ 4 strings, user ≤ 256 characters,
penalties, logit_bias, tools: gateway/tools/spec.py; the one constraint of response_format,
vLLM's guided_json / guided_regex / guided_choice / structured_outputs or a forced tool_choice:
gateway/serving/constraint.py) is checked here with OpenAI's wording, before any node work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, cast

import msgspec

from gateway.serving import raw_body
from gateway.serving.constraint import VLLM_FIELDS, constraint, refuse_min_tokens
from gateway.tools.spec import Tools
from protocol import limits
from protocol.openai import APIError, CompletionRequest, refusals, refused
from protocol.retention import RetainTTL
from protocol.structured import Guide, ResponseFormat, StructuredOutputs
from protocol.thinking import Thinking

#: the `user` field is stored in every usage record; longer than this it is not a user id
MAX_USER = 256
MAX_MESSAGES = 2048  # OpenAI's bound on a chat request's messages
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    "service_tier",
    "top_k",
    "min_tokens",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "response_format",
    *VLLM_FIELDS,
}
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "return_token_ids",
    "thinking",
}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "return_token_ids"}
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class Endpoint(StrEnum):
    """The public endpoint a request came to (its answer's shape)."""

    CHAT = "chat"
    COMPLETION = "completion"
    #: `/v1/embeddings` (gateway/api/embeddings.py): usage records and `usable_for` only
    EMBEDDING = "embedding"


@dataclass(frozen=True)
class Sampling:
    """The sampling fields a client set (None: the model's default), checked; the nodes and the
    providers each take what they know of them."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop: tuple[str, ...] = ()
    #: the sampled token's logprob plus this many top tokens (completions form; None: none)
    logprobs: int | None = None
    # OpenAI's penalties, vLLM's repetition_penalty and min_p, logit_bias (token id as a
    # decimal string → its bias); their ranges: protocol/limits.py
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None


@dataclass(frozen=True)
class RetainMark:
    """The prompt prefix a client asked to keep cached (gateway/serving/retain.py): the first
    `messages` chat messages (0: the tools alone), kept for `ttl`."""

    messages: int
    ttl: RetainTTL


@dataclass(frozen=True)
class Request:
    """What the client asked, parsed and checked: the one record of it, never changed after."""

    endpoint: Endpoint
    model: str
    #: chat: messages in OpenAI's form, content always a string (an assistant turn's
    #: `tool_calls`, a tool turn's `tool_call_id` kept); completion: None
    messages: list[dict[str, Any]] | None
    #: completion: the prompt as given (text or token ids)
    prompt: str | list[int] | None
    #: as the client sent it (None: the model's default)
    max_tokens: int | None
    sampling: Sampling
    n: int
    stream: bool
    include_usage: bool
    service_tier: str | None
    user: str | None
    #: as the client sent it (None or type "text": unconstrained)
    response_format: ResponseFormat | None = None
    #: the constraint response_format or vLLM's guided_json / guided_regex / guided_choice /
    #: structured_outputs ask for, checked by the grammar engine in the pipeline (a forced
    #: tool_choice's is built per model: gateway/tools/plan.py, checked in measure.py)
    guide: Guide | None = None
    #: vLLM's extras as `structured_outputs`, one field set (None: not used;
    #: gateway/serving/constraint.py)
    structured_outputs: StructuredOutputs | None = None
    #: the request field that constrains the answer (None: unconstrained); errors name it
    constraint_field: str | None = None
    #: the param a refused `guide` names ("structured_outputs.regex", …); the guide is checked
    #: by the grammar engine off the event loop (generate.py `admit` → GuideChecker) before any node
    #: work
    guide_param: str | None = None
    #: chat: the checked tools and tool_choice
    tools: Tools = field(default_factory=Tools)
    #: the conversation holds tool calls or tool results
    has_tool_turns: bool = False
    #: the prompt prefix the client asked to keep cached (Anthropic's `cache_control`;
    #: gateway/serving/retain.py); None: cached as usual
    retain: RetainMark | None = None
    #: `guide` with objects left as written, for a model with `closed_objects = false`
    #: (constraint.py's `Constraint.open_guide`; None: the same as `guide`)
    open_guide: Guide | None = None
    #: Anthropic's extended thinking, asked on /v1/messages (None: none): only a provider's
    #: model that lists the `thinking` feature serves it (features.py)
    thinking: Thinking | None = None
    #: the answer carries its choices' token ids and the prompt's (vLLM's `return_token_ids`;
    #: the token-in/token-out endpoint's answer is made of them)
    return_token_ids: bool = False
    #: the answer's logprobs carry the engine's records (ids, ranks: the legs ask their nodes
    #: for `logprob_records`), for the token-in/token-out endpoint's answer; never set by a body
    logprob_records: bool = False

    def guide_on(self, closed_objects: bool) -> Guide | None:
        """The guide on a model whose `closed_objects` setting this is (gateway/config_tables.py):
        its objects that omit `additionalProperties` closed (the default), or as written."""
        return self.guide if closed_objects or self.open_guide is None else self.open_guide


def sampling_of(
    body: Any, max_tokens: int | None, logprobs: int | None, n: int | None = None
) -> tuple[Sampling, int]:
    """The request's sampling and its `n` (`n`: as the client sent it, else the body's)."""
    if n is None:
        n = 1 if body.n is None else body.n
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:  # the ranges and words every process refuses with (protocol/limits.py)
        limits.check_max_tokens(max_tokens)
        limits.check_temperature(body.temperature)
        limits.check_top_p(body.top_p)
        limits.check_n(n)
        limits.check_top_k(body.top_k)
        limits.check_min_tokens(body.min_tokens)
        limits.check_stop(stop)
        if body.stream_options is not None and not body.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )
        limits.check_penalties(
            body.frequency_penalty, body.presence_penalty, body.repetition_penalty, body.min_p
        )
        bias = limits.logit_bias(body.logit_bias)
    except limits.LimitError as e:
        raise refused(e) from None
    return Sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        top_k=body.top_k,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        stop=tuple(stop),
        logprobs=logprobs,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        logit_bias=bias,
    ), n


def parse_completion(raw: bytes) -> Request:
    data = raw_body.decode_json(raw)
    raw_body.refuse_unsupported(data, COMPLETION_FIELDS)
    if "prompt" not in data or "model" not in data:
        missing = "model" if "model" not in data else "prompt"
        raise APIError(400, f"missing required field: {missing}", param=missing)
    stream_options = data.get("stream_options")
    body: CompletionRequest = raw_body.convert(data, CompletionRequest)
    if not isinstance(body.model, str):
        raise APIError(400, "model must be a string", param="model")
    p = body.prompt
    if isinstance(p, list) and p and not _is_token(p[0]):
        if len(p) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        p = p[0]
    if isinstance(p, list):
        if not all(map(_is_token, p)):
            raise APIError(400, "prompt must be a string or a list of token ids", param="prompt")
    elif not isinstance(p, str):
        raise APIError(400, "prompt must be a string or a list of token ids", param="prompt")
    if not p:
        raise APIError(400, "the prompt is empty", param="prompt")
    # CompletionRequest defaults max_tokens to 16 (the node's default); the gateway's default
    # is the model's, so read what the client really sent.
    max_tokens = data.get("max_tokens")
    if max_tokens is not None and not _is_token(max_tokens):
        raise APIError(400, "max_tokens must be an integer", param="max_tokens")
    if stream_options is None:
        body.stream_options = None
    if body.logprobs is not None:
        check_top("logprobs", body.logprobs)
    sampling, n = sampling_of(body, max_tokens, body.logprobs, n=_sent_n(data))
    rf = (
        raw_body.convert({"response_format": data["response_format"]}, _Format).response_format
        if data.get("response_format") is not None
        else None
    )
    c = constraint(raw_body.vllm_fields(data), rf, forced_tool=False)
    refuse_min_tokens(c.field, sampling.min_tokens)
    return Request(
        endpoint=Endpoint.COMPLETION,
        model=body.model,
        messages=None,
        prompt=p,
        max_tokens=max_tokens,
        sampling=sampling,
        n=n,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        service_tier=body.service_tier,
        user=user_of(body.user),
        response_format=rf,
        guide=c.guide,
        open_guide=c.open_guide,
        structured_outputs=c.structured_outputs,
        constraint_field=c.field,
        guide_param=c.param,
        return_token_ids=flag(data, "return_token_ids"),
    )


class _Format(msgspec.Struct):
    """response_format on the completions form (vLLM's extension; OpenAI's chat field)."""

    response_format: ResponseFormat


def _sent_n(data: Mapping[str, object]) -> int | None:
    """`n` as the client sent it (CompletionRequest defaults it to 1)."""
    n = data.get("n")
    if n is not None and not _is_token(n):
        raise APIError(400, "n must be an integer", param="n")
    return cast(int | None, n)


def flag(data: Mapping[str, object], name: str) -> bool:
    """A boolean field of the raw body (absent or null: false)."""
    v = data.get(name)
    if v is not None and not isinstance(v, bool):
        raise APIError(400, f"{name} must be a boolean", param=name)
    return bool(v)


def user_of(user: str | None) -> str | None:
    """The end user the caller names (msgspec already refused a non-string); "" names nobody."""
    if user is not None and len(user) > MAX_USER:
        raise APIError(
            400,
            f"user must be a string of at most {MAX_USER} characters, got {len(user)}",
            param="user",
        )
    return user or None


def check_top(name: str, n: int) -> None:
    with refusals():
        limits.check_logprobs(name, n)


def _is_token(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
