"""Prompts built from token ids, so a synthetic prompt has a known length in the model's tokens.

Two forms (`--prompt-format`): `tokens` sends the ids themselves (a list of ints in `prompt`,
which duet nodes and vLLM accept on /v1/completions: the length is exact); `text` decodes the
ids with the model's tokenizer (text.tokenizer) and sends the string, for any server and
for chat (the length is then re-measured by encoding the text, as tokenizers do not round-trip
random ids exactly; a chat template adds its own tokens on top).

Invariant: random ids avoid the tokenizer's special tokens (never an EOS or a turn marker in
a prompt); without a tokenizer the lowest ids (usually special) are avoided.
"""

from __future__ import annotations

import random

from text.tokenizer import Tokenizer


class PromptBuilder:
    def __init__(
        self, fmt: str, tokenizer: Tokenizer | None = None, vocab_size: int | None = None
    ) -> None:
        if fmt == "text" and tokenizer is None:
            raise ValueError("text prompts need a tokenizer")
        self.fmt = fmt
        self.tokenizer = tokenizer
        vocab = vocab_size or (tokenizer.vocab_size if tokenizer else 0)
        if vocab < 2:
            raise ValueError(f"vocabulary size must be at least 2, got {vocab}")
        special = tokenizer.special_ids | tokenizer.eos_token_ids if tokenizer else frozenset()
        lo = 0 if tokenizer else min(100, vocab // 4)
        self._ids = [i for i in range(lo, vocab) if i not in special]

    def random_ids(self, rng: random.Random, n: int) -> list[int]:
        return [self._ids[rng.randrange(len(self._ids))] for _ in range(n)]

    def render(self, ids: list[int]) -> tuple[str | list[int], int]:
        """(prompt as sent, its length in tokens)."""
        prompt, tokens = self.render_tokens(ids)
        return prompt, len(tokens)

    def render_tokens(self, ids: list[int]) -> tuple[str | list[int], list[int]]:
        """(prompt as sent, its tokens as the server tokenizes it)."""
        if self.fmt == "tokens":
            return list(ids), list(ids)
        assert self.tokenizer is not None
        text = self.tokenizer.decode(ids)
        tokens = self.encode_text(text)
        if len(tokens) > len(ids):  # decoding merged into more tokens: trim back to the target once
            text = self.tokenizer.decode(ids[: max(1, len(ids) - (len(tokens) - len(ids)))])
            tokens = self.encode_text(text)
        return text, tokens

    def as_sent(self, ids: list[int]) -> list[int]:
        """`ids` as the server tokenizes them once sent (untrimmed): text does not round-trip
        random ids, so a 384-id prefix can be ~400 tokens once its text is encoded again."""
        if self.fmt == "tokens":
            return list(ids)
        assert self.tokenizer is not None
        return self.encode_text(self.tokenizer.decode(ids))

    def encode_text(self, text: str) -> list[int]:
        assert self.tokenizer is not None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.encode_text(text))


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` share at their start: the prefix a prefix cache can hit."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
