"""ModelRunner: owns the weights and the KV pool, turns scheduled chunks into one forward pass.

The pool is one tensor, block-major `[num_blocks, layers, 2, block_size, kv_heads, head_dim]`
(DESIGN §3; head_dim + 4 scale bytes per row in an int8 pool: engine/kv_quant.py), so a block is a
contiguous byte range the transport can move as one region; `kv_layout` describes it for kvtransfer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import build_metadata
from engine.kv_quant import kv_int8_pool
from engine.lora.slots import LoraSlots
from engine.model_config import ModelConfig
from engine.models import BuildSpec, build_model
from engine.request import Request
from engine.scheduler import ScheduledChunk
from protocol.kv_layout import KVLayout


@dataclass
class PromptRows:
    """Logits at prompt positions `first .. first + len(logits) - 1` of `req`: row i scores
    prompt token `first + i + 1`."""

    req: Request
    first: int
    logits: torch.Tensor  # [n, V]


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

#: Allocates the (zeroed) KV pool for a layout on a device. The node passes kvtransfer's, which
#: backs a host pool with huge pages from the first touch (cheaper than advising later).
PoolFactory = Callable[[KVLayout, str], torch.Tensor]


def zeroed_pool(layout: KVLayout, device: str) -> torch.Tensor:
    return torch.zeros(layout.pool_shape, dtype=getattr(torch, layout.dtype), device=device)


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        pool_factory: PoolFactory = zeroed_pool,
        quantization: str | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        kv_dtype: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.quantization = quantization
        #: what `build_model` takes again on wake (engine/models/: the architecture's forward)
        self.build_spec = BuildSpec(model_dir, cfg, dtype, device, max_model_len, quantization)
        self.model = build_model(self.build_spec)
        #: the resident LoRA adapters (engine/lora/slots.py); None: LoRA off
        self.lora: LoraSlots | None = None
        if max_loras:
            self.lora = LoraSlots(cfg, max_loras, max_lora_rank, dtype, device)
            self.lora.attach(self.model)
        self.kv_layout = KVLayout(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=block_size,
            dtype=kv_dtype or DTYPE_NAMES[dtype],  # "int8": engine/kv_quant.py
            num_blocks=num_blocks,
            weights=quantization or "",
            attention=cfg.kv_attention,
        )
        self.kv_cache = pool_factory(self.kv_layout, str(device))
        expected = self.kv_layout.pool_shape
        want = getattr(torch, self.kv_layout.dtype)
        if tuple(self.kv_cache.shape) != expected or self.kv_cache.dtype != want:
            raise ValueError(
                f"KV pool factory returned {tuple(self.kv_cache.shape)} "
                f"{self.kv_cache.dtype}, expected {expected} {want}"
            )
        if self.kv_layout.dtype == "int8":
            kv_int8_pool(self.model)

    def execute(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], torch.Tensor, list[PromptRows]]:
        """Run one step. Returns the chunks that sample, in order, their logits [S, V] (1 + the
        draft's length rows per chunk, in chunk order), and
        the prompt-logprob rows: for each chunk whose request wants prompt logprobs, the
        logits of its positions that predict a prompt token not yet scored (computed only
        then: every other row stops at the last hidden state)."""
        # A speculative chunk (its token, then the draft) runs as one decode query per token:
        # each attends to the K/V written before it in the same step, and through the decode
        # kernel its rows are bit for bit what one-token decode steps give (greedy identity).
        decodes = [c for c in chunks if (c.num_tokens == 1 and c.start > 0) or c.draft]
        prefills = [c for c in chunks if not ((c.num_tokens == 1 and c.start > 0) or c.draft)]
        ids: list[int] = []
        for c in decodes:
            ids.append(c.req.token_at(c.start))
            ids.extend(c.draft)
        for c in prefills:
            ids.extend(c.req.all_token_ids[c.start : c.start + c.num_tokens])
        md = build_metadata(
            self.block_size,
            [(c.req.block_ids, c.start + j) for c in decodes for j in range(c.num_tokens)],
            [(c.req.block_ids, c.start, c.num_tokens) for c in prefills],
            self.cfg.sliding_window,
            self.device,
        )
        ordered = decodes + prefills
        sample_rows: list[int] = []
        samplers, row = [], 0
        extra_rows: list[int] = []
        prompt: list[tuple[ScheduledChunk, int, int]] = []  # (chunk, first position, count)
        for c in ordered:
            req = c.req
            if req.needs_prompt_logprobs:
                # position p predicts prompt token p + 1; the gathered list already covers 1..len
                first = max(c.start, len(req.prompt_logprobs))
                end = min(c.start + c.num_tokens, req.num_prompt_tokens - 1)
                if end > first:
                    prompt.append((c, first, end - first))
                    extra_rows.extend(range(row + first - c.start, row + end - c.start))
            row += c.num_tokens
            if c.samples:  # a speculative chunk: the rows of its token and of every draft token
                sample_rows.extend(range(row - 1 - len(c.draft), row))
                samplers.append(c)
        dev = self.device
        if self.lora is not None:  # each token's adapter slot (-1: the base model)
            slot = self.lora.slot_of
            self.lora.begin_step(
                [
                    slot(c.req.params.lora_name) if c.req.params.lora_name else -1
                    for c in ordered
                    for _ in range(c.num_tokens)
                ]
            )
        try:
            logits = self.model.forward(
                torch.tensor(ids, dtype=torch.long, device=dev),
                self.kv_cache,
                md,
                torch.tensor(sample_rows + extra_rows, dtype=torch.long, device=dev),
            )
        finally:
            if self.lora is not None:
                self.lora.end_step()
        out: list[PromptRows] = []
        at = len(sample_rows)
        for c, first, n in prompt:
            out.append(PromptRows(c.req, first, logits[at : at + n]))
            at += n
        return samplers, logits[: len(sample_rows)], out
