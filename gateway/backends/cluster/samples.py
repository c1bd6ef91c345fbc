"""One sample's journey across nodes (`SampleStream`; sample 0's unless `index`): what it
streamed so far (the ids, and the characters its client has), the nodes excluded, its
migrations, and the decode leg it reads now.

Its pieces come from each chunk the node sends (`pieces`): each carries the tokens whose
output it delivers (`Piece.tokens`), so a node delta with no text (an unfinished UTF-8
character) passes its tokens on to the sample's next piece, across a migration too (the new
leg emits the text the dead one held back), and an answer that breaks off bills only what
reached its client. A chunk's usage replaces the sample's counts: a migrated leg reports its
own new tokens, and the original prompt's tokens and cached tokens (node/responder.py: the
streamed ids it re-prefilled are neither), so the prompt is billed once, with the answering
leg's cache hits — the leg that died never reported its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.accounts.usage import Accounting
from gateway.backends.base import Attempt, Piece
from gateway.backends.cluster.legs import TO_DECODE, LegFields
from gateway.backends.node_client import NodeFailure
from gateway.serving.requests import Request
from protocol.kv_params import KVTransferParams
from protocol.node_api import NodeCompletionChunk
from protocol.openai import CompletionChoice
from protocol.resume import Resume
from protocol.route import KVSource
from runtime.tracing import GEN_AI_OUTPUT_TOKENS, Tracing


@dataclass
class SampleStream:
    t0: float
    #: which sample of the request (n > 1) this is, and its seed (sample i > 0 draws from the
    #: request's seed + i; None: unseeded)
    index: int = 0
    seed: int | None = None
    ids: list[int] = field(default_factory=list)
    chars: int = 0
    finished: bool = False
    #: tokens streamed before the current leg
    base: int = 0
    migrations: int = 0
    node_id: str = ""
    #: (url, request id) of the current decode leg
    leg: tuple[str, str] = ("", "")
    exclude: list[str] = field(default_factory=list)
    resume: Resume | None = None
    #: why the current leg ended early (None: it ended complete)
    failure: NodeFailure | None = None
    #: the current decode leg's span (None when tracing is off)
    span: Any = None
    #: tokens streamed whose deltas showed nothing yet (no text): the next piece delivers them
    unsent: int = 0
    #: their ids
    unsent_ids: list[int] = field(default_factory=list)

    def decode_fields(
        self,
        request: Request,
        attempt: Attempt,
        kv: KVTransferParams | None,
        kv_source: KVSource | None = None,
    ) -> LegFields:
        """The decode leg's own fields: streamed, P's KV handle, where a migrated output
        resumes, and the node it pulls the prompt's prefix from (`kv_source`)."""
        return LegFields(
            stream=True,
            max_tokens=attempt.max_tokens,
            seed=self.seed,
            logprobs=request.sampling.logprobs,
            kv_transfer_params=kv,
            resume=self.resume,
            kv_source=kv_source,
        )

    def prefill_fields(self, request: Request, attempt: Attempt) -> LegFields:
        """The prefill leg's own fields. P makes one token. A guided request's is the output's
        first (D emits it: prefill/leg.py), so P samples it as D would have: with the sample's
        own seed and, on a migrated leg, `resume` (its grammar state, penalties and seeded draws
        after the streamed tokens), which needs the request's max_tokens (a node counts the
        streamed tokens in it; the prefill leg still makes one). An unguided P's token is not
        used (it draws with the request's seed). Its logprobs come from D."""
        if attempt.guide is None:
            return LegFields(False, 1, request.sampling.seed, None, TO_DECODE)
        if self.resume is None:
            return LegFields(False, 1, self.seed, None, TO_DECODE)
        return LegFields(False, attempt.max_tokens, self.seed, None, TO_DECODE, self.resume)

    def add(self, c: CompletionChoice) -> None:
        self.ids.extend(c.token_ids or ())
        self.chars += len(c.text)
        self.finished = self.finished or c.finish_reason is not None

    def pieces(self, chunk: NodeCompletionChunk, acc: Accounting) -> list[Piece]:
        """The chunk's pieces; its tokens counted in `acc` and remembered here."""
        i, out = self.index, []
        for c in chunk.choices:
            n = len(c.token_ids or ())
            if n and acc.first_token_at is None:
                acc.first_token_at = time.monotonic()
            acc.completion_tokens[i] = acc.completion_tokens.get(i, 0) + n
            self.add(c)
            unsent, self.unsent = self.unsent + n, 0
            ids, self.unsent_ids = [*self.unsent_ids, *(c.token_ids or ())], []
            if c.text or c.finish_reason or c.logprobs:
                piece = Piece(i, c.text, c.finish_reason, c.logprobs, tokens=unsent, token_ids=ids)
                out.append(piece)
            else:  # nothing to show yet: its tokens go with the next piece
                self.unsent, self.unsent_ids = unsent, ids
        if chunk.usage is not None:
            acc.completion_tokens[i] = self.base + chunk.usage.completion_tokens
            if i == 0:
                acc.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details or {}
                acc.cached_tokens = details.get("cached_tokens", 0)
        return out

    def leg_ended(self, acc: Accounting, tracing: Tracing, error: str | None = None) -> None:
        """The current decode leg ended (complete, or its node failed: `error`): its tokens
        (the record's `leg_tokens` are sample 0's) and its span with them."""
        made = len(self.ids) - self.base
        if self.index == 0:
            acc.leg_tokens.append(made)
        tracing.end(self.span, {GEN_AI_OUTPUT_TOKENS: made}, error=error)
        self.span = None
