"""SamplingParams and Priority: how one request's tokens are chosen, when it stops, and which
queue class it joins (vLLM's names).

Torch-free on purpose: the node's HTTP layer and every engine behind the node seam (native,
vLLM) share these types. Construction validates every field, so a request that gets this far
cannot make an engine misbehave: non-finite numbers and out-of-range values are refused with
a ValueError naming the field.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from protocol import limits
from protocol.logprobs import MAX_TOP_LOGPROBS
from protocol.resume import Resume
from protocol.retention import KVRetain
from protocol.structured import Guide

#: Temperatures below this sample as greedy (as vLLM does): dividing logits by a tiny positive
#: temperature overflows them to inf, and softmax of inf is NaN.
GREEDY_EPSILON = 1e-5
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
#: longest cache domain name a request may carry (a team id or a cache group)
MAX_CACHE_SALT = 256


class Priority(enum.IntEnum):
    """Lower runs first: interactive requests before batch ones."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass
class SamplingParams:
    """Per-request sampling and stopping.

    temperature 0 (or below GREEDY_EPSILON, or top_k 1) is greedy. `seed` makes a sampled
    request reproducible whatever else is in the batch (each request draws from its own
    generator). `stop` strings end the text just before the match (the matched string is not
    returned); `stop_token_ids` and the model's EOS (unless `ignore_eos`) end it after the
    token, which is kept in `token_ids`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    #: None: no logprobs; N >= 0: each generated token's logprob plus the N most likely tokens
    #: at its position (raw model distribution, before temperature/top-k/top-p)
    logprobs: int | None = None
    #: None: none; N >= 0: the logprob of every prompt token after the first, plus N top tokens
    prompt_logprobs: int | None = None
    #: the request's prefix-cache domain (vLLM's `cache_salt`; protocol.block_hash.domain_root).
    #: Not a sampling knob: it rides here because these params are what reaches the engine
    #: with every request, on both legs. None: the unsalted domain
    cache_salt: str | None = None
    #: a migrated request: the prompt's last `resume.output_tokens` ids are its output so far
    #: (text replayed, seeded draws skipped; max/min_tokens here count only what is left)
    resume: Resume | None = None
    #: OpenAI's penalties over the output so far (a migrated leg's `resume` tokens included):
    #: logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty; in [-2, 2]
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    #: vLLM's: every token of prompt + output has its logit divided by this when positive,
    #: multiplied when negative; in protocol/limits.py's REPETITION_PENALTY_RANGE (a tiny one
    #: made logits infinite and the sample NaN), 1 = off
    repetition_penalty: float = 1.0
    #: vLLM's: after temperature, drop tokens less likely than min_p x the top token's probability
    min_p: float = 0.0
    #: OpenAI's: added to the token's logit before sampling; token id -> [-100, 100], <= 300 ids
    logit_bias: dict[int, float] = field(default_factory=dict)
    #: constrained decoding (protocol/structured.py): the engine masks every token with it
    guide: Guide | None = None
    #: the LoRA adapter the request runs with (vLLM's lora_request, named; None: the base model).
    #: Like cache_salt it rides here because these params reach the engine on both legs; it is
    #: also part of the prefix-cache root (protocol.block_hash.domain_root)
    lora_name: str | None = None
    #: P/D, a guided decode leg: the first output token, sampled under the guide by the prefill
    #: node (`KVTransferParams.first_token_id`). The engine checks the guide allows it, then
    #: emits it in place of its own first token (still making that draw, so a seeded generator
    #: stays where P's was). None: the engine samples its first token itself
    first_token: int | None = None
    #: keep the KV blocks of the prompt's first `retain.tokens` tokens for `retain.ttl_s`
    #: (protocol/retention.py); like cache_salt, not a sampling knob
    retain: KVRetain | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is None or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        limits.check_top_p(self.top_p)
        if not -1 <= self.top_k < 2**31:
            raise ValueError(
                f"top_k must be -1, 0 or a positive count below 2**31, got {self.top_k}"
            )
        if self.max_tokens >= 2**31:
            raise ValueError(f"max_tokens must be below 2**31, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (
                isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS
            ):
                raise ValueError(
                    f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {n!r}"
                )
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT:
            raise ValueError(f"cache_salt must be 1 to {MAX_CACHE_SALT} characters")
        if self.lora_name is not None and not 0 < len(self.lora_name) <= MAX_CACHE_SALT:
            raise ValueError(f"lora_name must be 1 to {MAX_CACHE_SALT} characters")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.retain is not None:
            self.retain.check()
        self._check_penalties()
        if self.first_token is not None:
            if (
                isinstance(self.first_token, bool)
                or not isinstance(self.first_token, int)
                or self.first_token < 0
            ):
                raise ValueError(f"first_token must be a token id >= 0, got {self.first_token!r}")
            if self.guide is None:  # an unguided decode leg samples its first token itself
                raise ValueError(
                    "first_token (the prefill node's sampled token) is taken only with a guide"
                )

    def _check_penalties(self) -> None:
        # the ranges and words every process refuses with (protocol/limits.py)
        limits.check_penalties(
            self.frequency_penalty, self.presence_penalty, self.repetition_penalty, self.min_p
        )
        limits.check_bias_values(self.logit_bias)
        for t in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {t!r}")
        if self.guide is not None and self.min_tokens > 0:
            # a finished grammar allows only EOS, which min_tokens forbids: no token would be left
            raise ValueError("min_tokens cannot be combined with a guide (structured output)")

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits before sampling."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON or self.top_k == 1
