"""What the engine reports per request per step, and the text side of finishing.

`TextState` turns sampled tokens into text deltas (incremental detokenization) and applies
stop strings: the text ends just before the first stop string; while a request streams, the
last `len(longest stop) - 1` characters are held back so a stop string never leaks out half
written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.detokenizer import IncrementalDetokenizer
from protocol.logprobs import TokenLogprob
from protocol.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    """A delta for one request (the offline API accumulates them)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    #: why the engine failed this request (finish_reason "error"); other requests go on
    error: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    #: prefill node: the blocks held for transfer (on the finishing delta of a held request)
    held_block_ids: list[int] = field(default_factory=list)
    #: monotonic timestamps, on the finishing delta (None if the request never got there)
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    #: with params.logprobs: one record per token of `new_token_ids`
    logprobs: list[TokenLogprob] | None = None
    #: with params.prompt_logprobs, on the delta of the first generated token: one entry per
    #: prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


class TextState:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool) -> None:  # fmt: skip
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # full text so far (after stop truncation)
        self._emitted = 0

    def add(self, token_id: int, last: bool) -> tuple[str, str | None]:
        """Add a token; returns (text delta to emit, matched stop string or None). With `last`
        the sequence ends after this token, so nothing is held back."""
        delta = self._detok.add(token_id)
        if last:
            delta += self._detok.flush()
        matched = None
        if delta and self._stop:
            search_from = max(0, len(self.text) - self._hold)
            self.text += delta
            best = -1
            for s in self._stop:
                i = self.text.find(s, search_from)
                if i != -1 and (best == -1 or i < best):
                    best, matched = i, s
            if matched is not None:
                self.text = self.text[:best]
        else:
            self.text += delta
        end = len(self.text) if (last or matched is not None) else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out, matched

    def finish(self) -> str:
        """Emit whatever was held back (the request ended for another reason)."""
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out
