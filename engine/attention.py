"""Paged attention on the block-major KV pool, with torch's SDPA kernels.

A step's tokens are laid out decodes first (one query each, batched together: their blocks are
gathered into a padded `[B, blocks, block_size, kv_heads, head_dim]` view and masked past each
context length), then prefill chunks (one SDPA call each: plain causal when the chunk starts
at position 0, else against the gathered prefix with an offset causal mask). Everything a
step's layers share (gather indices, masks, slot mapping) is built once in `AttentionMetadata`.

Invariant: the new tokens' K/V are written into their slots before attention reads the pool,
so a chunk attends to itself and to every earlier token of its sequence.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    q_start: int  # offset of the chunk's first token in the step
    q_len: int
    start_pos: int  # position of the chunk's first token in its sequence
    blocks: torch.Tensor | None  # block ids covering [0, start_pos + q_len); None if start_pos == 0
    mask: torch.Tensor | None  # [q_len, ctx] bool (True: attend); None for plain causal


@dataclass
class AttentionMetadata:
    slot_block: torch.Tensor  # [T] block of each new token
    slot_offset: torch.Tensor  # [T] offset in that block
    num_decode: int = 0
    decode_blocks: torch.Tensor | None = None  # [B, max_blocks]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] bool
    decode_ctx: torch.Tensor | None = None  # [B] int32 context length (kernel path)
    sliding_window: int | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


def build_metadata(
    block_size: int,
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[list[int], int, int]],
    sliding_window: int | None,
    device: torch.device,
) -> AttentionMetadata:
    """decodes: (block_ids, position) per decode token; prefills: (block_ids, start, length)."""
    blocks: list[int] = []
    offsets: list[int] = []
    for bids, pos in decodes:
        blocks.append(bids[pos // block_size])
        offsets.append(pos % block_size)
    md_prefills = []
    q_start = len(decodes)
    for bids, start, n in prefills:
        pos = torch.arange(start, start + n)
        bt = torch.tensor(bids, dtype=torch.long)
        blocks.extend(bt[pos // block_size].tolist())
        offsets.extend((pos % block_size).tolist())
        ctx = start + n
        chunk_blocks = None
        mask = None
        if start > 0:
            chunk_blocks = bt[: -(-ctx // block_size)].to(device)
        if start > 0 or (sliding_window is not None and ctx > sliding_window):
            k = torch.arange(ctx)
            mask = k[None, :] <= pos[:, None]
            if sliding_window is not None:
                mask &= k[None, :] > pos[:, None] - sliding_window
            mask = mask.to(device)
        md_prefills.append(PrefillChunk(q_start, n, start, chunk_blocks, mask))
        q_start += n
    md = AttentionMetadata(
        slot_block=torch.tensor(blocks, dtype=torch.long, device=device),
        slot_offset=torch.tensor(offsets, dtype=torch.long, device=device),
        num_decode=len(decodes),
        prefills=md_prefills,
        sliding_window=sliding_window,
    )
    if decodes:
        width = max(pos // block_size + 1 for _, pos in decodes)
        table = [bids[:width] + [0] * (width - min(len(bids), width)) for bids, _ in decodes]
        md.decode_blocks = torch.tensor(table, dtype=torch.long, device=device)
        ctx = torch.tensor([pos + 1 for _, pos in decodes], dtype=torch.int32, device=device)
        md.decode_ctx = ctx
        k = torch.arange(width * block_size, device=device)
        mask = k[None, :] < ctx[:, None]
        if sliding_window is not None:
            mask &= k[None, :] >= ctx[:, None] - sliding_window
        md.decode_mask = mask[:, None, None, :]
    return md


def _decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, md: AttentionMetadata,
                   lib: ctypes.CDLL) -> torch.Tensor:  # fmt: skip
    b, heads, dim = md.num_decode, q.shape[1], q.shape[2]
    assert md.decode_blocks is not None and md.decode_ctx is not None and q.stride(2) == 1
    out = torch.empty((b, heads * dim), dtype=q.dtype)
    fn = lib.paged_decode_attention_bf16 if q.dtype == torch.bfloat16 else lib.paged_decode_attention_f32
    fn(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), layer * kv_cache.stride(1), kv_cache.stride(0),
       md.decode_blocks.data_ptr(), md.decode_blocks.shape[1], md.decode_ctx.data_ptr(),
       md.sliding_window or 0, out.data_ptr(), b, heads, kv_cache.shape[4], dim,
       kv_cache.shape[3], dim**-0.5)  # fmt: skip
    return out


def _decode_torch(q: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    b, heads, dim = md.num_decode, q.shape[1], q.shape[2]
    kvh = cache.shape[3]
    assert md.decode_blocks is not None and md.decode_mask is not None
    kc = cache[:, 0][md.decode_blocks].view(b, -1, kvh, dim).transpose(1, 2)
    vc = cache[:, 1][md.decode_blocks].view(b, -1, kvh, dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q[:b].unsqueeze(2), kc, vc, attn_mask=md.decode_mask, enable_gqa=True)
    return o.view(b, heads * dim)


def paged_attention(
    q: torch.Tensor,  # [T, H, D] (rotated)
    k: torch.Tensor,  # [T, KVH, D] (rotated, already written to the pool)
    v: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # the whole pool
    layer: int,
    md: AttentionMetadata,
    lib: ctypes.CDLL | None,
) -> torch.Tensor:
    """Attention output [T, H * D]. `lib`: the CPU kernel library (None: torch only)."""
    heads, dim = q.shape[1], q.shape[2]
    kvh = k.shape[1]
    cache = kv_cache[:, layer]
    outs = []
    if md.num_decode:
        if lib is not None:
            outs.append(_decode_kernel(q, kv_cache, layer, md, lib))
        else:
            outs.append(_decode_torch(q, cache, md))
    for p in md.prefills:
        qs = q[p.q_start : p.q_start + p.q_len].transpose(0, 1)
        if p.blocks is None:
            ks = k[p.q_start : p.q_start + p.q_len].transpose(0, 1)
            vs = v[p.q_start : p.q_start + p.q_len].transpose(0, 1)
        else:
            ctx = p.start_pos + p.q_len
            ks = cache[:, 0][p.blocks].view(-1, kvh, dim)[:ctx].transpose(0, 1)
            vs = cache[:, 1][p.blocks].view(-1, kvh, dim)[:ctx].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True
        )
        outs.append(o.transpose(0, 1).reshape(p.q_len, heads * dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
