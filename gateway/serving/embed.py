"""Embeddings as the pipeline serves them (a `Call`, pipeline.py): the checked request
(`Embeddings`), the embedding model it names (404 unknown, 403 forbidden for the team, 400 a
generation model, `dimensions` within the model's size), each input's token ids on that model
(400 for one over the context), and one attempt on its `Embedder` (backends/base.py) in a tier
admission slot, inside OTel's embeddings span `embeddings {model}`.

Usage counts the tokens the gateway measured, which are exactly the ids the node embedded,
billed at the model's `input_usd_per_mtok`; an embedding model has no fallback chain.
"""

from __future__ import annotations

import array
import asyncio
import base64
import sys
from collections.abc import Callable
from dataclasses import dataclass

from gateway.accounts.ledger import Ledger, UsageStatus
from gateway.accounts.usage import Accounting
from gateway.backends.base import EmbeddingAttempt, EmbeddingReply, ServedModel
from gateway.config import ModelConfig, TeamPolicy, Tier
from gateway.config_adapters import may_use
from gateway.serving.context import Serving
from gateway.serving.fair_queue import Claim, share_weight
from gateway.serving.generate import forbidden
from gateway.serving.measure import Measured
from gateway.serving.pipeline import Admitted, Answer
from gateway.serving.relay import EventSink
from gateway.serving.requests import Endpoint
from gateway.serving.spans import client_span
from protocol.embeddings import (
    EmbeddingData,
    EmbeddingResponse,
    EmbeddingUsage,
    EncodingFormat,
    NodeEmbeddingResponse,
)
from protocol.limits import max_context
from protocol.openai import APIError
from runtime.tracing import (
    GEN_AI_DIMENSIONS,
    GEN_AI_ENCODING_FORMATS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_PROVIDER,
    GEN_AI_RESPONSE_MODEL,
    Attrs,
)

#: characters of text inputs above which tokenizing moves off the event loop
_BIG_INPUT = 16_384
#: OTel GenAI's operation name (and so the span's: `embeddings {model}`)
EMBEDDINGS = "embeddings"


@dataclass(frozen=True)
class Embeddings:
    """An embeddings request, checked (gateway/api/embeddings.py parses it)."""

    model: str
    #: strings, or token-id lists (never mixed; 1..2,048 of them, none empty)
    items: list[str] | list[list[int]]
    encoding_format: EncodingFormat
    dimensions: int | None
    user: str | None


class Embed:
    """An `Embeddings` request as the pipeline's `Call`."""

    endpoint = Endpoint.EMBEDDING
    n = 1
    service_tier: str | None = None  # OpenAI's embeddings API has none

    def __init__(self, request: Embeddings) -> None:
        self.request = request
        self.model = request.model
        self.user = request.user

    def attributes(self) -> Attrs:
        return {GEN_AI_OPERATION: EMBEDDINGS, GEN_AI_PROVIDER: "duet"}

    async def admit(self, serving: Serving, team_id: str, streamable: bool) -> None:
        return None  # an embeddings request has no stream and no constraint

    def choose(
        self, serving: Serving, team_id: str, policy: TeamPolicy, tier: Tier
    ) -> tuple[ServedModel, dict[str, str]]:
        name = self.model
        served = serving.models.get(name)
        if served is None or not may_use(served.config, team_id):  # a kept model: as if absent
            kind = sorted(
                n
                for n, m in serving.models.items()
                if m.config.kind == "embedding" and may_use(m.config, team_id)
            )
            raise APIError(
                404,
                f"the model {name!r} does not exist "
                f"(embedding models: {', '.join(kind) or 'none'})",
                param="model",
                code="model_not_found",
            )
        forbidden(team_id, name, policy)
        size, dims = served.embedder().embedding_size, self.request.dimensions
        if size is not None and dims is not None and dims > size:
            raise APIError(
                400,
                f"dimensions must be at most {size} for {name!r}, got {dims}",
                param="dimensions",
            )
        return served, {}

    async def measure(self, serving: Serving, served: ServedModel, team_id: str) -> Measured:
        """Each input's token ids on the model; 400 for one longer than its context."""
        items = self.request.items
        # a list of strings or of id lists: the length of either counts
        big = isinstance(items[0], str) and sum(map(len, items)) > _BIG_INPUT
        ids = (
            await asyncio.to_thread(_token_ids, served, items) if big else _token_ids(served, items)
        )
        limit = served.max_model_len
        for i, x in enumerate(ids):
            if len(x) > limit:
                raise APIError(
                    400,
                    f"input[{i}] is {len(x)} tokens; {max_context(limit)}",
                    param="input",
                    code="context_length_exceeded",
                )
            if not x:
                raise APIError(400, f"input[{i}] has no tokens", param="input")
        return Measured([], sum(map(len, ids)), 0, inputs=ids)

    def chain(self, serving: Serving, served: ServedModel) -> tuple[ModelConfig, ...]:
        return (served.config,)  # an embedding model has no fallback chain (config_checks.py)

    def attempts(self, serving: Serving, ledger: Ledger, a: Admitted) -> EmbedAttempts:
        return EmbedAttempts(serving, self, ledger, a)


class EmbedAttempts:
    """The one attempt of an embeddings request: in a tier slot, on the model's embedder."""

    def __init__(self, serving: Serving, call: Embed, ledger: Ledger, a: Admitted) -> None:
        self.serving, self.call, self.ledger, self.a = serving, call, ledger, a
        self.reply: EmbeddingReply | None = None

    @property
    def accounting(self) -> Accounting | None:
        return self.reply.accounting if self.reply is not None else None

    def settled(self) -> Attrs:
        return {}

    async def run(self, served: ServedModel, size: Measured, sink: EventSink | None) -> Answer:
        req, name = self.call.request, served.config.name
        self.ledger.attempt(served.config, size.n_prompt)
        embedder = served.embedder()
        attempt = EmbeddingAttempt(
            request_id=self.a.caller.leg_id(),
            model=served.config,
            inputs=size.inputs,
            dimensions=req.dimensions,
            tier=self.a.tier,
        )
        self.reply = reply = embedder.open(attempt)
        # OTel's embeddings span: the dimensions asked for (else the model's, when known) and
        # the format
        dims = req.dimensions or embedder.embedding_size
        asked: Attrs = {
            GEN_AI_ENCODING_FORMATS: [req.encoding_format.value],
            **({GEN_AI_DIMENSIONS: dims} if dims else {}),
        }
        with client_span(self.serving.tracing, EMBEDDINGS, name, "duet", asked, self._usage(name)):
            team = self.a.caller.team
            weight = share_weight(team.weight, self.a.policy.weight)
            claim = Claim(team=team.id, weight=weight, tokens=size.n_prompt)
            async with self.serving.admission.slot(self.a.tier, claim) as turn:
                vectors = await reply.vectors()
            self.ledger.record.queue_s = round(turn.queued_s, 6)
        await self.ledger.commit(UsageStatus.OK, reply.accounting)
        body = render(vectors, req.encoding_format, name, size.n_prompt)
        cost = f"{self.ledger.record.cost_usd:.8f}"
        headers = {
            "x-duet-model-used": name,
            "x-duet-cost-usd": cost,
            "x-duet-queue-ms": turn.queue_ms,
        }
        return Answer(200, body, {**self.a.headers, **headers})

    def _usage(self, name: str) -> Callable[[], Attrs | None]:
        acc = self.accounting

        def usage() -> Attrs | None:  # what a node embedded (none reached: nothing)
            if acc is None or not acc.served:
                return None
            return {
                GEN_AI_RESPONSE_MODEL: name,
                GEN_AI_INPUT_TOKENS: acc.prompt_tokens,
                "duet.nodes": list(acc.nodes),
            }

        return usage


def _token_ids(served: ServedModel, items: list[str] | list[list[int]]) -> list[list[int]]:
    tok = served.tokenizer
    assert tok is not None  # an embedding model is self-hosted: the config requires a tokenizer
    if isinstance(items[0], str):
        return [tok.encode(t) for t in items]
    for i, ids in enumerate(items):
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(
                400,
                f"input[{i}]: token ids out of the vocabulary (size {tok.vocab_size}): {bad[:5]}",
                param="input",
            )
    return items


def _floats(le: bytes) -> list[float]:
    a = array.array("f", le)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def render(
    out: NodeEmbeddingResponse, fmt: EncodingFormat, model: str, n_tokens: int
) -> EmbeddingResponse:
    """OpenAI's response: `float` lists, or `base64` of the little-endian float32 bytes."""
    enc: Callable[[bytes], list[float] | str] = (
        _floats if fmt == EncodingFormat.FLOAT else (lambda b: base64.b64encode(b).decode("ascii"))
    )
    return EmbeddingResponse(
        data=[EmbeddingData(index=i, embedding=enc(v)) for i, v in enumerate(out.vectors)],
        model=model,
        usage=EmbeddingUsage(prompt_tokens=n_tokens, total_tokens=n_tokens),
    )
