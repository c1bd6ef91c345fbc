"""Retention a client asked for: a prompt prefix whose KV blocks a node keeps for a while.

Anthropic's `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` marks where a prompt's
cacheable prefix ends; the gateway renders the prompt, finds how many of its tokens that prefix
covers, and sends a `KVRetain` on the node legs. A node keeps the full blocks of those tokens
(in its cache domain: the hashes are salted as every prompt's) in its pool, or in a spill tier
when the pool needs the room, until the ttl runs out: they are evicted last and never dropped
from a tier while retained (engine/retention.py). A later request that marks the same prefix
renews the ttl.
"""

from __future__ import annotations

import enum

import msgspec

#: the longest retention a request may ask for (Anthropic's longest ttl)
MAX_RETAIN_S = 3600.0


class RetainTTL(enum.StrEnum):
    """Anthropic's ttl words."""

    FIVE_MINUTES = "5m"
    ONE_HOUR = "1h"

    @property
    def seconds(self) -> float:
        return 300.0 if self is RetainTTL.FIVE_MINUTES else 3600.0


class KVRetain(msgspec.Struct, frozen=True, kw_only=True):
    """Keep the full KV blocks of the prompt's first `tokens` tokens for `ttl_s` seconds."""

    tokens: int
    ttl_s: float

    def check(self) -> None:
        """ValueError naming what is wrong (a node's 400)."""
        if self.tokens < 1:
            raise ValueError(f"retain.tokens must be at least 1, got {self.tokens}")
        if not 0 < self.ttl_s <= MAX_RETAIN_S:
            raise ValueError(f"retain.ttl_s must be in (0, {MAX_RETAIN_S:g}], got {self.ttl_s}")
