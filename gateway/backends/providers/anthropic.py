"""`AnthropicProvider`: the Anthropic Messages API (`POST {base_url}/messages`), spoken in
OpenAI's chat format on our side; translate.py does the mapping both ways."""

from __future__ import annotations

from typing import Any

from gateway.backends.providers.base import Provider
from gateway.backends.providers.cost import TokenUsage
from gateway.backends.providers.errors import ProviderError
from gateway.backends.providers.translate import anthropic_error, to_anthropic
from gateway.backends.providers.translate_answer import AnthropicStreamTranslator, from_anthropic


class AnthropicProvider(Provider):
    kind = "anthropic"

    def _url(self) -> str:
        return self.config.base_url.rstrip("/") + "/messages"

    def _auth_headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key}

    def _extra_headers(self) -> dict[str, str]:
        return {"anthropic-version": self.config.anthropic_version}

    def _payload(self, body: dict[str, Any], stream: bool) -> dict[str, Any]:
        return to_anthropic(
            {**body, "stream": stream}, self.config.upstream_model, self.config.default_max_tokens
        )

    def _completion(self, data: Any, body: dict[str, Any]) -> tuple[dict[str, Any], TokenUsage]:
        return from_anthropic(data)

    def _error(self, status: int, headers: Any, data: bytes) -> ProviderError:
        return anthropic_error(status, headers, data)

    def _translator(self, body: dict[str, Any]) -> AnthropicStreamTranslator:
        return AnthropicStreamTranslator()
