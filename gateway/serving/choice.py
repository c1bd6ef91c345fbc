"""Which model answers a request: `model: "auto"`, the team's policy, and fallback chains.

`ModelChoice` is built once the models are loaded; it turns the gateway's models into the
providers package's `ModelEntry` catalog (self-hosted models are free for batch, external ones
`paid`) and answers three questions for the request path (generate.py, attempts.py):
- `auto(...)`: the model `auto` picks (the classifier's label → the cheapest capable model,
  with the team's pins and bans, the tier's rules, context and availability);
- `trigger(err, served, tier)`: whether a failure before the first piece is a fallback
  trigger, and which (fallback.Reason);
- `next(...)`: the next model of the origin's chain that can take the request.

A model is unavailable while its provider's breaker is open (half-open lets probes through),
or when it cannot take the request at all (an external chat model asked for a completion, n > 1
on Anthropic, a feature of the request it does not serve: gateway/serving/features.py). Models added
after start-up (tests) have no chain and are not auto candidates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.backends.base import ServedModel
from gateway.backends.providers.auto import AutoChoice, AutoPolicy, AutoRouter
from gateway.backends.providers.catalog import ModelEntry
from gateway.backends.providers.fallback import (
    FallbackChains,
    FallbackDecision,
    Reason,
    TeamFallbackPolicy,
)
from gateway.config import GatewayConfig, ModelConfig, TeamPolicy, Tier
from gateway.config_features import Feature, model_features
from gateway.serving.requests import Endpoint
from protocol.openai import APIError


def _entry(s: ServedModel) -> ModelEntry:
    c = s.config
    return ModelEntry(
        name=c.name,
        capability_rank=c.capability_rank,
        context_length=s.max_model_len,
        tiers=c.tiers,
        input_price_per_m=c.input_usd_per_mtok,
        output_price_per_m=c.output_usd_per_mtok,
        paid=c.kind == "external",
    )


@dataclass(frozen=True)
class Need:
    """What a request needs of a model: its endpoint and n, its tier, its team's policy, and its
    size (prompt tokens as first counted; max_tokens as asked)."""

    endpoint: Endpoint
    n: int
    tier: Tier
    policy: TeamPolicy
    prompt_tokens: int
    max_tokens: int | None
    #: the optional features the request uses (tools, structured outputs, …): a model that
    #: lacks one is no candidate
    features: frozenset[Feature] = frozenset()


class ModelChoice:
    def __init__(self, config: GatewayConfig, models: Mapping[str, ServedModel]) -> None:
        self.config = config
        self.models = models
        self.catalog = {name: _entry(s) for name, s in models.items()}
        self.chains = FallbackChains(
            {n: s.config.fallback for n, s in models.items() if s.config.fallback}, self.catalog
        )
        self.router: AutoRouter | None = None
        self.auto_catalog: dict[str, ModelEntry] = {}
        if config.auto is not None:
            self.router = AutoRouter(rank_for=config.auto.rank_for)
            # embedding models answer no chat, an adapter answers its own task, a model kept
            # to some teams must reach no other: none is a candidate unless [auto] names it
            names = config.auto.models or tuple(
                n
                for n, s in models.items()
                if s.config.kind != "embedding"
                and s.config.adapter is None
                and s.config.teams is None
            )
            self.auto_catalog = {n: self.catalog[n] for n in names}

    @property
    def serves_auto(self) -> bool:
        """Whether `model: "auto"` is served (the `[auto]` section)."""
        return self.router is not None

    def chain(self, origin: str) -> tuple[ModelConfig, ...]:
        """`origin` and the models of its fallback chain, in order (the ones served)."""
        names = (origin, *self.chains.chains.get(origin, ()))
        return tuple(self.models[n].config for n in names if n in self.models)

    def available(
        self, name: str, endpoint: Endpoint, n: int, needs: frozenset[Feature] = frozenset()
    ) -> bool:
        s = self.models.get(name)
        return (
            s is not None
            and s.backend.available()
            and s.backend.usable_for(endpoint, n)
            and needs <= model_features(s.config)
        )

    def auto(self, messages: list[dict[str, str]], need: Need) -> AutoChoice:
        assert self.router is not None
        p = need.policy
        ap = AutoPolicy(
            pin=dict(p.auto_pin),
            forbid=frozenset(p.forbid),
            allow_paid_for_batch=p.allow_paid_for_batch,
        )
        return self.router.route(
            messages,
            self.auto_catalog,
            tier=need.tier,
            policy=ap,
            prompt_tokens=need.prompt_tokens,
            max_tokens=need.max_tokens,
            available=lambda m: self.available(m, need.endpoint, need.n, need.features),
        )

    @staticmethod
    def trigger(err: APIError, served: ServedModel, tier: Tier) -> Reason | None:
        """Whether `err`, raised before the first piece, is a fallback trigger (the backend
        says)."""
        return served.generator().fallback_reason(err, tier)

    def has_chain(self, origin: str) -> bool:
        return bool(self.chains.chains.get(origin))

    def next(self, origin: str, reason: Reason, need: Need, tried: list[str]) -> FallbackDecision:
        if origin not in self.chains.chains:
            return FallbackDecision(from_model=origin, to_model=None, reason=reason)
        tp = TeamFallbackPolicy(
            allow_paid_for_batch=need.policy.allow_paid_for_batch,
            forbidden_models=frozenset(need.policy.forbid),
        )
        return self.chains.next(
            origin,
            reason,
            tier=need.tier,
            policy=tp,
            prompt_tokens=need.prompt_tokens,
            max_tokens=need.max_tokens,
            tried=tried,
            available=lambda m: self.available(m, need.endpoint, need.n, need.features),
        )
