"""gateway.toml's external models, fallback chains, `[auto]` and `[teams.*]`: the README's
example loads as documented, and each mistake an operator can make is refused by name."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from gateway.backends.providers import ProviderConfig
from gateway.config import ConfigError, TeamPolicy, parse_config, provider_table

README = Path(__file__).parents[2] / "README.md"
EXT = {
    "kind": "external",
    "provider": "openai",
    "base_url": "http://127.0.0.1:9/v1",
    "max_model_len": 1000,
}


def readme_config() -> dict[str, Any]:
    section = README.read_text().split("### External models, fallback", 1)[1]
    return tomllib.loads(re.search(r"```toml\n(.*?)```", section, re.S).group(1))  # type: ignore[union-attr]


def test_readme_example_loads() -> None:
    cfg = parse_config(readme_config())
    gpt, claude = cfg.models["gpt-4o-mini"], cfg.models["claude-sonnet"]
    assert cfg.models["smollm2"].fallback == ("gpt-4o-mini", "claude-sonnet")
    p = ProviderConfig.from_dict(provider_table(claude))
    assert (p.kind, p.upstream_model, p.context_length, p.tiers, p.capability_rank) == (
        "anthropic",
        "claude-sonnet-4-5",
        200000,
        ("interactive",),
        3,
    )
    assert ProviderConfig.from_dict(provider_table(gpt)).breaker.failure_threshold == 5
    assert cfg.auto is not None and cfg.auto.models == ("smollm2", "gpt-4o-mini", "claude-sonnet")
    assert cfg.team_policy("research").forbid == ("gpt-4o-mini",)
    assert cfg.team_policy("research").weight == 2.0
    assert cfg.team_policy("someone-else") == TeamPolicy(allow_paid_for_batch=False)
    assert cfg.tiers.interactive_fallback_wait_s == 1.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"models": {"g": {**EXT, "provider": "cohere"}}}, 'provider = "openai" or "anthropic"'),
        (
            {"models": {"g": {k: v for k, v in EXT.items() if k != "max_model_len"}}},
            "needs max_model_len",
        ),
        ({"models": {"g": {**EXT, "breaker": {"cooldwn_s": 1}}}}, "cooldwn_s"),
        ({"models": {"g": {**EXT, "base_url": "ftp://x"}}}, "base_url"),
        ({"models": {"g": {**EXT, "api_key_env": "sk-live-123"}}}, "api_key_env"),
        (
            {"models": {"a": {"tokenizer": "x", "base_url": "http://x"}}},
            'are for kind = "external"',
        ),
        (
            {"models": {"a": {"tokenizer": "x", "fallback": ["nope"]}}},
            "fallback names unknown models: nope",
        ),
        ({"models": {"a": {"tokenizer": "x", "fallback": ["a"]}}}, "names the model itself"),
        ({"models": {"a": {"tokenizer": "x", "tiers": ["gold"]}}}, "tiers must list"),
        ({"models": {"a": {"tokenizer": "x", "capability_rank": 0}}}, "capability_rank"),
        ({"models": {"auto": {"tokenizer": "x"}}}, "reserved"),
        (
            {"models": {"a": {"tokenizer": "x"}}, "auto": {"models": ["b"]}},
            "[auto] models names unknown",
        ),
        ({"models": {"a": {"tokenizer": "x"}}, "auto": {"rank_for": {"simple": 1}}}, "rank_for"),
        (
            {"models": {"a": {"tokenizer": "x"}}, "teams": {"t": {"auto_pin": {"easy": "a"}}}},
            "auto_pin maps labels",
        ),
        (
            {"models": {"a": {"tokenizer": "x"}}, "teams": {"t": {"forbid": ["b"]}}},
            "forbid names unknown",
        ),
        (
            {"models": {"a": {"tokenizer": "x"}}, "teams": {"t": {"rpm": 5}}},
            "[teams.t] has unknown keys: rpm",
        ),
    ],
)
def test_mistakes_are_refused_by_name(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert message in str(e.value)
