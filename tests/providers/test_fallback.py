"""Fallback decisions: each trigger fires, and the chain is walked with the team's and the
tier's rules (batch never reaches a paid model unless allowed)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gateway.backends.providers import (
    ModelEntry,
    ProviderConfig,
    ProviderError,
    register_provider_metrics,
)
from gateway.backends.providers.fallback import (
    FallbackChains,
    PoolSignal,
    Reason,
    TeamFallbackPolicy,
    error_trigger,
    pool_trigger,
)
from tests.providers.fakes import Fault as ProviderFault

CATALOG = {
    "smollm2": ModelEntry(name="smollm2", capability_rank=1, context_length=8192),
    "gpt-4o-mini": ModelEntry.from_provider(
        ProviderConfig.from_dict(
            {
                "name": "gpt-4o-mini",
                "kind": "openai",
                "base_url": "https://api.example.test/v1",
                "input_price_per_m": 0.15,
                "output_price_per_m": 0.6,
                "context_length": 128000,
                "capability_rank": 2,
                "tiers": ["interactive", "batch"],
            }
        )
    ),
    "claude": ModelEntry(
        name="claude",
        capability_rank=3,
        context_length=4096,
        tiers=("interactive",),
        input_price_per_m=3,
        output_price_per_m=15,
        paid=True,
    ),
    "smollm2-b": ModelEntry(name="smollm2-b", capability_rank=1, context_length=2048),
}
CHAINS = FallbackChains({"smollm2": ["gpt-4o-mini", "claude", "smollm2-b"]}, CATALOG)
OPEN = TeamFallbackPolicy()


def test_pool_triggers() -> None:
    assert (
        pool_trigger(PoolSignal(healthy_nodes=0, interactive_queue_wait_s=0), "batch", 1.0)
        is Reason.NO_HEALTHY_NODES
    )
    busy = PoolSignal(healthy_nodes=3, interactive_queue_wait_s=2.5)
    assert pool_trigger(busy, "interactive", 2.0) is Reason.SATURATED
    assert pool_trigger(busy, "interactive", 3.0) is None
    assert pool_trigger(busy, "batch", 2.0) is None  # batch waits instead


def test_error_triggers() -> None:
    assert error_trigger(ProviderError(503, "x", kind="breaker_open")) is Reason.BREAKER_OPEN
    assert error_trigger(ProviderError(502, "x", kind="connect")) is Reason.PROVIDER_5XX
    assert error_trigger(ProviderError(504, "x", kind="timeout")) is Reason.PROVIDER_5XX
    assert error_trigger(ProviderError(500, "x")) is Reason.PROVIDER_5XX
    assert error_trigger(ProviderError(429, "x", retry_after=90)) is Reason.PROVIDER_429
    assert error_trigger(ProviderError(400, "x")) is None
    assert error_trigger(ProviderError(401, "x")) is None
    assert error_trigger(ProviderError(502, "x", kind="stream_interrupted")) is None


@pytest.mark.parametrize("reason", list(Reason))
def test_each_trigger_picks_the_first_usable_model(reason: Reason) -> None:
    d = CHAINS.next(
        "smollm2", reason, tier="interactive", policy=OPEN, prompt_tokens=100, max_tokens=100
    )
    assert (d.from_model, d.to_model, d.reason, d.skipped) == ("smollm2", "gpt-4o-mini", reason, ())


def test_chain_continues_past_tried_and_unavailable() -> None:
    d = CHAINS.next(
        "smollm2",
        Reason.PROVIDER_5XX,
        tier="interactive",
        policy=OPEN,
        prompt_tokens=10,
        max_tokens=10,
        tried={"gpt-4o-mini"},
        available=lambda m: m != "claude",
    )
    assert d.to_model == "smollm2-b"
    assert d.skipped == (("gpt-4o-mini", "already_tried"), ("claude", "unavailable"))


def test_batch_never_falls_back_to_paid_unless_allowed() -> None:
    d = CHAINS.next(
        "smollm2",
        Reason.NO_HEALTHY_NODES,
        tier="batch",
        policy=OPEN,
        prompt_tokens=10,
        max_tokens=10,
    )
    assert d.to_model == "smollm2-b"
    assert d.skipped == (
        ("gpt-4o-mini", "paid_not_allowed_for_batch"),
        ("claude", "tier_batch_not_served"),
    )
    allowed = TeamFallbackPolicy(allow_paid_for_batch=True)
    d = CHAINS.next(
        "smollm2",
        Reason.NO_HEALTHY_NODES,
        tier="batch",
        policy=allowed,
        prompt_tokens=10,
        max_tokens=10,
    )
    assert d.to_model == "gpt-4o-mini"


def test_forbidden_and_context_and_exhaustion() -> None:
    team = TeamFallbackPolicy(forbidden_models=frozenset({"gpt-4o-mini"}))
    d = CHAINS.next(
        "smollm2",
        Reason.SATURATED,
        tier="interactive",
        policy=team,
        prompt_tokens=3500,
        max_tokens=1000,
    )
    assert d.to_model is None
    assert d.skipped == (
        ("gpt-4o-mini", "forbidden_by_team"),
        ("claude", "context_too_short"),
        ("smollm2-b", "context_too_short"),
    )
    assert (
        CHAINS.next(
            "claude",
            Reason.PROVIDER_5XX,
            tier="interactive",
            policy=OPEN,
            prompt_tokens=1,
            max_tokens=None,
        ).to_model
        is None
    )


def test_bad_chains_are_refused() -> None:
    for chains in (
        {"smollm2": ["nope"]},
        {"nope": ["claude"]},
        {"smollm2": ["smollm2"]},
        {"smollm2": ["claude", "claude"]},
    ):
        with pytest.raises(ValueError):
            FallbackChains(chains, CATALOG)


def test_fallback_counter() -> None:
    reg = CollectorRegistry()
    m = register_provider_metrics(reg, list)
    m.count_fallback("smollm2", "gpt-4o-mini", Reason.SATURATED)
    m.count_fallback("smollm2", None, Reason.NO_HEALTHY_NODES)
    labels = {"from": "smollm2", "to": "gpt-4o-mini", "reason": "saturated"}
    assert reg.get_sample_value("duet:fallback_total", labels) == 1
    assert (
        reg.get_sample_value(
            "duet:fallback_total", {**labels, "to": "none", "reason": "no_healthy_nodes"}
        )
        == 1
    )


async def test_provider_failure_falls_back_along_the_chain(
    fake_anthropic, fake_openai, make_provider
) -> None:  # type: ignore[no-untyped-def]
    """The pieces composed as the gateway will: a provider's 5xx (after its retries) is a
    trigger, the chain names the next model, that model answers and is costed at its prices."""
    primary = make_provider(fake_anthropic, name="claude", retry={"max_attempts": 2})
    backup = make_provider(
        fake_openai, name="gpt-4o-mini", input_price_per_m=0.15, output_price_per_m=0.6
    )
    providers = {p.name: p for p in (primary, backup)}
    catalog = {n: ModelEntry.from_provider(p.config) for n, p in providers.items()}
    chains = FallbackChains({"claude": ["gpt-4o-mini"]}, catalog)
    reg = CollectorRegistry()
    metrics = register_provider_metrics(reg, lambda: providers.values())
    fake_anthropic.faults.extend([ProviderFault.http(500), ProviderFault.http(503)])
    body = {"messages": [{"role": "user", "content": "hello world"}]}

    model, tried = "claude", set()
    while True:
        try:
            result = await providers[model].chat(body)
            break
        except ProviderError as e:
            reason = error_trigger(e)
            assert reason is Reason.PROVIDER_5XX
            tried.add(model)
            d = chains.next(
                "claude",
                reason,
                tier="interactive",
                policy=OPEN,
                prompt_tokens=2,
                max_tokens=None,
                tried=tried,
                available=lambda m: providers[m].breaker.allow(),
            )
            metrics.count_fallback("claude", d.to_model, d.reason)
            assert d.to_model is not None
            model = d.to_model
    assert result.model == "gpt-4o-mini" and len(fake_anthropic.requests) == 2
    assert result.cost_usd == pytest.approx((2 * 0.15 + 3 * 0.6) / 1e6)
    assert (
        reg.get_sample_value(
            "duet:fallback_total", {"from": "claude", "to": "gpt-4o-mini", "reason": "provider_5xx"}
        )
        == 1
    )
