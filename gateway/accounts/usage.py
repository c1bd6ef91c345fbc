"""What a reply served, as the ledger bills it: one `Accounting` per reply, filled by its backend
as the pieces go out and read by the ledger once the reply ended, however it ended.
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
    #: node ids (or provider names) that served a leg of the request, in order
    nodes: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    model_used: str = ""
    #: the prompt went to a node or a provider (it may be computing it: paid if the client leaves)
    prompt_sent: bool = False
    #: times the stream moved to another node after its decode node died (cluster only)
    migrations: int = 0
    #: completion tokens of each decode leg of sample 0, in order (one entry unless migrated)
    leg_tokens: list[int] = field(default_factory=list)
    #: each sample's finish reason as relayed to the client (the trace's gen_ai.response.finish_reasons)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    #: per sample: the completion tokens of the pieces written to the client (`Piece.tokens`),
    #: counted by the relay; what an answer that broke off bills (`bill_sent`)
    sent: dict[int, int] = field(default_factory=dict)

    @property
    def total_completion_tokens(self) -> int:
        return sum(self.completion_tokens.values())

    def bill_sent(self) -> None:
        """The answer broke off: it bills the completion tokens its client was sent, not those
        made but never delivered (a piece still held back, or a whole answer that became a 502)."""
        self.completion_tokens = dict(self.sent)

    @property
    def served(self) -> bool:
        """Whether anyone served the request (a request no node or provider served is free)."""
        return bool(self.nodes) or self.first_token_at is not None
