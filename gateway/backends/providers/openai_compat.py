"""`OpenAIProvider`: any OpenAI-compatible `/chat/completions` endpoint (OpenAI, vLLM, Groq, ...).

The request is the client's chat body restricted to OpenAI's own fields (duet extensions are
not forwarded) with the provider's model name; streams always ask for `include_usage`, so the
last chunk carries the usage the cost is computed from. A provider that sends no usage anyway
gets an estimate (about 4 characters per token), marked `estimated` in the TokenUsage, rather
than a free request. A stream that ends without `data: [DONE]` was cut and is an error.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from gateway.backends.providers.base import Provider
from gateway.backends.providers.cost import TokenUsage, estimate_tokens
from gateway.backends.providers.errors import ProviderError, http_error
from gateway.backends.providers.resilience import parse_retry_after
from protocol.openai import read_error

log = logging.getLogger(__name__)

#: the chat request fields an OpenAI-compatible API understands
FORWARDED = frozenset(
    {
        "messages",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "presence_penalty",
        "response_format",
        "seed",
        "stop",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "user",
        "reasoning_effort",
        "modalities",
        "prediction",
        "service_tier",
        "metadata",
        "store",
        # vLLM's sampling extensions, which OpenAI-compatible servers of open models take (OpenAI
        # itself refuses them: a 400 the client sees, never a silent drop)
        "repetition_penalty",
        "min_p",
        # vLLM's structured outputs (>= 0.10.2): only in a body for a model whose config lists the
        # feature vllm_structured_outputs (gateway/serving/features.py), i.e. a vLLM server
        "structured_outputs",
    }
)


class OpenAIProvider(Provider):
    kind = "openai"

    def _url(self) -> str:
        return self.config.base_url.rstrip("/") + "/chat/completions"

    def _auth_headers(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    def _payload(self, body: dict[str, Any], stream: bool) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k in FORWARDED}
        if any("thinking_blocks" in m for m in out.get("messages") or ()):
            # an Anthropic model's signed reasoning: no OpenAI-compatible API takes it back
            out["messages"] = [
                {k: v for k, v in m.items() if k != "thinking_blocks"} for m in out["messages"]
            ]
        out["model"] = self.config.upstream_model
        if stream:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
        return out

    def _completion(self, data: Any, body: dict[str, Any]) -> tuple[dict[str, Any], TokenUsage]:
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise ProviderError(
                502,
                "the provider's answer is not a chat.completion",
                retryable=True,
                kind="invalid_response",
            )
        usage = TokenUsage.from_openai(data.get("usage"))
        if usage is None:
            text = "".join(
                str((c.get("message") or {}).get("content") or "")
                for c in data["choices"]
                if isinstance(c, dict)
            )
            usage = _estimate(body, text)
        return data, usage

    def _error(self, status: int, headers: Any, data: bytes) -> ProviderError:
        return openai_error(status, headers, data)

    def _translator(self, body: dict[str, Any]) -> OpenAIStreamTranslator:
        return OpenAIStreamTranslator(body)


def openai_error(status: int, headers: Mapping[str, str], data: bytes) -> ProviderError:
    err = read_error(data)
    msg = (
        (err.message if err is not None else "")
        or data[:200].decode("utf-8", "replace")
        or f"HTTP {status}"
    )
    return http_error(
        status,
        msg,
        retry_after=parse_retry_after(headers),
        error_type=err.type if err is not None and err.type else None,
    )


def _prompt_text(body: Mapping[str, Any]) -> str:
    out = []
    for m in body.get("messages") or []:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out.extend(
                p.get("text", "")
                for p in c
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return "\n".join(out)


def _estimate(body: Mapping[str, Any], completion: str) -> TokenUsage:
    log.warning(
        "provider sent no usage; token counts estimated from the text (~4 characters a token)"
    )
    return TokenUsage(
        prompt_tokens=estimate_tokens(_prompt_text(body)),
        completion_tokens=estimate_tokens(completion),
        estimated=True,
    )


class OpenAIStreamTranslator:
    """Passes the provider's chunks through; remembers usage; checks the stream was complete."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.done = False
        self._body = body
        self._usage: TokenUsage | None = None
        self._text: list[str] = []
        self._last: dict[str, Any] = {}

    @property
    def usage(self) -> TokenUsage | None:
        return self._usage

    def feed(self, event: str | None, data: str) -> list[dict[str, Any]]:
        if data.strip() == "[DONE]":
            self.done = True
            return []
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ProviderError(
                502, "unreadable chunk from the provider", retryable=True, kind="invalid_response"
            ) from None
        if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
            err = chunk["error"]
            status = err.get("code") if isinstance(err.get("code"), int) else 500
            raise http_error(
                status,
                str(err.get("message", "provider error")),
                error_type=str(err.get("type")) if err.get("type") else None,
            )
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            raise ProviderError(
                502,
                "a chunk without choices from the provider",
                retryable=True,
                kind="invalid_response",
            )
        self._last = chunk
        if chunk.get("usage") is not None:
            self._usage = TokenUsage.from_openai(chunk["usage"])
        for c in chunk["choices"]:
            delta = c.get("delta") if isinstance(c, dict) else None
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                self._text.append(delta["content"])
        return [chunk]

    def finish(self) -> list[dict[str, Any]]:
        if not self.done:
            raise ProviderError(
                502, "the stream ended before [DONE]", retryable=True, kind="connect"
            )
        if self._usage is not None:
            return []
        self._usage = _estimate(self._body, "".join(self._text))
        return [
            {
                "id": self._last.get("id", ""),
                "object": "chat.completion.chunk",
                "created": self._last.get("created", int(time.time())),
                "model": self._last.get("model", ""),
                "choices": [],
                "usage": self._usage.openai(),
            }
        ]
