"""Embeddings: prompts → one pooled, L2-normalized vector each, from the final hidden states.

A prefill-only forward through the same model code as generation (`LlamaModel.hidden_states`:
the residual stream after the final norm, what the logits head would read), with no sampling
and no KV kept: each prompt's K/V go to scratch blocks taken from the engine's own block pool
for the forward and given back right after it, never hashed, so the prefix cache neither serves
nor learns an embedding prompt and a generation request sharing the engine loses nothing.

Pooling (`Pooling`):
- `last`: the last token's hidden state — Qwen3-Embedding and the other decoder embedders,
  whose tokenizer ends each input with an end-of-text token;
- `mean`: the mean over the prompt's tokens (causal attention: each state sees its prefix).

`dimensions` keeps the first d components of the pooled vector before the L2 normalization,
which is the same as normalizing, truncating and normalizing again (OpenAI's Matryoshka-style
`dimensions`). Vectors come back as float32 whatever the model's dtype.

Batching: `embed` packs many prompts (of many requests: the async engine hands it every job
queued while the last forward ran) into forwards of at most `max_num_batched_tokens` tokens —
a prompt longer than that runs alone in one forward. Single-threaded like EngineCore: call it
on the engine thread.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.attention import build_metadata, cdiv
from engine.block_pool import BlockPool, NoFreeBlocksError
from engine.runner import ModelRunner


class Pooling(enum.StrEnum):
    LAST = "last"
    MEAN = "mean"


class EmbedCapacityError(RuntimeError):
    """The pool has not enough free blocks for one prompt now (generation holds them)."""


def pool_hidden(hidden: torch.Tensor, lengths: Sequence[int], pooling: Pooling) -> torch.Tensor:
    """[T, H] final hidden states of prompts laid end to end → [B, H] fp32, one row a prompt."""
    if pooling is Pooling.LAST:
        ends = torch.tensor(lengths, device=hidden.device).cumsum(0) - 1
        return hidden[ends].float()
    seg = torch.repeat_interleave(
        torch.arange(len(lengths), device=hidden.device),
        torch.tensor(lengths, device=hidden.device),
    )
    sums = torch.zeros((len(lengths), hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seg, hidden.float())
    return sums / torch.tensor(lengths, dtype=torch.float32, device=hidden.device)[:, None]


def finish(pooled: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """Truncate to `dimensions` (None: all) and L2-normalize each row."""
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, p=2.0, dim=1)


class Embedder:
    def __init__(self, runner: ModelRunner, pool: BlockPool, max_batched_tokens: int) -> None:
        self.runner = runner
        self.pool = pool
        self.max_batched_tokens = max_batched_tokens
        self.hidden_size = runner.cfg.hidden_size
        #: prompt tokens computed and forwards run (the node's counters)
        self.tokens = 0
        self.forwards = 0

    def embed(self, prompts: Sequence[Sequence[int]], pooling: Pooling) -> torch.Tensor:
        """[B, H] fp32 pooled (not yet normalized) vectors of `prompts`, in order, on the CPU."""
        out: list[torch.Tensor] = []
        batch: list[Sequence[int]] = []
        tokens = 0
        for ids in prompts:
            if batch and tokens + len(ids) > self.max_batched_tokens:
                out.append(self._forward(batch, pooling))
                batch, tokens = [], 0
            batch.append(ids)
            tokens += len(ids)
        if batch:
            out.append(self._forward(batch, pooling))
        return torch.cat(out) if out else torch.empty((0, self.hidden_size))

    def _forward(self, batch: list[Sequence[int]], pooling: Pooling) -> torch.Tensor:
        bs = self.runner.block_size
        need = [cdiv(len(ids), bs) for ids in batch]
        if (
            sum(need) > self.pool.num_free and len(batch) > 1
        ):  # smaller forwards fit where one does not
            half = len(batch) // 2
            return torch.cat(
                [self._forward(batch[:half], pooling), self._forward(batch[half:], pooling)]
            )
        try:
            blocks = self.pool.allocate(sum(need))
        except NoFreeBlocksError as e:
            raise EmbedCapacityError(
                f"no room in the KV pool for a {len(batch[0])}-token prompt now ({e})"
            ) from None
        try:
            tables, at = [], 0
            for n in need:
                tables.append(blocks[at : at + n])
                at += n
            dev = self.runner.device
            md = build_metadata(
                bs,
                [],
                [(t, 0, len(ids)) for t, ids in zip(tables, batch, strict=True)],
                self.runner.cfg.sliding_window,
                dev,
            )
            ids = torch.tensor([t for p in batch for t in p], dtype=torch.long, device=dev)
            lengths = [len(p) for p in batch]
            rows = None
            if pooling is Pooling.LAST:  # only the last rows go through the final norm
                rows = torch.tensor(lengths, device=dev).cumsum(0) - 1
            hidden = self.runner.model.hidden_states(ids, self.runner.kv_cache, md, rows)
            pooled = hidden.float() if rows is not None else pool_hidden(hidden, lengths, pooling)
        finally:
            self.pool.free(blocks)
        self.tokens += int(ids.shape[0])
        self.forwards += 1
        return pooled.cpu()
