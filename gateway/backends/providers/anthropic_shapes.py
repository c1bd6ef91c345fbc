"""What OpenAI chat and Anthropic Messages call by different names, in one place, both ways.

Two translations use these tables: the Anthropic *provider* (translate.py: an OpenAI chat
request out to Anthropic, its answer back) and the gateway's own `/v1/messages` endpoint
(gateway/api/anthropic/api.py: an Anthropic request in, onto the OpenAI chat path, the answer
back). Keeping the names here means the two directions cannot drift apart.

Invariants: `FINISH_REASONS` inverts `STOP_REASONS` on every value an OpenAI answer can carry;
`status_of` and `error_type_of` agree on the nine types Anthropic documents; usage: Anthropic's
`input_tokens` excludes cache reads and writes, OpenAI's `prompt_tokens` includes them (and its
`cached_tokens` are the reads, the gateway's `cache_write_tokens` the writes).
"""

from __future__ import annotations

from typing import Any, Literal

from gateway.backends.providers.cost import TokenUsage

#: Anthropic stop_reason → OpenAI finish_reason
STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    # the server paused a long turn (its own tools): the client continues it; no OpenAI reason
    # says so, and "stop" would tell a /v1/messages client the turn ended
    "pause_turn": "pause_turn",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}

#: OpenAI finish_reason → Anthropic stop_reason ("stop" is end_turn unless a stop sequence matched)
FINISH_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
    "pause_turn": "pause_turn",
}

#: OpenAI tool_choice strings → Anthropic tool_choice types (a named function is `tool`)
TOOL_CHOICES: dict[Literal["auto", "none", "required"], str] = {
    "auto": "auto",
    "none": "none",
    "required": "any",
}
TOOL_CHOICES_BACK = {v: k for k, v in TOOL_CHOICES.items()}

#: Anthropic's error types and their HTTP statuses (docs: "HTTP errors")
ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    # the request ran out of time (the gateway's `[server] request_timeout_s`, a provider
    # that did not answer in time): Anthropic answers its own timeouts so
    "timeout_error": 504,
    "overloaded_error": 529,
}
_TYPE_OF_STATUS = {v: k for k, v in ERROR_STATUS.items()}


def status_of(error_type: Any) -> int:
    return ERROR_STATUS.get(str(error_type), 500)


def error_type_of(status: int) -> str:
    """The Anthropic error type a status is answered with (503: overloaded, as Anthropic's 529)."""
    if status in _TYPE_OF_STATUS:
        return _TYPE_OF_STATUS[status]
    if status == 503:
        return "overloaded_error"
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_type_named(error_type: str | None, status: int | None) -> str:
    """The Anthropic type of an OpenAI-shaped error: its own type when Anthropic has one of that
    name (a stream's error event carries no status: its type is all that says a timeout), else
    the type of its status (none: 500)."""
    if error_type in ERROR_STATUS:
        return error_type
    return error_type_of(500 if status is None else status)


def anthropic_usage(u: Any) -> TokenUsage:
    """An Anthropic usage object as TokenUsage (cache reads and writes count as prompt tokens,
    and are said as what they are: the writes are billed at the cache-write price)."""
    u = u if isinstance(u, dict) else {}

    def n(k: str) -> int:
        v = u.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

    read, write = n("cache_read_input_tokens"), n("cache_creation_input_tokens")
    return TokenUsage(
        prompt_tokens=n("input_tokens") + read + write,
        completion_tokens=n("output_tokens"),
        cached_tokens=read,
        cache_write_tokens=write,
    )


def input_tokens(prompt_tokens: int, cached_tokens: int) -> tuple[int, int]:
    """OpenAI's prompt and cached counts as Anthropic's (input_tokens, cache_read_input_tokens)."""
    cached = min(max(cached_tokens, 0), prompt_tokens)
    return prompt_tokens - cached, cached
