"""Anthropic Messages → OpenAI chat completions, the answers' way back (the requests' way is
translate.py).

A Message → a chat.completion (`from_anthropic`); the SSE events `message_start`,
`content_block_start/delta/stop`, `message_delta`, `message_stop`, `ping` and `error` → OpenAI
chunks (`AnthropicStreamTranslator`); usage (cache reads and writes count as prompt tokens,
reads as cached tokens, writes as cache-write tokens); stop reasons (`STOP_REASONS`). Thinking
and redacted_thinking blocks become the message's `reasoning_content` (their text) and
`thinking_blocks` (the blocks as they came, signatures and encrypted data included: LiteLLM's
mapping); streamed, a `thinking_delta` is a chunk with both, a `signature_delta` one with the
block's signature.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.backends.providers.anthropic_shapes import (
    STOP_REASONS,
    anthropic_usage,
)
from gateway.backends.providers.cost import TokenUsage
from gateway.backends.providers.errors import ProviderError
from gateway.backends.providers.translate import error_from


def _obj(x: object) -> dict[str, Any]:
    """`x` if it is a JSON object, else an empty one (a provider's field of the wrong kind reads
    as absent)."""
    return x if isinstance(x, dict) else {}


def from_anthropic(msg: Any) -> tuple[dict[str, Any], TokenUsage]:
    if (
        not isinstance(msg, dict)
        or msg.get("type") != "message"
        or not isinstance(msg.get("content"), list)
    ):
        raise ProviderError(
            502,
            "the provider's answer is not an Anthropic message",
            retryable=True,
            kind="invalid_response",
        )
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    thought: list[dict[str, Any]] = []
    for b in msg["content"]:
        if not isinstance(b, dict):
            continue
        if b.get("type") in ("thinking", "redacted_thinking"):
            thought.append(b)
        elif b.get("type") == "text":
            text.append(str(b.get("text", "")))
        elif b.get("type") == "tool_use":
            calls.append(
                {
                    "id": b.get("id"),
                    "type": "function",
                    "function": {
                        "name": b.get("name"),
                        "arguments": json.dumps(b.get("input", {})),
                    },
                }
            )
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(text) if text or not calls else None,
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = calls
    if thought:  # the reasoning: its text, and its blocks as they came (signed, or redacted)
        message["reasoning_content"] = "".join(str(b.get("thinking") or "") for b in thought)
        message["thinking_blocks"] = thought
    usage = anthropic_usage(msg.get("usage"))
    completion = {
        "id": f"chatcmpl-{msg.get('id', '')}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": msg.get("model", ""),
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": STOP_REASONS.get(msg.get("stop_reason") or "", "stop"),
            }
        ],
        "usage": usage.openai(),
    }
    return completion, usage


class AnthropicStreamTranslator:
    """Anthropic Messages SSE events → OpenAI chat.completion.chunk dicts."""

    def __init__(self) -> None:
        self.done = False
        self._id = ""
        self._model = ""
        self._created = int(time.time())
        self._prompt = TokenUsage(prompt_tokens=0, completion_tokens=0)
        #: message_start's usage object, as it came (a message_delta's counts update it)
        self._counts: dict[str, Any] = {}
        self._output = 0
        self._started = False
        self._finish: str | None = None
        self._tool_index: dict[int, int] = {}  # content block index → OpenAI tool_calls index

    @property
    def usage(self) -> TokenUsage | None:
        if not self._started:
            return None
        p = self._prompt
        return TokenUsage(
            prompt_tokens=p.prompt_tokens,
            completion_tokens=self._output,
            cached_tokens=p.cached_tokens,
            cache_write_tokens=p.cache_write_tokens,
        )

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    def feed(self, event: str | None, data: str) -> list[dict[str, Any]]:
        try:
            d = json.loads(data)
        except ValueError:
            raise ProviderError(
                502,
                f"unreadable {event or 'SSE'} event from the provider",
                retryable=True,
                kind="invalid_response",
            ) from None
        if not isinstance(d, dict):
            raise ProviderError(
                502, "an SSE event that is not an object", retryable=True, kind="invalid_response"
            )
        kind = d.get("type", event)
        if kind == "error":
            err = _obj(d.get("error"))
            raise error_from(err.get("type"), str(err.get("message", "provider error")), None)
        if kind == "message_start":
            m = _obj(d.get("message"))
            self._id = f"chatcmpl-{m.get('id', '')}"
            self._model = str(m.get("model", ""))
            self._counts = _obj(m.get("usage"))
            u = anthropic_usage(self._counts)
            self._prompt = u
            self._output = u.completion_tokens
            self._started = True
            return [self._chunk({"role": "assistant", "content": ""})]
        if not self._started:
            if kind == "ping":
                return []
            raise ProviderError(
                502,
                f"stream event {kind!r} before message_start",
                retryable=True,
                kind="invalid_response",
            )
        if kind == "content_block_start":
            b = _obj(d.get("content_block"))
            if b.get("type") == "tool_use":
                ti = self._tool_index[d.get("index", 0)] = len(self._tool_index)
                return [
                    self._chunk(
                        {
                            "tool_calls": [
                                {
                                    "index": ti,
                                    "id": b.get("id"),
                                    "type": "function",
                                    "function": {"name": b.get("name"), "arguments": ""},
                                }
                            ]
                        }
                    )
                ]
            if b.get("type") == "text" and b.get("text"):
                return [self._chunk({"content": b["text"]})]
            if b.get("type") == "redacted_thinking":  # comes whole, in its start
                return [self._chunk({"thinking_blocks": [b]})]
            return []
        if kind == "content_block_delta":
            delta = _obj(d.get("delta"))
            if delta.get("type") == "text_delta":
                return [self._chunk({"content": str(delta.get("text", ""))})]
            if delta.get("type") == "input_json_delta":
                ti = self._tool_index.get(d.get("index", 0), 0)
                return [
                    self._chunk(
                        {
                            "tool_calls": [
                                {
                                    "index": ti,
                                    "function": {"arguments": str(delta.get("partial_json", ""))},
                                }
                            ]
                        }
                    )
                ]
            if delta.get("type") == "thinking_delta":
                t = str(delta.get("thinking", ""))
                block = {"type": "thinking", "thinking": t}
                return [self._chunk({"reasoning_content": t, "thinking_blocks": [block]})]
            if delta.get("type") == "signature_delta":  # the thinking block's end
                block = {"type": "thinking", "signature": str(delta.get("signature", ""))}
                return [self._chunk({"thinking_blocks": [block]})]
            return []
        if kind == "message_delta":
            delta = _obj(d.get("delta"))
            counts = _obj(d.get("usage"))
            if isinstance(counts.get("output_tokens"), int):
                self._output = counts["output_tokens"]  # cumulative, per Anthropic's docs
            if isinstance(
                counts.get("input_tokens"), int
            ):  # newer API versions repeat the final input counts (a cache figure left out
                # of them stays as message_start said it)
                self._prompt = anthropic_usage({**self._counts, **counts, "output_tokens": 0})
            self._finish = STOP_REASONS.get(delta.get("stop_reason") or "", "stop")
            return [self._chunk({}, self._finish)]
        if kind == "message_stop":
            self.done = True
            return []
        return []  # ping, content_block_stop, and event types added later

    def finish(self) -> list[dict[str, Any]]:
        if not self.done:
            raise ProviderError(
                502, "the stream ended before message_stop", retryable=True, kind="connect"
            )
        usage = self.usage
        assert usage is not None  # done implies started
        return [
            {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
                "choices": [],
                "usage": usage.openai(),
            }
        ]
