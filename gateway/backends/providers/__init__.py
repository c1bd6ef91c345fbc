"""Commercial model providers (OpenAI-compatible, Anthropic) behind one seam (base.py), with
retries, circuit breakers, fallback chains, cost helpers and the `model: "auto"` chooser."""

from __future__ import annotations

from typing import Any

import aiohttp

from gateway.backends.providers.anthropic import AnthropicProvider
from gateway.backends.providers.base import ChatResult, Provider
from gateway.backends.providers.breaker import BreakerState, CircuitBreaker
from gateway.backends.providers.catalog import ModelEntry
from gateway.backends.providers.config import ConfigError, ProviderConfig
from gateway.backends.providers.cost import TokenUsage, cost_usd
from gateway.backends.providers.errors import ProviderError
from gateway.backends.providers.metrics import ProviderMetrics, register_provider_metrics
from gateway.backends.providers.openai_compat import OpenAIProvider

KINDS: dict[str, type[Provider]] = {"openai": OpenAIProvider, "anthropic": AnthropicProvider}


def build_provider(
    config: ProviderConfig | dict[str, Any], session: aiohttp.ClientSession, **kw: Any
) -> Provider:
    """A provider for one `[[providers]]` table; `kw` (clock, sleep, rng) is for tests."""
    if isinstance(config, dict):
        config = ProviderConfig.from_dict(config)
    return KINDS[config.kind](config, session, **kw)


def build_providers(
    tables: list[dict[str, Any]], session: aiohttp.ClientSession
) -> dict[str, Provider]:
    """All `[[providers]]` of a config, by name; ConfigError on a bad table or a name used twice."""
    out: dict[str, Provider] = {}
    for t in tables:
        p = build_provider(t, session)
        if p.name in out:
            raise ConfigError(f"provider {p.name!r} is defined twice")
        out[p.name] = p
    return out


__all__ = [
    "KINDS",
    "AnthropicProvider",
    "BreakerState",
    "ChatResult",
    "CircuitBreaker",
    "ConfigError",
    "ModelEntry",
    "OpenAIProvider",
    "Provider",
    "ProviderConfig",
    "ProviderError",
    "ProviderMetrics",
    "TokenUsage",
    "build_provider",
    "build_providers",
    "cost_usd",
    "register_provider_metrics",
]
