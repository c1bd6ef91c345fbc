"""Fallback chains: which model answers when the one asked for cannot.

Triggers (`Reason`), decided by pure functions so the gateway only reports what it saw:
- `saturated`: the self-hosted pool's interactive queue wait exceeds its bound (interactive
  requests only: batch requests are there to wait);
- `no_healthy_nodes`: the coordinator has no node that can serve the model;
- `breaker_open`: the provider's circuit breaker refused the call;
- `provider_5xx`: the provider failed (5xx, connection, timeout) after its retries;
- `provider_429`: the provider still rate-limited us after its retries (or asked for a wait
  longer than we hold a client).
A failure after chunks were streamed is never a trigger: the client already has tokens.

Choosing the target walks the chain configured for the model asked for, in order, skipping
models already tried, those the team forbids, those not serving the request's tier, those
whose context is too short, those `available` says no to (an open breaker), and — for batch
requests — paid models unless the team allows paid fallback for batch. Every skip is recorded
with its reason, so the gateway can log why a chain ran dry.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping

import msgspec

from gateway.backends.providers.catalog import ModelEntry
from gateway.backends.providers.config import Tier
from gateway.backends.providers.errors import ProviderError


class Reason(enum.StrEnum):
    SATURATED = "saturated"
    NO_HEALTHY_NODES = "no_healthy_nodes"
    BREAKER_OPEN = "breaker_open"
    PROVIDER_5XX = "provider_5xx"
    PROVIDER_429 = "provider_429"


class PoolSignal(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway knows about the self-hosted pool for one model."""

    healthy_nodes: int
    #: the current (or expected) wait of an interactive request in the queue, seconds
    interactive_queue_wait_s: float


def pool_trigger(signal: PoolSignal, tier: Tier, max_interactive_wait_s: float) -> Reason | None:
    if signal.healthy_nodes <= 0:
        return Reason.NO_HEALTHY_NODES
    if tier == "interactive" and signal.interactive_queue_wait_s > max_interactive_wait_s:
        return Reason.SATURATED
    return None


def error_trigger(err: ProviderError) -> Reason | None:
    if err.kind == "breaker_open":
        return Reason.BREAKER_OPEN
    if err.kind in ("stream_interrupted", "invalid_request"):
        return None
    if err.status == 429:
        return Reason.PROVIDER_429
    if err.status >= 500 or err.kind in ("connect", "timeout", "invalid_response"):
        return Reason.PROVIDER_5XX
    return None  # the request's own fault (400, 401...): another model would not help


class TeamFallbackPolicy(msgspec.Struct, frozen=True, kw_only=True):
    allow_paid_for_batch: bool = False
    forbidden_models: frozenset[str] = frozenset()


class FallbackDecision(msgspec.Struct, frozen=True, kw_only=True):
    from_model: str
    #: None: nothing in the chain can take the request
    to_model: str | None
    reason: Reason
    skipped: tuple[tuple[str, str], ...] = ()


class FallbackChains:
    def __init__(
        self, chains: Mapping[str, Iterable[str]], catalog: Mapping[str, ModelEntry]
    ) -> None:
        """`chains`: model → the models to try after it, in order (`gateway.toml`'s
        `[fallbacks] smollm2 = ["gpt-4o-mini"]`); refused if it names an unknown model, the
        model itself, or a model twice."""
        self.catalog = dict(catalog)
        self.chains: dict[str, tuple[str, ...]] = {}
        for model, chain in chains.items():
            chain = tuple(chain)
            if model not in self.catalog:
                raise ValueError(f"fallback chain for unknown model {model!r}")
            for m in chain:
                if m not in self.catalog:
                    raise ValueError(f"fallback chain of {model!r} names unknown model {m!r}")
            if model in chain or len(set(chain)) != len(chain):
                raise ValueError(f"fallback chain of {model!r} repeats a model: {list(chain)}")
            self.chains[model] = chain

    def next(
        self,
        origin: str,
        reason: Reason,
        *,
        tier: Tier,
        policy: TeamFallbackPolicy,
        prompt_tokens: int,
        max_tokens: int | None,
        tried: Iterable[str] = (),
        available: Callable[[str], bool] = lambda _: True,
    ) -> FallbackDecision:
        tried = {origin, *tried}
        skipped: list[tuple[str, str]] = []
        for name in self.chains.get(origin, ()):
            m = self.catalog[name]
            why = None
            if name in tried:
                why = "already_tried"
            elif name in policy.forbidden_models:
                why = "forbidden_by_team"
            elif tier not in m.tiers:
                why = f"tier_{tier}_not_served"
            elif tier == "batch" and m.paid and not policy.allow_paid_for_batch:
                why = "paid_not_allowed_for_batch"
            elif not m.fits(prompt_tokens, max_tokens):
                why = "context_too_short"
            elif not available(name):
                why = "unavailable"
            if why is None:
                return FallbackDecision(
                    from_model=origin, to_model=name, reason=reason, skipped=tuple(skipped)
                )
            skipped.append((name, why))
        return FallbackDecision(
            from_model=origin, to_model=None, reason=reason, skipped=tuple(skipped)
        )
