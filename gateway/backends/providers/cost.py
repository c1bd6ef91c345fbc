"""Token usage of one provider call and what it cost: tokens × the provider's USD-per-1M prices.

`cached_tokens` are the part of `prompt_tokens` the provider served from its prompt cache; they
are billed at the cached-input price (Anthropic and OpenAI both discount them).
`cache_write_tokens` are the part it wrote to that cache (Anthropic's
`cache_creation_input_tokens`; OpenAI's API has no such figure), billed at the cache-write price
(Anthropic charges a premium for them). Costs are floats in USD; accounting rounds only when it
displays.
"""

from __future__ import annotations

from typing import TypeGuard

import msgspec


class TokenUsage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    #: of `prompt_tokens`, those written to the provider's prompt cache (none of `cached_tokens`)
    cache_write_tokens: int = 0
    #: True when the provider sent no usage and the counts were estimated from the text
    estimated: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def openai(self) -> dict[str, object]:
        """OpenAI's `usage` object; cache writes as `prompt_tokens_details.cache_write_tokens`
        when there are any (the gateway's own answers say them so: serving/openai_format.py)."""
        details: dict[str, int] = {"cached_tokens": self.cached_tokens}
        if self.cache_write_tokens:
            details["cache_write_tokens"] = self.cache_write_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": details,
        }

    @classmethod
    def from_openai(cls, usage: object) -> TokenUsage | None:
        if not isinstance(usage, dict):
            return None
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not _count(p) or not _count(c):
            return None
        details = usage.get("prompt_tokens_details")
        details = details if isinstance(details, dict) else {}
        cached = details.get("cached_tokens")
        cached = cached if _count(cached) and cached <= p else 0
        # a figure that does not fit in the rest of the prompt is not believed (none written)
        written = details.get("cache_write_tokens")
        written = written if _count(written) and written <= p - cached else 0
        return cls(
            prompt_tokens=p, completion_tokens=c, cached_tokens=cached, cache_write_tokens=written
        )


def _count(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def cost_usd(
    usage: TokenUsage,
    input_price_per_m: float,
    output_price_per_m: float,
    cached_price_per_m: float | None = None,
    cache_write_price_per_m: float | None = None,
) -> float:
    """USD for `usage` at the given per-1M-token prices (cache reads and writes at the input
    price unless theirs are given)."""
    cached_price = input_price_per_m if cached_price_per_m is None else cached_price_per_m
    write_price = input_price_per_m if cache_write_price_per_m is None else cache_write_price_per_m
    fresh = usage.prompt_tokens - usage.cached_tokens - usage.cache_write_tokens
    return (
        fresh * input_price_per_m
        + usage.cached_tokens * cached_price
        + usage.cache_write_tokens * write_price
        + usage.completion_tokens * output_price_per_m
    ) / 1_000_000


def estimate_tokens(text: str) -> int:
    """A rough count for providers that omit usage: about 4 characters a token for ASCII, one
    token per other character (CJK runs about one a character, emoji more): a flat 4 characters
    a token under-billed CJK text about four times."""
    if not text:
        return 0
    wide = sum(1 for c in text if ord(c) > 0x7F)
    return max(1, (len(text) - wide + 3) // 4 + wide)
