"""OpenAI-compatible request/response bodies for `/v1/completions` (nodes and gateway).

Decoded with msgspec (unknown fields are ignored, as OpenAI clients send extras); semantic
checks live in `validate()` so every process refuses the same things with the same words.
vLLM's extensions are accepted under vLLM's names: top_k, min_tokens, stop_token_ids,
ignore_eos, skip_special_tokens, priority and kv_transfer_params.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any, Literal, TypeVar

import msgspec

from protocol import limits
from protocol.logprobs import TokenLogprob

# OpenAI allows str | list[int] | list[str] | list[list[int]]; msgspec cannot express that
# union, so the list form is checked in validate().
Prompt = str | list[Any]


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        *,
        retry_after_s: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        #: when the client may try again (the answer's Retry-After, in whole seconds, at least 1)
        self.retry_after_s = retry_after_s
        #: headers the answer carries besides Retry-After (x-ratelimit-* on a 429)
        self.headers = dict(headers or {})

    def response_headers(self) -> dict[str, str]:
        """The headers an error answer carries: every process renders them from here."""
        if self.retry_after_s is None:
            return self.headers
        return {**self.headers, "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def body(self) -> ErrorBody:
        return ErrorBody(
            error=ErrorDetail(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        )


class ErrorDetail(msgspec.Struct, kw_only=True):
    """OpenAI's error object: `{"message", "type", "param", "code"}`."""

    message: str = ""
    type: str | None = None
    param: str | None = None
    code: str | int | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    """OpenAI's error body, `{"error": {...}}`: every duet process answers errors in it."""

    error: ErrorDetail


_ERROR_BODY = msgspec.json.Decoder(ErrorBody)


def read_error(raw: bytes) -> ErrorDetail | None:
    """The error object of an error body (OpenAI's, Anthropic's: the same `{"error": {...}}`
    shape), or None when the body is not one: the one reader of that body in the project."""
    try:
        return _ERROR_BODY.decode(raw).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def parse_error(status: int, raw: bytes) -> APIError:
    """An error answer (OpenAI's body, or anything else a peer sent) as an APIError with the
    same status, for every client of a duet server."""
    e = read_error(raw)
    if e is None:
        return APIError(status, raw.decode(errors="replace")[:500])
    code = None if e.code is None else str(e.code)
    return APIError(
        status, str(e.message), type_=e.type or "invalid_request_error", param=e.param, code=code
    )


T = TypeVar("T")


def decode_body(decoder: msgspec.json.Decoder[T], raw: bytes) -> T:
    """A request body through its typed decoder; anything it refuses is the client's 400."""
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise APIError(400, f"malformed request body: {e}") from None
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request: {e}") from None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = True


class SamplingFields(msgspec.Struct, kw_only=True):
    """The body fields the completion and the chat form of a request share (OpenAI's, vLLM's
    extensions, duet's routing hints), listed once: a field added here reaches both forms and
    the chat → completion mapping (node/chat.py::as_completion) with no copy by hand."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    priority: Literal["interactive", "batch"] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    user: str | None = None
    # Penalties and biases (OpenAI's and vLLM's; their ranges: protocol/limits.py)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None

    def validate_sampling(self) -> None:
        """400s naming the field for penalties, logit_bias, min_p and stop out of range (the chat
        form and the completion form share this; token ids are checked against the model's
        vocabulary on the node). The ranges and words are protocol/limits.py's."""
        with refusals():
            limits.check_penalties(
                self.frequency_penalty, self.presence_penalty, self.repetition_penalty, self.min_p
            )
            limits.logit_bias(self.logit_bias)
            limits.check_stop([self.stop] if isinstance(self.stop, str) else self.stop or [])


def refused(e: limits.LimitError) -> APIError:
    """A sampling limit's refusal as the client's 400, naming the field."""
    return APIError(400, e.message, param=e.param)


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """Inside it, a `LimitError` (protocol/limits.py) leaves as the client's 400."""
    try:
        yield
    except limits.LimitError as e:
        raise refused(e) from None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool = False
    #: the sampled token's logprob plus this many top tokens per position (0..20)
    logprobs: int | None = None
    #: vLLM's extension: logprobs of the prompt tokens, plus this many top tokens (0..20)
    prompt_logprobs: int | None = None
    #: gateway: OpenAI's service tier (or duet's interactive|batch); nodes ignore it
    service_tier: str | None = None

    def validate(self) -> None:
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        with refusals():
            limits.check_logprobs("logprobs", self.logprobs)
            limits.check_logprobs("prompt_logprobs", self.prompt_logprobs)
            limits.check_max_tokens(self.max_tokens)
            limits.check_temperature(self.temperature)
            limits.check_top_p(self.top_p)
        self.validate_sampling()
        p = self.prompt
        if isinstance(p, list) and p and not _is_token(p[0]):
            if len(p) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            p = p[0]
            if not isinstance(p, str) and not (isinstance(p, list) and all(map(_is_token, p))):
                raise APIError(
                    400,
                    "prompt must be a string, a list of token ids, or a list holding one of those",
                    param="prompt",
                )
        elif isinstance(p, list) and not all(map(_is_token, p)):
            raise APIError(400, "prompt token ids must be integers", param="prompt")
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not _is_token(p[0]):
            return p[0]
        return p

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _is_token(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": n}


class CompletionLogprobs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """OpenAI's completions logprobs object (one entry per generated token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    #: between a node and the gateway only, when the leg asks (`logprob_records`): the engine's
    #: record of each token (its id, rank and top tokens by id, logprobs finite), which vLLM's
    #: token-in/token-out answer is made of (protocol/generate.py). Never in a public answer.
    records: list[TokenLogprob] | None = None


def merge_logprobs(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    """The streamed parts of one answer's logprobs as one object (offsets already run on)."""
    return CompletionLogprobs(
        tokens=[t for p in parts for t in p.tokens],
        token_logprobs=[v for p in parts for v in p.token_logprobs],
        top_logprobs=[d for p in parts for d in p.top_logprobs],
        text_offset=[o for p in parts for o in p.text_offset],
        records=[r for p in parts for r in p.records or ()]
        if any(p.records is not None for p in parts)
        else None,
    )


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's prompt-logprob entry for one token id at one prompt position."""

    logprob: float | None  # None: -inf (JSON has no infinity)
    decoded_token: str


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    logprobs: CompletionLogprobs | None = None
    #: vLLM's extension: per prompt token None (the first) or {token id: {logprob, decoded_token}}
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": cached_tokens},
    )
