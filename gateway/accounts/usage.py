"""What a request's answer cost, as the ledger bills it, in two records with one writer each:

- `Accounting`: what one reply served (tokens made, cached tokens, the nodes or provider that
  served it), filled by its backend as the pieces go out;
- `SentLog`: what the relay wrote to the client (per sample, the completion tokens of the
  pieces written, and each sample's finish reason as relayed), owned by the relay.

The ledger reads both once the reply ended, however it ended: an answer that broke off by the
backend's fault bills what its client was sent, any other what was made.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Accounting:
    """What one reply served: filled by its backend as the pieces go out, read by the ledger."""

    prompt_tokens: int = 0
    #: per sample
    completion_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: int = 0
    #: the prompt prefix the client asked the nodes to keep (its `cache_control`), in tokens
    retained_tokens: int = 0
    #: node ids (or provider names) that served a leg of the request, in order
    nodes: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    model_used: str = ""
    #: the prompt went to a node or a provider (it may be computing it: paid if the client leaves)
    prompt_sent: bool = False
    #: the provider reported its own token counts (an external model's usage)
    usage_reported: bool = False
    #: the prompt tokens the provider said it wrote to its prompt cache (Anthropic's
    #: `cache_creation_input_tokens`); None: no provider said (the nodes' figure is derived)
    reported_cache_writes: int | None = None
    #: times the stream moved to another node after its decode node died (cluster only)
    migrations: int = 0
    #: completion tokens of each decode leg of sample 0, in order (one entry unless migrated)
    leg_tokens: list[int] = field(default_factory=list)
    #: the version of the model that served it (None: the model has no versions)
    version: str | None = None

    @property
    def total_completion_tokens(self) -> int:
        return sum(self.completion_tokens.values())

    @property
    def cache_write_tokens(self) -> int:
        """Prompt tokens this request wrote to a cache, billed at the write price (Anthropic's
        `cache_creation_input_tokens`): what its provider reported, the provider's own count
        being what it bills; else the tokens of the kept prefix the nodes computed (those they
        did not read from the cache). Never more than the prompt's tokens not read."""
        fresh = max(0, self.prompt_tokens - self.cached_tokens)
        if self.reported_cache_writes is not None:
            return min(max(self.reported_cache_writes, 0), fresh)
        return max(0, min(self.retained_tokens, self.prompt_tokens) - self.cached_tokens)

    @property
    def served(self) -> bool:
        """Whether anyone served the request (a request no node or provider served is free)."""
        return bool(self.nodes) or self.first_token_at is not None


@dataclass
class SentLog:
    """What a relay wrote to its client."""

    #: per sample: the completion tokens of the pieces written (`Piece.tokens`), counted as each
    #: write goes out; what an answer that broke off bills
    sent: dict[int, int] = field(default_factory=dict)
    #: each sample's finish reason as relayed (the trace's gen_ai.response.finish_reasons)
    finish_reasons: dict[int, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.sent.values())
