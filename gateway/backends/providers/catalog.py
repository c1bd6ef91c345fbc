"""`ModelEntry`: what routing needs to know about a model, self-hosted or external.

Fallback chains and `model: "auto"` choose among these by tier, context length, capability
rank and price; they never look at how a model is reached. External models come from their
`ProviderConfig` (`ModelEntry.from_provider`); the gateway builds entries for its self-hosted
models from its own config (`paid=False`: batch requests may always use them).
"""

from __future__ import annotations

import msgspec

from gateway.backends.providers.config import ProviderConfig, Tier


class ModelEntry(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    capability_rank: int
    context_length: int
    tiers: tuple[Tier, ...] = ("interactive", "batch")
    #: USD per 1M tokens (self-hosted models may carry an internal price, or 0)
    input_price_per_m: float = 0.0
    output_price_per_m: float = 0.0
    #: billed by a third party: batch requests reach it only if the team allows
    paid: bool = False

    @classmethod
    def from_provider(cls, c: ProviderConfig) -> ModelEntry:
        return cls(
            name=c.name,
            capability_rank=c.capability_rank,
            context_length=c.context_length,
            tiers=c.tiers,
            input_price_per_m=c.input_price_per_m,
            output_price_per_m=c.output_price_per_m,
            paid=True,
        )

    def expected_cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (
            prompt_tokens * self.input_price_per_m + completion_tokens * self.output_price_per_m
        ) / 1e6

    def fits(self, prompt_tokens: int, max_tokens: int | None) -> bool:
        return prompt_tokens + (max_tokens or 0) <= self.context_length
