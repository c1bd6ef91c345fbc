"""What the request pipeline serves with: the narrow part of the gateway's state a request
needs (the config, the models, the model choice, tier admission, the grammar check, tracing,
the books every ledger writes to, the fallback counters), built once by gateway/state.py."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.accounts.ledger import Books
from gateway.backends.base import ServedModel
from gateway.backends.providers.metrics import ProviderMetrics
from gateway.config import GatewayConfig
from gateway.serving.choice import ModelChoice
from gateway.serving.tiers import Admission
from runtime.tracing import Tracing
from text.guide_compile import GuideChecker


@dataclass(frozen=True)
class Serving:
    config: GatewayConfig
    #: the models served, by name (a test may add one after start-up)
    models: dict[str, ServedModel]
    #: auto, team policies and fallback chains
    choice: ModelChoice
    admission: Admission
    #: the grammar check of constraints, off the event loop
    guides: GuideChecker
    #: OpenTelemetry (off: every span site is a no-op)
    tracing: Tracing
    #: what every request's ledger books with
    books: Books
    #: breaker-state gauge and duet:fallback_total
    fallbacks: ProviderMetrics
