"""Driver: random-token requests into one EngineCore, and its steps timed by CPU clock — what
`duet bench profile` (bench/profile.py) and the co-run measurement (sim/corun.py) run steps with.

Prompts are drawn from a seeded RNG over the model's vocabulary (ids ≥ 3, past the special
tokens), greedy, `ignore_eos`, so a run's step shapes depend only on the seed and the calls.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core import EngineCore

#: the decode shape of the co-run measurement: sequences and their context
DECODE_SEQS, DECODE_CTX = 8, 256


class Driver:
    """Adds random-token requests to a core and times its steps by CPU clock."""

    def __init__(self, core: EngineCore, seed: int) -> None:
        self.core = core
        self.rng = random.Random(seed)
        self.n = 0

    def tokens(self, n: int) -> list[int]:
        vocab = self.core.model_config.vocab_size
        return [self.rng.randrange(3, vocab) for _ in range(n)]

    def add(self, prompt_len: int, max_tokens: int, prefix: list[int] | None = None) -> None:
        """A request of `prompt_len` fresh random tokens, after `prefix` if given (a prefix an
        earlier request computed is then a prefix-cache hit, where the core caches prefixes)."""
        from engine.sampling_params import SamplingParams

        self.n += 1
        self.core.add_request(
            f"c{self.n}",
            (prefix or []) + self.tokens(prompt_len),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
        )

    def cpu_step(self) -> float:
        c0 = time.process_time()
        self.core.step()
        return time.process_time() - c0

    def prefilling(self) -> bool:
        s = self.core.scheduler
        return bool(s.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in s.running
        )

    def drain(self) -> None:
        for rid in list(self.core.scheduler.requests):
            self.core.abort(rid)
        while self.core.has_work():
            self.core.step()

    def prefill_step(self, chunk: int) -> float:
        """CPU seconds of one step that prefills a `chunk`-token prompt alone (then drained)."""
        self.add(chunk, 1)
        t = self.cpu_step()
        self.drain()
        return t

    def start_decoders(self) -> None:
        """DECODE_SEQS sequences of DECODE_CTX prompt tokens, prefilled: pure decode steps next."""
        for _ in range(DECODE_SEQS):
            self.add(DECODE_CTX, 10_000)
        while self.prefilling():
            self.core.step()
