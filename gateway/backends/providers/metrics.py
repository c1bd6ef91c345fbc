"""Prometheus metrics of the providers, registered on a registry the caller passes.

- `duet:provider_breaker_state{provider}`: 0 closed, 1 half-open, 2 open. Read from each
  breaker at scrape time (a custom collector), so the open → half-open transition, which
  happens by the clock alone, shows without anyone calling the provider.
- `duet:fallback_total{from,to,reason}`: requests answered by another model than the one
  asked for (`to="none"` when the chain had nothing left). Reasons: fallback.Reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.backends.providers.base import Provider


class _BreakerCollector(Collector):
    def __init__(self, providers: Callable[[], Iterable[Provider]]) -> None:
        self._providers = providers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "duet:provider_breaker_state",
            "Circuit breaker state per provider: 0 closed, 1 half-open, 2 open",
            labels=["provider"],
        )
        for p in self._providers():
            g.add_metric([p.name], float(p.breaker.state))
        yield g


class ProviderMetrics:
    def __init__(
        self, registry: CollectorRegistry, providers: Callable[[], Iterable[Provider]]
    ) -> None:
        """`providers` is called at each scrape, so a config reload that replaces providers
        needs no re-registration."""
        registry.register(_BreakerCollector(providers))
        self.fallback_total = Counter(
            "duet:fallback_total",
            "Requests served by a fallback model, by the model asked for, "
            "the model used and the trigger",
            ["from", "to", "reason"],
            registry=registry,
        )

    def count_fallback(self, from_model: str, to_model: str | None, reason: str) -> None:
        self.fallback_total.labels(from_model, to_model or "none", reason).inc()


def register_provider_metrics(
    registry: CollectorRegistry, providers: Callable[[], Iterable[Provider]]
) -> ProviderMetrics:
    return ProviderMetrics(registry, providers)
