"""Speculative decoding in the engine: drafting for the scheduler, verification for the step,
and the counters (vLLM's spec-decode metric names).

`Speculator.draft(req, budget)` is the scheduler's drafter: n-gram drafts (engine/spec_ngram.py)
of the request's current k, never past max_tokens or the context, none for requests that asked
for logprobs, have not reached min_tokens, carry a guide (structured output) or a penalty/logit
bias (their rows would need per-token processing the verifier does not do: speculation is off
for them, they decode one token a step, masked and penalised). `Speculator.verify(chunk, rows)` turns the target's k + 1 rows into the
tokens to emit (engine/spec_verify.py) and updates the request's k and the counters.

Counters, as vLLM names them: spec_decode_num_drafts, spec_decode_num_draft_tokens,
spec_decode_num_accepted_tokens, spec_decode_num_accepted_tokens_per_pos; derived: the
acceptance rate (accepted / draft tokens) and the mean acceptance length (1 + accepted / drafts:
tokens per verifying step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import ScheduledChunk
from engine.spec_ngram import SpecState, propose
from engine.spec_verify import verify_greedy, verify_sampled

#: what --speculative accepts
METHODS = ("ngram",)


@dataclass
class SpecCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def stats(self) -> dict[str, float]:
        drafts, tokens = self.num_drafts, self.num_draft_tokens
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.num_accepted_tokens / tokens if tokens else 0.0,
            "spec_decode_mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else 0.0,
        }


class Speculator:
    def __init__(self, method: str, max_k: int, max_model_len: int, sampler: Sampler) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown speculative method {method!r}; use one of {', '.join(METHODS)}")
        if max_k < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        self.max_k = max_k
        self.max_model_len = max_model_len
        self.sampler = sampler
        self.counters = SpecCounters()
        self._state: dict[str, SpecState] = {}

    def draft(self, req: Request, budget: int) -> list[int]:
        p = req.params
        # A guide or a penalty changes each row's logits by the tokens before it, which the
        # verifier's one batched pass does not replay: such requests decode without drafts.
        if p.logprobs is not None or len(req.output_token_ids) < p.min_tokens or p.guide is not None or p.penalized:
            return []
        st = self._state.get(req.request_id)
        if st is None:
            st = self._state[req.request_id] = SpecState(self.max_k)
        k = min(st.k, budget, p.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens - 1)
        return propose(req.all_token_ids, k) if k > 0 else []

    def verify(self, chunk: ScheduledChunk, rows: torch.Tensor) -> list[int]:
        """The tokens `chunk`'s request emits: the accepted draft tokens and one more."""
        req, draft = chunk.req, chunk.draft
        if req.params.greedy:
            emitted = verify_greedy(draft, self.sampler.argmax(rows))
        else:
            emitted = verify_sampled(draft, rows, req.params, self.sampler.generator(req.request_id, req.params))
        accepted = len(emitted) - 1
        self.counters.record(len(draft), accepted)
        st = self._state.get(req.request_id)
        if st is not None:
            st.update(len(draft), accepted)
        return emitted

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
