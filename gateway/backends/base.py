"""The seams between the request pipeline and whoever generates tokens or embeddings.

A model's `kind` picks its backend: "cluster" → `cluster.ClusterBackend` (duet's own P/D
nodes); "external" → `provider.ProviderBackend` (a commercial API, backends/providers/);
"embedding" → `embedding.ClusterEmbedder` (an `Embedder`: nodes started with `--task embed`).
The pipeline (gateway/serving/) asks a `Backend`, for one `Attempt` of a `Request`, to `open` a
`Reply`: the `Piece`s of the answer, and the reply's own `Accounting` — what was served, by
whom, with how many tokens — which the ledger reads once the reply ended, however it ended (the
stream broke, the client left). The backend returns its accounting; nothing is written into an
argument of the caller's.

What callers need to know of a backend is said by the interface, never by its class: which
endpoints it serves (`usable_for`), whether it is available now (`available`: an open breaker
is not), why an error is a fallback trigger (`fallback_reason`), and whether its requests wait
in the tier queues (`uses_tier_queues`: the self-hosted pool's guard).

Errors: before the first piece a backend raises `APIError` (the request fails as a whole);
after it, `MidStreamError` (the client already has part of the answer).

An `Embedder` is the embeddings' seam of the same shape: `open(EmbeddingAttempt)` gives an
`EmbeddingReply` whose `vectors()` are awaited and whose `accounting` is the reply's own.
`ServedModel.generator()` / `.embedder()` give a model's seam of either kind, or the 400 that
says the model is of the other kind: nobody switches on a backend's class but them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.accounts.usage import Accounting
from gateway.config import ModelConfig, Tier
from gateway.serving.requests import Endpoint, Request
from protocol.chat import ThinkingBlock
from protocol.embeddings import NodeEmbeddingResponse
from protocol.openai import APIError, CompletionLogprobs
from protocol.retention import KVRetain
from protocol.structured import Guide
from protocol.tools import ToolCallDelta
from text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gateway.backends.providers.fallback import Reason


@dataclass(frozen=True)
class Attempt:
    """One try of a request on one model: the model, the ids, and the max_tokens that fit it."""

    request_id: str
    model: ModelConfig
    #: the prompt's token ids on this model's tokenizer ([] for an external model)
    prompt_ids: list[int]
    max_tokens: int
    tier: Tier
    #: the caller's prefix-cache domain (GatewayConfig.cache_domain): the block hashes' salt and
    #: the legs' `cache_salt`, so no team's cache answers another's prompt
    cache_domain: str = ""
    #: the constrained-decoding guide of both legs (response_format's, or a forced tool
    #: choice's on this model's tool format); None: unconstrained
    guide: Guide | None = None
    #: keep the prompt prefix's KV this long on the nodes (the client's `cache_control`)
    retain: KVRetain | None = None
    #: the prompt tokens the request's reservation holds (an external model's upper bound):
    #: what a call whose provider never reported its usage bills
    reserved_prompt_tokens: int = 0


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
    #: chat: tool-call deltas of this sample (gateway/serving/tool_reply.py), in OpenAI's
    #: stream shape
    tool_calls: list[ToolCallDelta] | None = None
    #: the completion tokens this piece delivers: its own, and those of earlier deltas that
    #: showed nothing yet (a byte of an unfinished UTF-8 character, text a tool parser holds
    #: back). A relay counts them sent when the piece's bytes are written (its `SentLog`).
    tokens: int = 0
    #: the ids of those tokens, where the backend knows them (duet's nodes; [] otherwise): the
    #: token-in/token-out endpoint answers with them
    token_ids: list[int] = field(default_factory=list)
    #: chat: the model's reasoning this piece carries (its text; a provider's signed blocks or
    #: their pieces: protocol/chat.py `ThinkingBlock`)
    reasoning: str = ""
    thinking: list[ThinkingBlock] | None = None


class Reply:
    """One attempt's answer: iterate it for the pieces; `accounting` is the reply's own record
    of what was served. `aclose()` ends it now (not at GC): a backend aborts its work there."""

    def __init__(
        self, pieces: Callable[[Accounting], AsyncGenerator[Piece, None]], prompt_tokens: int = 0
    ) -> None:
        self.accounting = Accounting(prompt_tokens=prompt_tokens)
        self._it = pieces(self.accounting)

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._it

    async def aclose(self) -> None:
        await self._it.aclose()


class MidStreamError(APIError):
    """The backend failed after the first piece went out."""


def midstream(e: BaseException) -> MidStreamError:
    """A failure after the first piece, as the seam's `MidStreamError`."""
    if isinstance(e, APIError):
        return MidStreamError(e.status, e.message, e.type, e.param, e.code)
    return MidStreamError(
        502,
        f"the decode node failed mid-stream: {e}",
        type_="upstream_error",
        code="upstream_failed_midstream",
    )


class Shed(APIError):
    """Overloaded: no capacity for this request now (the tier queues, the provider-call bound,
    this process out of descriptors); 503 with Retry-After, and no backend is blamed."""

    def __init__(
        self, message: str, retry_after_s: float, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(
            503,
            message,
            type_="service_unavailable",
            code="overloaded",
            retry_after_s=retry_after_s,
            headers=headers,
        )


class Backend(ABC):
    """A model's generation seam (see the module docstring)."""

    #: requests wait in the gateway's tier queues (they guard the self-hosted pool only)
    uses_tier_queues: bool = False

    @abstractmethod
    def open(self, request: Request, attempt: Attempt) -> Reply:
        """The reply to one attempt: pieces of every sample, interleaved; ends when all
        samples finished."""

    def usable_for(self, endpoint: Endpoint, n: int) -> bool:
        """Whether this backend can take such a request at all."""
        return True

    def available(self) -> bool:
        """Whether it takes requests now (an external API's breaker may be open)."""
        return True

    def fallback_reason(self, err: APIError, tier: Tier) -> Reason | None:
        """Why `err` (raised before the first piece) moves the request along its model's
        fallback chain; None: it is the request's own failure, no fallback."""
        return None


@dataclass(frozen=True)
class EmbeddingAttempt:
    """One embeddings request on one model: its inputs' token ids and the vector size asked."""

    request_id: str
    model: ModelConfig
    inputs: list[list[int]]
    #: the vectors' size the client asked for (None: the model's)
    dimensions: int | None
    tier: Tier


class EmbeddingReply:
    """One embeddings attempt's answer: await `vectors()`; `accounting` is the reply's own
    record of what was served (the prompt's tokens, the nodes that answered)."""

    def __init__(
        self,
        vectors: Callable[[Accounting], Awaitable[NodeEmbeddingResponse]],
        attempt: EmbeddingAttempt,
    ) -> None:
        self.accounting = Accounting(
            prompt_tokens=sum(map(len, attempt.inputs)), model_used=attempt.model.name
        )
        self._vectors = vectors

    async def vectors(self) -> NodeEmbeddingResponse:
        return await self._vectors(self.accounting)


class Embedder(ABC):
    """An embedding model's seam: what it serves and how it answers."""

    #: its requests wait in the tier queues (the self-hosted pool's guard)
    uses_tier_queues: bool = True
    #: the model's vector size when the gateway knows it (None: the node checks `dimensions`)
    embedding_size: int | None = None

    @abstractmethod
    def open(self, attempt: EmbeddingAttempt) -> EmbeddingReply:
        """The reply to one attempt (its vectors are computed when awaited)."""

    def usable_for(self, endpoint: Endpoint, n: int) -> bool:
        return endpoint == Endpoint.EMBEDDING

    def available(self) -> bool:
        return True


@dataclass
class ServedModel:
    """A model the gateway serves: its config, the backend that answers it, the tokenizer
    the gateway counts its prompts with (None: an external model, its provider counts), and
    its context length."""

    config: ModelConfig
    backend: Backend | Embedder
    tokenizer: Tokenizer | None
    #: prompt + completion tokens the model takes
    max_model_len: int

    def __post_init__(self) -> None:
        # which seam it is, once: an ABC's isinstance costs a lookup on every request otherwise
        self._generates = isinstance(self.backend, Backend)

    def generator(self) -> Backend:
        """The model's generation backend; a 400 for an embedding model."""
        if self._generates:
            return self.backend  # type: ignore[return-value]  # _generates says it is one
        raise APIError(
            400,
            f"{self.config.name!r} is an embedding model: use POST /v1/embeddings",
            param="model",
            code="wrong_model_kind",
        )

    def embedder(self) -> Embedder:
        """The model's embedder; a 400 for a text generation model."""
        if not self._generates:
            return self.backend  # type: ignore[return-value]  # a model's seam is one of two
        raise APIError(
            400,
            f"{self.config.name!r} is a text generation model; /v1/embeddings needs a model "
            'of kind "embedding"',
            param="model",
            code="wrong_model_kind",
        )
