"""What the engine reports per request per step (`RequestOutput`, defined once in
protocol.outputs and shared with the node's engine interface), and the text side of finishing.

`TextState` turns sampled tokens into text deltas (incremental detokenization) and applies
stop strings: the text ends just before the first stop string; while a request streams, the
last `len(longest stop) - 1` characters are held back so a stop string never leaks out half
written.

A migrated request (protocol/resume.py) starts from `TextState.resumed`: its already-streamed
tokens are replayed through the same state, from the same original prompt, as on the node that
streamed them, and only the text past what the client already has is emitted.
"""

from __future__ import annotations

from protocol.outputs import Fault, RequestOutput
from protocol.resume import Resume
from text.detokenizer import IncrementalDetokenizer
from text.tokenizer import Tokenizer

__all__ = ["Fault", "RequestOutput", "TextState"]


class TextState:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # full text so far (after stop truncation)
        self._emitted = 0

    @classmethod
    def resumed(
        cls,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
        resume: Resume,
    ) -> TextState:
        """The state after the last `resume.output_tokens` of `prompt_ids` were generated and
        `resume.text_chars` characters of their text were emitted: the same calls the first node
        made, so the detokenizer's window and the stop strings' hold-back continue exactly."""
        split = len(prompt_ids) - resume.output_tokens
        state = cls(tokenizer, prompt_ids[:split], stop, skip_special_tokens)
        for t in prompt_ids[split:]:
            state.add(t, last=False)
        state._emitted = min(resume.text_chars, len(state.text))
        return state

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
        end = (
            len(self.text)
            if (last or matched is not None)
            else max(self._emitted, len(self.text) - self._hold)
        )
        out = self.text[self._emitted : end]
        self._emitted = end
        return out, matched

    def finish(self) -> str:
        """Emit whatever was held back (the request ended for another reason)."""
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out
