"""n-gram (prompt-lookup) drafting for speculative decoding, and each request's adaptive k.

`propose(tokens, k)`: the last n tokens (n from `max_n` down to `min_n`) are looked up in the
request's earlier tokens (prompt and output alike), most recent occurrence first; the k tokens
that followed it are the draft. It costs no model: summaries, edits and RAG answers copy spans of
their input, and there the draft is often right.

`SpecState` keeps one request's k: it grows by one after a draft accepted in full and shrinks to
what was accepted (at least 1) after a rejection, within [1, max_k], so a request that stops
copying stops paying for long drafts.

Invariant: a draft never exceeds k tokens and never contains a token that is not in `tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass


def propose(tokens: list[int], k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (max_n >= n >= min_n); [] when none recurs."""
    size = len(tokens)
    if k <= 0 or size < min_n + 1:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = tokens[size - n :]
        first = pattern[0]
        # most recent match first: its continuation is the likeliest to be copied next
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == pattern:
                return tokens[i + n : i + n + k]
    return []


@dataclass
class SpecState:
    max_k: int
    k: int = 0

    def __post_init__(self) -> None:
        self.k = self.k or self.max_k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted == proposed:
            self.k = min(self.max_k, self.k + 1)
        else:
            self.k = max(1, accepted)
