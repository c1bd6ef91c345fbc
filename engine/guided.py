"""Constrained decoding in the engine: guides compiled off the engine thread, a matcher per
request, the token mask on the logits every step (DESIGN §8).

The grammar engine is llguidance (chosen by measurement: docs/structured-outputs.md). A guide
(protocol/structured.py) becomes a grammar through text/guide_check.py::guide_grammar — the
same mapping the gateway's tokenizer-free check uses, bounded numbers' fractions cut included
(text/json_bounds.py) — and is compiled here against the model's tokenizer into a prototype
`LLMatcher`, cached by (cache domain, kind, sha256 of the spec) in a bounded LRU (the cut is a
function of the spec, so the key stays right, and a decode node resumes the very grammar its
prefill node used). The domain is the request's `cache_salt`, as for the prefix cache: a hit
answers in microseconds where a compile takes milliseconds to seconds, so a shared entry would
tell one team whether another recently used an exact schema.
`compile_async` runs that compilation in a small thread pool, so the engine thread only copies a
prototype (`deep_copy`, microseconds) when the request is added.

Each step, the rows of guided requests get their next-token bitmask (filled on the engine
thread: see `mask`) applied to the logits as -inf, before sampling, greedy or not; unconstrained
rows in the same batch are left alone. Each accepted token advances the
request's matcher; when the grammar is complete (`is_stopped`) the request finishes with "stop".
EOS is allowed by the mask only where the grammar may end, so a cut by max_tokens is "length".

P/D: a prefill node masks the one token it samples, and that token is the output's first (it
reaches the decode node as `SamplingParams.first_token`). The decode node's matcher starts from
the tokens sampled before it — on a migrated leg, the `resume` tokens at the end of the prompt
(protocol/resume.py) — and `attach` refuses a first token the grammar does not allow there; the
matcher then takes it when the engine emits it, and masks the rest.

Invariants: a guided request always has a matcher until it finishes (`forget`); a matcher in
error fails its own request only (`GuideError`); with llguidance missing, strict mode (CI)
refuses to start an engine, elsewhere every guided request is refused with a 400 — never served
unconstrained.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protocol.structured import Guide
from runtime.strict import fallback
from text.guide_check import GrammarEngineMissing, guide_grammar

log = logging.getLogger("duet.engine.guided")

#: compiled guides kept per engine (one prototype matcher each: a few hundred KiB at most)
CACHE_SIZE = 256
#: threads compiling guides off the engine thread
COMPILE_THREADS = 2


class GuideError(ValueError):
    """The guide cannot be compiled for this model, or the output left it."""


def _import_llguidance() -> Any | None:
    try:  # not llguidance.torch: its import decorates with torch.compile, which loads dynamo (~3 s)
        import llguidance
    except ImportError as e:
        fallback(
            log,
            f"the grammar engine llguidance cannot be imported ({e})",
            "refusing every request with a guide (structured outputs)",
        )
        return None
    return llguidance


def _key(guide: Guide, domain: str | None) -> tuple[str, str, str]:
    return domain or "", guide.kind.value, hashlib.sha256(guide.spec.encode()).hexdigest()


class GuidedDecoding:
    """Compiles guides for one model's tokenizer and keeps the matcher of each guided request.

    `compile`/`compile_async` may run on any thread; everything else runs on the engine thread."""

    def __init__(
        self,
        tokenizer_file: Path,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self._lib = _import_llguidance()
        self._tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer: Any = None  # built on first use (~0.4 s): engines without guides never pay
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._matchers: dict[str, Any] = {}
        #: counters: compilations done, cache hits
        self.compiled = 0
        self.hits = 0

    # -- compilation (any thread) -----------------------------------------------------------
    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                assert self._lib is not None
                text = self._tokenizer_file.read_text()
                self._tokenizer = self._lib.LLTokenizer(
                    text, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def compile(self, guide: Guide, domain: str | None = None) -> Any:
        """The guide's prototype matcher (cached for cache domain `domain`, a request's
        `cache_salt`); raises GuideError with the engine's words."""
        if self._lib is None:
            raise GuideError(
                "structured outputs are not available on this node: the grammar engine "
                "llguidance cannot be imported"
            )
        key = _key(guide, domain)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        tok = self._llg_tokenizer()
        try:
            grammar = guide_grammar(guide)
        except (ValueError, GrammarEngineMissing) as e:
            raise GuideError(f"invalid {guide.kind.value} guide: {e}") from None
        proto = self._lib.LLMatcher(tok, grammar)
        if proto.is_error():
            raise GuideError(f"invalid {guide.kind.value} guide: {proto.get_error().strip()}")
        with self._lock:
            self._cache[key] = proto
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self.compiled += 1
        return proto

    def compile_async(
        self, guide: Guide, domain: str | None = None
    ) -> concurrent.futures.Future[Any]:
        """`compile` on the compile pool (the async engine awaits it before adding)."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    COMPILE_THREADS, thread_name_prefix="duet-grammar"
                )
            pool = self._pool
        return pool.submit(self.compile, guide, domain)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- per request (engine thread) ---------------------------------------------------------
    def attach(
        self,
        request_id: str,
        guide: Guide,
        sampled: list[int],
        first: int | None = None,
        domain: str | None = None,
    ) -> None:
        """Give `request_id` a matcher advanced over the tokens it has sampled so far (a decode
        node resuming a migrated leg); GuideError if those tokens leave the grammar, or if
        `first` (the prefill node's token, which this node emits next: engine/core.py) is not
        one the grammar allows after them. `first` is only checked here: the matcher takes it
        as it takes any emitted token (`advance`), so a grammar it completes ends the request."""
        m = self.compile(guide, domain).deep_copy()
        if not all(m.consume_token(t) for t in sampled):
            raise GuideError(
                f"the tokens sampled so far do not satisfy the {guide.kind.value} guide: "
                f"{m.get_error().strip()}"
            )
        if first is not None and (m.is_stopped() or m.validate_tokens([first]) != 1):
            raise GuideError(
                f"the prefill node's first token {first} is not allowed by the {guide.kind.value} "
                "guide at this point of the output"
            )
        self._matchers[request_id] = m

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def guided(self, request_id: str) -> bool:
        return request_id in self._matchers

    def mask(
        self, logits: torch.Tensor, rows: list[tuple[int, str]], copy: bool = True
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """`logits` [S, V] with each (row, request id) in `rows` masked to its grammar's allowed
        next tokens (-inf elsewhere) — on a float32 CPU copy unless `copy` is False (the caller
        owns `logits`, a float32 CPU tensor) — and {row: why} for rows no token may follow
        (their request must fail: an argmax over -inf is no answer).

        The mask is applied with numpy, single-threaded: torch's indexed masked_fill on a few
        rows goes through its intra-op thread pool, which cost 100+ ms a step on a loaded
        2-core machine (measured) for microseconds of work."""
        if not rows:
            return logits, {}
        words = (self.vocab_size + 31) // 32
        bitmask = np.empty(
            (len(rows), words), dtype=np.int32
        )  # C-contiguous: row i at i * 4 * words
        matchers = [self._matchers[rid] for _, rid in rows]
        # Filled here, row by row, not by llguidance's parallel LLExecutor: measured for 32 rows
        # of a JSON schema, 0.56 ms serial against 9-25 ms wall through the executor (its
        # threads' hand-off dominates microseconds of work per row on a 2-core machine).
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bitmask.ctypes.data + i * words * 4, words * 4)
        # bit i of word w allows token 32 w + i: little-endian bytes, each unpacked low bit first
        banned = (
            np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
            == 0
        )
        if copy or logits.dtype != torch.float32 or logits.device.type != "cpu":
            x = torch.from_numpy(logits.detach().float().cpu().numpy().copy())
        else:
            x = logits
        xn = x.numpy()
        first, last = rows[0][0], rows[-1][0]
        if last - first == len(rows) - 1 and all(r == first + j for j, (r, _) in enumerate(rows)):
            np.copyto(xn[first : last + 1], -np.inf, where=banned)  # the usual case: one pass
        else:
            for j, (r, _) in enumerate(rows):
                np.copyto(xn[r], -np.inf, where=banned[j])
        dead = {
            r: "no token satisfies the guide: "
            f"{m.get_error().strip() or 'the grammar allows nothing here'}"
            for (r, _), m, b in zip(rows, matchers, banned.all(axis=1).tolist(), strict=True)
            if b
        }
        return x, dead

    def advance(self, request_id: str, token: int) -> bool:
        """Feed the request's accepted token to its matcher; True when the grammar is complete.
        Raises GuideError if the token leaves the grammar (a masked row cannot, unless the
        mask failed)."""
        m = self._matchers.get(request_id)
        if m is None:
            return False
        if not m.consume_token(token):
            raise GuideError(f"token {token} does not satisfy the guide: {m.get_error().strip()}")
        return bool(m.is_stopped())

    def error(self, request_id: str) -> str | None:
        """Why a guided request's matcher cannot go on (None: it can)."""
        m = self._matchers.get(request_id)
        return m.get_error().strip() if m is not None and m.is_error() else None
