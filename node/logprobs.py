"""Engine logprob records (`protocol.logprobs.TokenLogprob`) → OpenAI's answer shapes.

- completions: `{tokens, token_logprobs, top_logprobs, text_offset}` (OpenAI's legacy object);
  a streamed answer sends each delta's part, with `text_offset` continuing across chunks;
- chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`, made
  from the completions object by `protocol.chat.chat_logprobs` (the gateway does the same with
  a node's completions answer, so both give one answer);
- prompt logprobs (vLLM's extension on completions): per prompt token None (the first) or
  `{token id: {logprob, decoded_token}}` with the prompt token first, then its top tokens.

A token's string is that one token decoded alone (special tokens kept), as vLLM renders it;
`text_offset` is the running length of those strings, so for byte-level tokenizers that split
a character it need not index the detokenized text exactly. `top_logprobs` is keyed by token
string, as OpenAI's is: two ids that decode alike keep the likelier.
"""

from __future__ import annotations

import math

from protocol.logprobs import TokenLogprob
from protocol.openai import CompletionLogprobs, PromptLogprob
from text.tokenizer import Tokenizer


def _tok(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(tokenizer: Tokenizer, rec: TokenLogprob) -> dict[str, float]:
    out: dict[str, float] = {}
    for t, lp in rec.top:  # most likely first: setdefault keeps the likelier of two alike
        out.setdefault(_tok(tokenizer, t), lp)
    return out


def _finite(x: float) -> float:
    # JSON has no infinity: the floor OpenAI's and vLLM's shapes use (NaN too)
    return x if math.isfinite(x) else -9999.0


def _wire(r: TokenLogprob) -> TokenLogprob:
    """`r` with finite logprobs (JSON has no infinity)."""
    if math.isfinite(r.logprob) and all(math.isfinite(lp) for _, lp in r.top):
        return r
    top = [(t, _finite(lp)) for t, lp in r.top]
    return TokenLogprob(token_id=r.token_id, logprob=_finite(r.logprob), top=top, rank=r.rank)


class CompletionRenderer:
    """Renders the completions object, delta by delta (keeps the running text offset); with
    `records`, the engine's records go along (`CompletionLogprobs.records`)."""

    def __init__(self, tokenizer: Tokenizer, records: bool = False) -> None:
        self._tokenizer = tokenizer
        self._offset = 0
        self._records = records

    def render(self, records: list[TokenLogprob]) -> CompletionLogprobs:
        tokens = [_tok(self._tokenizer, r.token_id) for r in records]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[r.logprob for r in records],
            top_logprobs=[_top(self._tokenizer, r) for r in records],
            text_offset=offsets,
            records=[_wire(r) for r in records] if self._records else None,
        )


PromptLogprobs = list[dict[str, PromptLogprob] | None]


def prompt_logprobs(tokenizer: Tokenizer, records: list[TokenLogprob | None]) -> PromptLogprobs:
    out: PromptLogprobs = []
    for r in records:
        if r is None:
            out.append(None)
            continue
        entry = {
            str(r.token_id): PromptLogprob(
                logprob=r.logprob, decoded_token=_tok(tokenizer, r.token_id)
            )
        }
        for t, lp in r.top:
            entry.setdefault(str(t), PromptLogprob(logprob=lp, decoded_token=_tok(tokenizer, t)))
        out.append(entry)
    return out
