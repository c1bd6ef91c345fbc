"""Draft-model speculation: a small or quantized model proposes k tokens per decoding request,
for the target to verify in one batched forward (engine/spec_verify.py).

Self-speculation: the draft is the target's own weights at a cheaper quantization (int4 by
default: no second model ships). A separate draft model (`speculative_model`) must share the
target's tokenizer, token for token (`check_same_tokenizer`).

The draft keeps its own paged KV: a pool of `num_blocks` blocks (a BlockPool of its own, never
the target's) and, per request, a block table and `tokens` — the tokens whose draft K/V sit at
positions 0 .. len(tokens) - 1. Drafted tokens are fed speculatively; at the next step `tokens`
is cut back to its longest prefix that the request really has (rejected drafts drop out: their
slots are rewritten later), so rollback costs nothing. A request's draft blocks go back to the
pool in `forget` (the request finished, failed or was aborted). A request the draft pool cannot
hold gets no drafts (it decodes plainly) and keeps no draft blocks.

Per step (`propose`): one forward over every request's pending tokens (those the draft has not
seen yet: the last token, often one accepted draft or bonus token more; the whole context the
first time, in chunks of at most `chunk_tokens` per step for all requests together — so a decode
node that receives long prompts' KV does not stall a step on the draft's prefill; a chunk that
does not reach the end drafts nothing this step), then k - 1 single-token steps batched over
the requests still drafting. Greedy requests draft the argmax; sampled ones draw from the draft's
own distribution q (same temperature/top-k/top-p), which verification needs (returned per request).

Invariant: a request's draft state never claims K/V for a token the request does not have at
that position, and `len(tokens) <= num_tokens - 1` when a draft starts (the last token is fed
every step, so its row gives the first draft token).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer as RustTokenizer

from engine.attention import build_metadata
from engine.block_pool import BlockPool
from engine.model_config import ModelConfig
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampler import processed_probs

log = logging.getLogger("duet.engine.spec")


#: pending tokens a drafting request has in the steady state (its last token, accepted drafts and
#: the bonus token): always fed; more is a catch-up, limited per step
_STEADY = 16


class DraftTokenizerMismatch(ValueError):
    """The draft model's tokenizer is not the target's: its token ids would mean other text."""


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """Raise DraftTokenizerMismatch unless both tokenizers map every token to the same id."""
    a = RustTokenizer.from_file(str(Path(target_dir) / "tokenizer.json")).get_vocab(
        with_added_tokens=True
    )
    b = RustTokenizer.from_file(str(Path(draft_dir) / "tokenizer.json")).get_vocab(
        with_added_tokens=True
    )
    if a == b:
        return
    # a != b: some token's ids differ
    diff = next(t for t in sorted(a.keys() | b.keys()) if a.get(t) != b.get(t))
    raise DraftTokenizerMismatch(
        f"the speculative model {draft_dir} has a different tokenizer from the target {target_dir} "
        f"({len(b)} tokens against {len(a)}; token {diff!r} is id {b.get(diff)} there and "
        f"{a.get(diff)} here): "
        "a draft model must share the target's tokenizer"
    )


@dataclass
class DraftSeq:
    block_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # draft K/V holds these, positions 0..len-1
    confirmed: int = 0  # tokens[:confirmed] are the request's own (the rest were drafted)
    #: a seeded request's own draft generator (its output is reproducible within one engine)
    gen: torch.Generator | None = None


@dataclass
class Draft:
    tokens: list[int]
    #: the draft's distribution for each token (sampled requests; None: greedy, a point mass)
    q: torch.Tensor | None = None


class DraftModel:
    def __init__(
        self,
        model_dir: Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str | None,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        chunk_tokens: int,
        seed: int = 0,
    ) -> None:
        self.runner = ModelRunner(
            model_dir,
            cfg,
            dtype,
            device,
            num_blocks,
            block_size,
            max_model_len,
            quantization=quantization,
        )
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.chunk_tokens = max(1, chunk_tokens)
        self.seqs: dict[str, DraftSeq] = {}
        self.starved: set[str] = set()  # requests the draft pool could not hold: no drafts
        self.gen = torch.Generator().manual_seed(seed)
        self.forward_passes = 0

    # -- state -----------------------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(seq.block_ids)
        self.starved.discard(request_id)

    def _sync(self, req: Request, seq: DraftSeq) -> None:
        """Cut `seq.tokens` back to the longest prefix the request has, short of its last token.
        Tokens only ever append to a request, so only what was drafted after `confirmed`
        can differ."""
        limit = min(len(seq.tokens), req.num_tokens - 1)
        n = min(seq.confirmed, limit)
        while n < limit and seq.tokens[n] == req.token_at(n):
            n += 1
        del seq.tokens[n:]
        seq.confirmed = n

    def _reserve(self, req: Request, seq: DraftSeq, upto: int) -> bool:
        need = -(-upto // self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.block_ids.extend(self.pool.allocate(need))
        return True

    # -- drafting --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, wants: list[tuple[Request, int]]) -> dict[str, Draft]:
        """Drafts of up to k tokens for each (request, k) with k >= 1; a request missing from
        the answer drafts nothing this step."""
        feeds: list[tuple[Request, DraftSeq, list[int], int]] = []  # (req, seq, pending, k)
        left = self.chunk_tokens  # catch-up tokens this step, all requests together
        for req, k in wants:
            rid = req.request_id
            if rid in self.starved:
                continue
            seq = self.seqs.get(rid)
            if seq is None:
                seq = self.seqs[rid] = DraftSeq()
            self._sync(req, seq)
            have = len(seq.tokens)
            remaining = req.num_tokens - have
            if remaining > _STEADY:  # a catch-up: from this step's shared allowance
                remaining = min(remaining, left)
                left -= remaining
                if remaining <= 0:
                    continue
            pending = [req.token_at(i) for i in range(have, have + remaining)]
            catching_up = have + len(pending) < req.num_tokens
            k = 0 if catching_up else k
            if not self._reserve(req, seq, len(seq.tokens) + len(pending) + max(0, k - 1)):
                log.info("draft KV pool full: request %s decodes without drafts", rid)
                self.forget(rid)
                self.starved.add(rid)
                continue
            feeds.append((req, seq, pending, k))
        if not feeds:
            return {}
        # step 1: every request's pending tokens; its last row gives the first draft token
        chains: dict[str, list[int]] = {req.request_id: [] for req, _, _, k in feeds if k > 0}
        qs: dict[str, list[torch.Tensor]] = {rid: [] for rid in chains}
        rows = self._forward([(seq, pending) for _, seq, pending, _ in feeds])
        for _, seq, _, _ in feeds:
            seq.confirmed = len(seq.tokens)
        live = [(req, seq, k) for (req, seq, _, k) in feeds if k > 0]
        self._pick(live, [rows[i] for i, f in enumerate(feeds) if f[3] > 0], chains, qs)
        # steps 2..k: one token per request still short of its k
        while True:
            live = [(req, seq, k) for req, seq, k in live if len(chains[req.request_id]) < k]
            if not live:
                break
            rows = self._forward([(seq, [chains[req.request_id][-1]]) for req, seq, _ in live])
            self._pick(live, list(rows), chains, qs)
        return {
            rid: Draft(toks, torch.stack(qs[rid]) if qs[rid] else None)
            for rid, toks in chains.items()
        }

    def _pick(
        self,
        live: list[tuple[Request, DraftSeq, int]],
        rows: list[torch.Tensor],
        chains: dict[str, list[int]],
        qs: dict[str, list[torch.Tensor]],
    ) -> None:
        for (req, seq, _), row in zip(live, rows, strict=True):
            p = req.params
            if p.greedy:
                tok = int(row.argmax())
            else:
                if p.seed is not None and seq.gen is None:
                    seq.gen = torch.Generator().manual_seed(p.seed)
                q = processed_probs(row.unsqueeze(0), [p])[0]
                tok = int(torch.multinomial(q, 1, generator=seq.gen or self.gen))
                qs[req.request_id].append(q)
            chains[req.request_id].append(tok)

    def _forward(self, feeds: list[tuple[DraftSeq, list[int]]]) -> torch.Tensor:
        """Feed each seq its tokens (appended to seq.tokens); the logits of each one's last."""
        order = sorted(range(len(feeds)), key=lambda i: len(feeds[i][1]) != 1)  # decodes first
        decodes, prefills, ids, last = [], [], [], [0] * len(feeds)
        at = 0
        for i in order:
            seq, toks = feeds[i]
            start = len(seq.tokens)
            if len(toks) == 1:
                decodes.append((seq.block_ids, start))
            else:
                prefills.append((seq.block_ids, start, len(toks)))
            ids.extend(toks)
            at += len(toks)
            last[i] = at - 1
            seq.tokens.extend(toks)
        r = self.runner
        md = build_metadata(self.block_size, decodes, prefills, r.cfg.sliding_window, r.device)
        self.forward_passes += 1
        return r.model.forward(
            torch.tensor(ids, dtype=torch.long, device=r.device),
            r.kv_cache,
            md,
            torch.tensor(last, dtype=torch.long, device=r.device),
        )
