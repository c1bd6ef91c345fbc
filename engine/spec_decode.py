"""Speculative decoding in the engine: drafting for the scheduler, verification for the step,
and the counters (vLLM's spec-decode metric names).

Methods: "ngram" (prompt lookup, engine/spec_ngram.py) and the draft-model ones (engine/
spec_draft.py): "draft-int4" (default: self-speculation, the target's own weights at int4),
"draft-int4-w4a8", "draft-int8", and "draft" (the draft at the target's weight format: with a
separate `speculative_model`). A draft model proposes for every decoding request in one batched
pass per draft position: the scheduler calls `Speculator.prepare(requests)` first.

`Speculator.draft(req, budget)` is the scheduler's drafter: the request's draft of its current k,
never past max_tokens or the context, none for requests that carry a guide (structured output)
or a penalty/logit bias (their rows would need per-token processing the verifier does not do:
speculation is off for them, they decode one token a step, masked and penalised). Requests with
logprobs get them from the verified rows (the rows one-token steps give, bit for bit); before
min_tokens the verifier masks EOS in the rows, as the sampler does. `Speculator.verify(chunk,
rows)` turns the target's k + 1 rows into the tokens to emit (engine/spec_verify.py) and updates
the request's k and the counters.

Counters, as vLLM names them: spec_decode_num_drafts, spec_decode_num_draft_tokens,
spec_decode_num_accepted_tokens, spec_decode_num_accepted_tokens_per_pos; derived: the
acceptance rate (accepted / draft tokens) and the mean acceptance length (1 + accepted / drafts:
tokens per verifying step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.convert import ensure_converted
from engine.model_config import ModelConfig
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import ScheduledChunk
from engine.spec_draft import Draft, DraftModel, check_same_tokenizer
from engine.spec_ngram import SpecState, propose
from engine.spec_verify import verify_greedy, verify_sampled
from runtime.models import resolve_model

log = logging.getLogger("duet.engine.spec")

#: draft-model methods and the draft's quantization (None: the target's own weight format)
DRAFT_METHODS: dict[str, str | None] = {
    "draft-int4": "int4",
    "draft-int4-w4a8": "int4-w4a8",
    "draft-int8": "int8",
    "draft": None,
}
#: what --speculative accepts
METHODS = ("ngram", *DRAFT_METHODS)
#: Default `spec_max_batch` per method: the most requests running or waiting with which a step still
#: drafts. Measured with `python -m bench.spec_engine --batch N` (output tokens/s of N requests
#: submitted together, speculation on over off; SmolLM2-135M bf16, 2 threads, Zen 4, round 8):
#: ngram on the edit task 1.45x at 2, 1.46x at 3, 1.30x at 4; draft-int4 on the chat task 0.74x at
#: 2, 0.71x at 3, 0.61x at 4 (alone: 1.2-1.7x). A batch already shares each weight read among its
#: requests, which is what a draft model's cheaper steps buy, and verifying k + 1 rows a request
#: makes the step compute-bound sooner; prompt lookup costs nothing to draft.
SPEC_MAX_BATCH: dict[str, int] = {"ngram": 4, **dict.fromkeys(DRAFT_METHODS, 1)}
#: Default `num_speculative_tokens` (the most a request drafts a step; its own k adapts below it,
#: engine/spec_ngram.py SpecState) per method. The int4 self-draft is accepted 94-100 % of the time
#: on the chat and edit tasks, so a longer draft rarely wastes its tokens: `python -m
#: bench.spec_engine --method draft-int4 --k 5|8` (SmolLM2-135M bf16, 2 threads, Zen 4, round 8,
#: four pairs run one after the other) read 1.43/1.47x at k 5 and 1.73/1.49x at k 8 on chat,
#: 1.28/1.45x and 1.28/1.52x on edit: k 8 as fast or faster in every pair. n-gram drafts stop
#: where the copied span does; 5 stays.
NUM_SPECULATIVE_TOKENS: dict[str, int] = {"ngram": 5, **dict.fromkeys(DRAFT_METHODS, 8)}


def spec_max_batch(config: EngineConfig) -> int:
    """The configured `spec_max_batch`, or the method's default (SPEC_MAX_BATCH)."""
    if config.spec_max_batch is None:
        return SPEC_MAX_BATCH.get(config.speculative or "", 1)
    if config.spec_max_batch < 0:
        raise ValueError(
            f"spec_max_batch must be 0 (never draft) or more, not {config.spec_max_batch}"
        )
    return config.spec_max_batch


def num_speculative_tokens(config: EngineConfig) -> int:
    """The configured `num_speculative_tokens`, or the method's default (NUM_SPECULATIVE_TOKENS)."""
    if config.num_speculative_tokens is None:
        return NUM_SPECULATIVE_TOKENS.get(config.speculative or "", 5)
    return config.num_speculative_tokens


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
            "spec_decode_mean_acceptance_length": 1 + self.num_accepted_tokens / drafts
            if drafts
            else 0.0,
            **{
                f"spec_decode_num_accepted_tokens_per_pos.{i}": n
                for i, n in enumerate(self.accepted_per_pos)
            },
        }


class Speculator:
    def __init__(
        self,
        method: str,
        max_k: int,
        max_model_len: int,
        sampler: Sampler,
        model: DraftModel | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if method not in METHODS:
            raise ValueError(
                f"unknown speculative method {method!r}; use one of {', '.join(METHODS)}"
            )
        if max_k < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if (method in DRAFT_METHODS) != (model is not None):
            raise ValueError(
                f"speculative method {method!r} "
                f"{'needs' if model is None else 'takes no'} draft model"
            )
        self.max_k = max_k
        self.max_model_len = max_model_len
        self.sampler = sampler
        self.model = model
        self.vocab_size = vocab_size
        self.counters = SpecCounters()
        self._state: dict[str, SpecState] = {}
        self._drafts: dict[str, Draft] = {}  # this step's model drafts

    def _k(self, req: Request, budget: int) -> int:
        """The draft length for `req` now (0: no draft)."""
        p = req.params
        # A guide or a penalty changes each row's logits by the tokens before it, which the
        # verifier's one batched pass does not replay: such requests decode without drafts.
        # (min_tokens is replayed: `verify` masks EOS in the rows before it; logprobs are read
        # from the verified rows.)
        if p.guide is not None or p.penalized:
            return 0
        st = self._state.get(req.request_id)
        if st is None:
            st = self._state[req.request_id] = SpecState(self.max_k)
        return min(
            st.k,
            budget,
            p.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens - 1,
        )

    def prepare(self, decoding: list[Request]) -> None:
        """The scheduler's hook before a drafting step: a draft model drafts for all of
        `decoding` at once (the n-gram drafter needs nothing ahead)."""
        self._drafts = {}
        if self.model is None:
            return
        wants = [(r, k) for r in decoding if (k := self._k(r, self.max_k)) > 0]
        if wants:
            self._drafts = self.model.propose(wants)

    def draft(self, req: Request, budget: int) -> list[int]:
        k = self._k(req, budget)
        if k <= 0:
            return []
        if self.model is None:
            return propose(req.all_token_ids, k)
        d = self._drafts.get(req.request_id)
        if d is None:
            return []
        toks = d.tokens[:k]
        if self.vocab_size is not None:  # a draft head wider than the target's (padding rows)
            toks = toks[: next((i for i, t in enumerate(toks) if t >= self.vocab_size), len(toks))]
        q = d.q
        if q is not None and self.vocab_size is not None and q.shape[1] != self.vocab_size:
            v = self.vocab_size
            q = q[:, :v] if q.shape[1] > v else torch.nn.functional.pad(q, (0, v - q.shape[1]))
        self._drafts[req.request_id] = Draft(toks, None if q is None else q[: len(toks)])
        return toks

    def verify(self, chunk: ScheduledChunk, rows: torch.Tensor) -> list[int]:
        """The tokens `chunk`'s request emits: the accepted draft tokens and one more."""
        req, draft = chunk.req, chunk.draft
        d = self._drafts.pop(req.request_id, None)
        early = min(rows.shape[0], req.params.min_tokens - len(req.output_token_ids))
        if early > 0 and req.eos_token_ids:  # as the sampler does: no EOS before min_tokens
            rows = rows.clone()
            rows[:early, list(req.eos_token_ids)] = float("-inf")
        if req.params.greedy:
            emitted = verify_greedy(draft, self.sampler.argmax(rows))
        else:
            q = d.q if d is not None and d.tokens == draft else None
            emitted = verify_sampled(
                draft, rows, req.params, self.sampler.generator(req.request_id, req.params), q
            )
        accepted = len(emitted) - 1
        self.counters.record(len(draft), accepted)
        st = self._state.get(req.request_id)
        if st is not None:
            st.update(len(draft), accepted)
        return emitted

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        self._drafts.pop(request_id, None)
        if self.model is not None:
            self.model.forget(request_id)


def build_speculator(
    config: EngineConfig,
    model_dir: Path,
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
    max_model_len: int,
    sampler: Sampler,
) -> Speculator:
    """The engine's Speculator for `config.speculative`, with its draft model when the method
    needs one (the target's own weights, or `config.speculative_model` if given)."""
    method = config.speculative or ""
    if method not in METHODS:
        raise ValueError(f"unknown speculative method {method!r}; use one of {', '.join(METHODS)}")
    model = None
    if method in DRAFT_METHODS:
        draft_dir, cfg = model_dir, target
        if config.speculative_model:
            draft_dir = ensure_converted(resolve_model(config.speculative_model), progress=log.info)
            check_same_tokenizer(model_dir, draft_dir)
            cfg = ModelConfig.from_dir(draft_dir)
            if cfg.max_position_embeddings < max_model_len:
                raise ValueError(
                    f"the speculative model's context ({cfg.max_position_embeddings} positions) is "
                    f"shorter than max_model_len={max_model_len}"
                )
        quant = DRAFT_METHODS[method] if method != "draft" else config.quantization
        bs = config.block_size
        blocks = config.spec_draft_kv_blocks or min(
            num_blocks,
            max(1, spec_max_batch(config))
            * -(-(max_model_len + num_speculative_tokens(config)) // bs),
        )
        # the draft's catch-up prefill runs outside the step's token budget: a quarter of it
        model = DraftModel(
            draft_dir,
            cfg,
            dtype,
            device,
            quant,
            blocks,
            bs,
            max_model_len,
            max(1, config.max_num_batched_tokens // 4),
            config.seed,
        )
        log.info(
            "speculative draft: %s at %s, %d KV blocks of its own",
            draft_dir.name,
            quant or "full precision",
            blocks,
        )
    elif config.speculative_model:
        raise ValueError(
            "speculative_model is for the draft-model methods "
            f"({', '.join(DRAFT_METHODS)}), not {method!r}"
        )
    return Speculator(
        method, num_speculative_tokens(config), max_model_len, sampler, model, target.vocab_size
    )
