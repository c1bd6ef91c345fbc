"""The seam between the public API and whoever generates tokens.

A model's `kind` picks its `Backend`: "cluster" → `cluster.ClusterBackend` (duet's own P/D
nodes); "external" → `provider_backend.ProviderBackend` (a commercial API, gateway/providers/). The API layer
hands a `Job` and reads `Piece`s; the backend fills `Outcome` as it goes, so accounting knows
what happened even when the stream breaks or the client leaves.

Errors: before the first piece a backend raises `APIError` (the request fails as a whole);
after it, `MidStreamError` (the client already has part of the answer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gateway.config import ModelConfig
from protocol.openai import APIError, CompletionLogprobs


@dataclass
class Job:
    request_id: str
    model: ModelConfig
    #: "chat" or "completion": external providers speak one or the other
    endpoint: str
    prompt_ids: list[int]
    #: the chat messages (text content) for "chat" jobs: external providers need them, not ids
    messages: list[dict[str, Any]] | None
    #: node sampling fields: max_tokens, temperature, top_p, seed, stop, top_k, ...
    params: dict[str, Any]
    n: int
    tier: str
    #: the prompt as the client sent it, for "completion" jobs (text or token ids)
    prompt: str | list[int] | None = None
    #: the client streams: a backend that can answer whole (an external API) does so otherwise
    stream: bool = True


@dataclass
class Piece:
    """A delta of sample `index`."""

    index: int
    text: str
    finish_reason: str | None = None
    #: the tokens' logprobs when the request asked (completions shape; duet's nodes only)
    logprobs: CompletionLogprobs | None = None
    #: the next piece has already arrived: a relay may hold this one and send both in one write
    more: bool = False


@dataclass
class Outcome:
    prompt_tokens: int = 0
    #: per sample
    completion_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: int = 0
    #: node ids (or provider names) that served a leg of the request, in order
    nodes: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    model_used: str = ""

    @property
    def total_completion_tokens(self) -> int:
        return sum(self.completion_tokens.values())


class MidStreamError(APIError):
    """The backend failed after the first piece went out."""


class Backend(ABC):
    @abstractmethod
    def stream(self, job: Job, out: Outcome) -> AsyncIterator[Piece]:
        """Pieces of every sample, interleaved; ends when all samples finished."""
