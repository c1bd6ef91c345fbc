"""Provider config validation and cost arithmetic."""

from __future__ import annotations

import pytest

from gateway.backends.providers import ConfigError, ProviderConfig, TokenUsage, cost_usd

BASE = {
    "name": "gpt-4o-mini",
    "kind": "openai",
    "base_url": "https://api.openai.com/v1",
    "api_key_env": "OPENAI_API_KEY",
    "input_price_per_m": 0.15,
    "output_price_per_m": 0.6,
    "context_length": 128000,
    "capability_rank": 2,
}


def test_defaults_and_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    c = ProviderConfig.from_dict(BASE)
    assert c.upstream_model == "gpt-4o-mini" and c.tiers == ("interactive",)
    assert c.retry.max_attempts == 3 and c.breaker.failure_threshold == 5
    monkeypatch.setenv("OPENAI_API_KEY", "k1")
    assert c.api_key() == "k1"


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"kind": "cohere"}, "kind"),
        ({"base_url": "ftp://x"}, "base_url"),
        ({"api_key_env": "sk-123"}, "api_key_env"),
        ({"input_price_per_m": -1}, "input_price_per_m"),
        ({"cache_write_input_price_per_m": -1}, "cache_write_input_price_per_m"),
        ({"context_length": 0}, "context_length"),
        ({"tiers": []}, "tiers"),
        ({"tiers": ["gold"]}, "tiers"),
        ({"name": "auto"}, "name"),
        ({"retry": {"max_attempts": 0}}, "retry"),
        ({"breaker": {"cooldown": 3}}, "cooldown"),
        ({"timeouts": {"idle_s": 0}}, "timeouts"),
        ({"prices": 1}, "prices"),
        ({"capability_rank": "high"}, "capability_rank"),
    ],
)
def test_bad_config_names_the_field(patch: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field) as e:
        ProviderConfig.from_dict({**BASE, **patch})
    assert "gpt-4o-mini" in str(e.value) or patch.get("name") == "auto"


def test_cost_uses_the_provider_prices() -> None:
    u = TokenUsage(prompt_tokens=1_000_000, completion_tokens=500_000, cached_tokens=200_000)
    assert cost_usd(u, 0.15, 0.6) == pytest.approx(0.15 + 0.3)
    assert cost_usd(u, 3.0, 15.0, cached_price_per_m=0.3) == pytest.approx(
        0.8 * 3 + 0.2 * 0.3 + 7.5
    )
    assert (
        TokenUsage.from_openai(
            {
                "prompt_tokens": 5,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 9},
            }
        ).cached_tokens
        == 0
    )
    assert TokenUsage.from_openai({"prompt_tokens": -1, "completion_tokens": 2}) is None


def test_cache_writes_cost_the_write_price() -> None:
    u = TokenUsage(
        prompt_tokens=1_000_000,
        completion_tokens=0,
        cached_tokens=200_000,
        cache_write_tokens=300_000,
    )
    assert cost_usd(u, 3.0, 15.0, 0.3, 3.75) == pytest.approx(0.5 * 3 + 0.2 * 0.3 + 0.3 * 3.75)
    assert cost_usd(u, 3.0, 15.0) == pytest.approx(3.0)  # no cache prices: all at the input's
    # a write figure the rest of the prompt cannot hold is not believed
    said = {"prompt_tokens": 5, "completion_tokens": 2}
    details = {"cached_tokens": 3, "cache_write_tokens": 3}
    assert (
        TokenUsage.from_openai({**said, "prompt_tokens_details": details}).cache_write_tokens == 0
    )


def test_build_providers_refuses_duplicate_names() -> None:
    from gateway.backends.providers import build_providers

    class NoSession:  # never used: building a provider makes no call
        pass

    ps = build_providers([BASE, {**BASE, "name": "other", "kind": "anthropic"}], NoSession())  # type: ignore[arg-type]
    assert [type(p).__name__ for p in ps.values()] == ["OpenAIProvider", "AnthropicProvider"]
    with pytest.raises(ConfigError, match="twice"):
        build_providers([BASE, BASE], NoSession())  # type: ignore[arg-type]
