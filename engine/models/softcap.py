"""Attention with soft-capped scores (Gemma 2: s = tanh(q·k · scale / cap) · cap before the
mask and softmax) over the paged KV pool, in torch: neither SDPA nor the CPU kernels cap scores.

The arithmetic is transformers' eager attention: scores by matmul in the model dtype, times the
scale, capped, masked, softmax in fp32 cast back, times V. Decodes run as one padded batch (one
query each, a length mask with the layer's window); each prefill chunk reads its sequence's
blocks (its own K/V are already in the pool: the rotary step wrote them) with a causal mask.
"""

from __future__ import annotations

import torch

from engine import kv_quant
from engine.attention import AttentionMetadata, cdiv


def _attend(
    q: torch.Tensor,  # [B, Tq, H, D]
    k: torch.Tensor,  # [B, Tk, KVH, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # [B, Tq, Tk] bool, True: may attend
    scale: float,
    cap: float,
) -> torch.Tensor:
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    s = torch.matmul(qh, kh.transpose(2, 3)) * scale
    s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask[:, None], torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.matmul(p, vh)  # [B, H, Tq, D]
    return o.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


def softcap_attention(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D], q and k rotated, K/V in the pool
    heads: int,
    kv_cache: torch.Tensor,
    layer: int,
    md: AttentionMetadata,
    scale: float,
    cap: float,
) -> torch.Tensor:
    t = qkv.shape[0]
    dim = kv_quant.head_dim(kv_cache)
    q = qkv[:, : heads * dim].view(t, heads, dim)
    cache = kv_cache[:, layer]  # [blocks, 2, block_size, KVH, D]
    out = torch.empty((t, heads * dim), dtype=qkv.dtype, device=qkv.device)
    b = md.num_decode
    if b:
        blocks = md.block_tables[:b]
        k = kv_quant.read(cache[:, 0][blocks].flatten(1, 2), q.dtype)
        v = kv_quant.read(cache[:, 1][blocks].flatten(1, 2), q.dtype)
        out[:b] = _attend(q[:b, None], k, v, md.decode_mask[:, 0], scale, cap)[:, 0]
    for p in md.prefills:
        ctx = p.start_pos + p.q_len
        blocks = md.block_tables[p.row, : cdiv(ctx, md.block_size)]
        k = kv_quant.read(cache[:, 0][blocks].flatten(0, 1)[:ctx], q.dtype)
        v = kv_quant.read(cache[:, 1][blocks].flatten(0, 1)[:ctx], q.dtype)
        mask = md.chunk_mask(p)
        if mask is None:  # plain causal
            mask = torch.ones(p.q_len, ctx, dtype=torch.bool, device=qkv.device).tril(p.start_pos)
        sl = slice(p.q_start, p.q_start + p.q_len)
        out[sl] = _attend(q[sl][None], k[None], v[None], mask[None], scale, cap)[0]
    return out
