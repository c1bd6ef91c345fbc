"""A gateway-wide bound on the calls to external providers running at once (`[server]
max_provider_calls`). A team's limits (`max_concurrent`, rpm, budget) bound each team; this
bounds all of them together: every provider call holds a socket, a handler and the provider's
rate limit of the operator's account, and enough teams at their limits would otherwise hold
any number of them. A call over the bound is refused at once — 503 `overloaded` with
Retry-After, OpenAI's error body, like tier admission's shedding — rather than queued: the
client (or the batch runner, which retries a 503) tries again, and the prompt was never sent,
so nothing is charged.

Invariants: `running` (and the `duet:provider_calls_running` gauge) counts the calls holding a
slot; a slot is taken before the prompt is sent and given back when the call ends — its last
piece, an error, or the client leaving (the backend's `finally`); 0 is no bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from gateway.backends.base import Shed
from gateway.config import Tier
from gateway.metrics import GatewayMetrics

#: what a refused caller is told to wait: a provider call's slot frees within seconds
RETRY_AFTER_S = 1.0


class ProviderSlots:
    def __init__(self, limit: int, metrics: GatewayMetrics) -> None:
        self.limit = limit
        self.running = 0
        self._metrics = metrics

    @contextlib.contextmanager
    def slot(self, model: str, tier: Tier) -> Iterator[None]:
        """Hold one of the slots for a call to `model`'s provider, or raise `Shed` (503)."""
        if self.limit and self.running >= self.limit:
            self._metrics.shed.labels(tier=tier, reason="provider_calls").inc()
            raise Shed(
                f"model {model!r}: this gateway runs {self.limit} calls to external providers at "
                "once (its [server] max_provider_calls); retry shortly",
                RETRY_AFTER_S,
            )
        self.running += 1
        self._metrics.provider_calls.inc()
        try:
            yield
        finally:
            self.running -= 1
            self._metrics.provider_calls.dec()
