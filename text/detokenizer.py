"""Incremental detokenization: turn a growing list of token ids into text deltas.

Byte-level BPE tokens can split a UTF-8 character across tokens, and decoding a token alone can
differ from decoding it in context (leading-space rules). We therefore decode a short window
that starts a few tokens back (`prefix_offset`) and emit only what goes beyond the text already
emitted, holding back while the window ends in U+FFFD (an incomplete character). This is the
scheme vLLM and TGI use.

Invariant: the concatenation of all deltas equals `tokenizer.decode(all_ids)` once the sequence
ends (flush), and no delta ever contains a broken character made up by the decoder.
"""

from __future__ import annotations

from text.tokenizer import Tokenizer

_WINDOW = 6  # tokens of left context kept when decoding a delta


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Seed the window with the prompt's tail so the first token decodes in context.
        self._ids: list[int] = list(prompt_ids[-_WINDOW:]) if prompt_ids else []
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text) :]
            # The tokens just emitted become the next window's left context.
            self._prefix, self._read = self._read, len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence, emit what was held back (even a lone U+FFFD)."""
        full = self._decode(self._ids[self._prefix :])
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        delta = full[len(prefix_text) :] if len(full) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
