"""Logprob records: what an engine reports about one position's distribution (torch-free).

`TokenLogprob` is the log-probability of the token at a position under the model's *raw*
distribution (log-softmax of the logits before temperature, top-k, top-p and min_tokens'
EOS mask: vLLM's default `logprobs_mode`), plus the `top` most likely tokens there, most
likely first, and the token's rank in the vocabulary (vLLM's: how many tokens are at least as
likely, itself included, so the likeliest is 1). Engines, the node seam and the node's OpenAI
responders share this one type.
"""

from __future__ import annotations

import msgspec

#: OpenAI's bound on `top_logprobs` (and on completions' `logprobs`); vLLM's default is 20 too.
MAX_TOP_LOGPROBS = 20


class TokenLogprob(
    msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True, gc=False
):
    token_id: int
    logprob: float
    #: (token id, logprob) of the most likely tokens at this position, most likely first
    top: list[tuple[int, float]] = []
    #: how many tokens are at least as likely, itself included (None: the engine did not say)
    rank: int | None = None
