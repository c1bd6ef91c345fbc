"""Configuration of one external model (a `[[providers]]` table in `gateway.toml`).

`ProviderConfig.from_dict` is the only way in: it refuses unknown keys (a typo in an operator's
config must not silently become a default), wrong types and out-of-range values with a message
that names the provider and the field. Everything here is immutable; a reload builds new objects.

A table as an operator writes it (only the first block of keys is required):

    [[providers]]
    name = "gpt-4o-mini"                 # what clients ask for and usage records show
    kind = "openai"                      # or "anthropic"
    base_url = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"
    input_price_per_m = 0.15
    output_price_per_m = 0.60
    context_length = 128000
    capability_rank = 2
    tiers = ["interactive", "batch"]
    model = "gpt-4o-mini-2024-07-18"     # the name at the provider, if different
    retry = { max_attempts = 3, base_delay_s = 0.25, max_delay_s = 8.0 }
    breaker = { failure_threshold = 5, cooldown_s = 30.0 }
    timeouts = { connect_s = 5.0, first_byte_s = 120.0, idle_s = 30.0 }

Invariants: prices are USD per 1M tokens and never negative; a provider lists at least one tier;
`api_key_env` names an environment variable (the key itself never sits in the config file).
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

import msgspec

Kind = Literal["openai", "anthropic"]
Tier = Literal["interactive", "batch"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(ValueError):
    """A provider table that cannot be used; the message names the provider and the field."""


class RetryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    #: attempts in total, the first one included (1 = never retry)
    max_attempts: int = 3
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0
    multiplier: float = 2.0
    #: each delay is scaled by a uniform factor in [1 - jitter, 1 + jitter]
    jitter: float = 0.2
    #: a Retry-After longer than this is not waited for: the error goes back to the caller
    #: (who may fall back to another model) rather than holding the client for minutes
    max_retry_after_s: float = 20.0


class BreakerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    #: consecutive failures that open the breaker
    failure_threshold: int = 5
    #: seconds the breaker stays open before letting probe requests through (half-open)
    cooldown_s: float = 30.0
    #: successful probes needed in half-open to close again
    success_threshold: int = 1
    #: probes allowed in flight at once while half-open
    half_open_max_calls: int = 1
    #: HTTP statuses that count as a provider failure (connect errors and timeouts always do;
    #: a 400 is the request's fault and never counts)
    failure_statuses: tuple[int, ...] = (429, 500, 502, 503, 504, 529)


class TimeoutConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    connect_s: float = 5.0
    #: from sending the request to the first byte of the answer: the response headers of a
    #: non-streaming call (which come after the whole generation), the first SSE event of a stream
    first_byte_s: float = 120.0
    #: longest silence allowed between two reads of a stream (or of a response body)
    idle_s: float = 30.0


class ProviderConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    #: the name clients and the usage records use (`"model": "gpt-4o-mini"`)
    name: str
    kind: Kind
    base_url: str
    #: name of the environment variable that holds the API key (None: no key is sent)
    api_key_env: str | None = None
    #: the model's name at the provider (defaults to `name`)
    model: str | None = None
    #: USD per 1M tokens
    input_price_per_m: float
    output_price_per_m: float
    #: USD per 1M prompt tokens served from the provider's prompt cache (defaults to input price)
    cached_input_price_per_m: float | None = None
    #: USD per 1M prompt tokens written to the provider's prompt cache (Anthropic's
    #: `cache_creation_input_tokens`; defaults to the input price)
    cache_write_input_price_per_m: float | None = None
    context_length: int
    tiers: tuple[Tier, ...] = ("interactive",)
    #: higher = more capable; `model: "auto"` picks the cheapest model whose rank is enough
    capability_rank: int
    #: max_tokens sent to providers that require it (Anthropic) when the client gave none
    default_max_tokens: int = 4096
    #: Anthropic API version header
    anthropic_version: str = "2023-06-01"
    #: extra HTTP headers sent on every call (e.g. an OpenAI-Organization)
    headers: dict[str, str] = {}
    retry: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    timeouts: TimeoutConfig = TimeoutConfig()

    @property
    def upstream_model(self) -> str:
        return self.model or self.name

    @property
    def cached_price_per_m(self) -> float:
        p = self.cached_input_price_per_m
        return self.input_price_per_m if p is None else p

    @property
    def cache_write_price_per_m(self) -> float:
        p = self.cache_write_input_price_per_m
        return self.input_price_per_m if p is None else p

    def api_key(self) -> str | None:
        """The key, read from the environment at call time (so a rotated key is picked up)."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ProviderConfig:
        name = raw.get("name", "?") if isinstance(raw, dict) else "?"
        try:
            cfg = msgspec.convert(raw, cls)
        except msgspec.ValidationError as e:
            raise ConfigError(f"provider {name!r}: {e}") from None
        cfg._check()
        return cfg

    def _check(self) -> None:
        def bad(field: str, why: str) -> ConfigError:
            return ConfigError(f"provider {self.name!r}: {field} {why}")

        if not self.name or "/" in self.name or self.name == "auto":
            raise bad("name", "must be non-empty, without '/', and not 'auto'")
        if not self.base_url.startswith(("http://", "https://")):
            raise bad("base_url", f"must be an http(s) URL, got {self.base_url!r}")
        if self.api_key_env is not None and not _ENV_NAME.match(self.api_key_env):
            raise bad(
                "api_key_env", f"must be an environment variable name, got {self.api_key_env!r}"
            )
        for f in ("input_price_per_m", "output_price_per_m"):
            if getattr(self, f) < 0:
                raise bad(f, "must not be negative")
        for f in ("cached_input_price_per_m", "cache_write_input_price_per_m"):
            if getattr(self, f) is not None and getattr(self, f) < 0:
                raise bad(f, "must not be negative")
        if self.context_length < 1:
            raise bad("context_length", "must be at least 1")
        if not self.tiers:
            raise bad("tiers", "must list at least one tier")
        if self.default_max_tokens < 1:
            raise bad("default_max_tokens", "must be at least 1")
        r = self.retry
        if r.max_attempts < 1 or r.base_delay_s < 0 or r.max_delay_s < r.base_delay_s:
            raise bad("retry", "needs max_attempts >= 1 and 0 <= base_delay_s <= max_delay_s")
        if r.multiplier < 1 or not 0 <= r.jitter < 1 or r.max_retry_after_s < 0:
            raise bad("retry", "needs multiplier >= 1, 0 <= jitter < 1, max_retry_after_s >= 0")
        b = self.breaker
        if b.failure_threshold < 1 or b.success_threshold < 1 or b.half_open_max_calls < 1:
            raise bad("breaker", "thresholds and half_open_max_calls must be at least 1")
        if b.cooldown_s < 0:
            raise bad("breaker", "cooldown_s must not be negative")
        t = self.timeouts
        if min(t.connect_s, t.first_byte_s, t.idle_s) <= 0:
            raise bad("timeouts", "must all be positive")
