"""Paged attention on the block-major KV pool: step metadata, and the kernel / torch paths.

A step's tokens are laid out decodes first (one query each), then prefill chunks. Each token
has a position, a pool slot for its new K/V, a row in the step's block tables (one row per
decode sequence or prefill chunk) and a context length (position + 1). Everything layers
share is built once per step in `AttentionMetadata`.

Paths: with the CPU kernels, a bf16 step's decodes attend through `paged_attention` and its
prefill tokens through `prefill_attention` (query blocks; engine/kernels/). In fp32 only the
decodes do: prefill chunks use torch SDPA, which keeps fp32 greedy output token-identical to
transformers. Without kernels (CUDA, no compiler, DUET_DISABLE_KERNELS=1) everything is SDPA:
decodes gather their blocks into a padded batch with a length mask, a chunk after a cached
prefix gathers its sequence's blocks with an offset causal mask.

An int8 pool (engine/kv_quant.py): decodes attend through the paged kernel's int8 path, and a
prefill chunk after a cached prefix through `prefill_attention`, which widens its context's rows
once into a dense copy where a float pool would take a query-block path, else reads them in place
per token (SDPA would gather and dequantize the whole context in torch once per layer: a 32-token
bf16 chunk after 2,048 took 4× the CPU, bench.kv_int8_prefix); a chunk with no cached prefix
attends on SDPA to its own unquantized K/V (the model's `kernel_prefill` is off), so only keys
read back from the pool carry the quantization error. Each kind of chunk sees the keys it saw
before: one after a prefix read its own rows back from the pool on SDPA too.

Invariant: the new tokens' K/V are written into their slots before attention reads the pool,
so a chunk attends to itself and to every earlier token of its sequence.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine import kv_quant

#: an int8 pool's prefill chunks after a cached prefix attend on the kernel (False: on SDPA, the
#: path bench.kv_int8_prefix times the kernel against)
INT8_PREFIX_ON_KERNEL = True


@dataclass
class PrefillChunk:
    q_start: int  # offset of the chunk's first token in the step
    q_len: int
    start_pos: int  # position of the chunk's first token in its sequence
    row: int  # its row in the step's block tables


@dataclass
class AttentionMetadata:
    block_size: int
    positions: torch.Tensor  # [T] int64
    slot_block: torch.Tensor  # [T] block of each new token
    slot_offset: torch.Tensor  # [T] offset in that block
    block_tables: torch.Tensor  # [rows, width] int64, zero-padded
    token_row: torch.Tensor  # [T] int32: row of each token in block_tables
    ctx_lens: torch.Tensor  # [T] int32: keys visible to each token (position + 1)
    max_ctx: int
    num_decode: int = 0
    sliding_window: int | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    # -- torch-path views, built on first use only -----------------------------------------
    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """[B, 1, 1, width * block_size] bool: True where a decode token may attend."""
        b = self.num_decode
        ctx = self.ctx_lens[:b].long()
        k = torch.arange(self.block_tables.shape[1] * self.block_size, device=ctx.device)
        mask = k[None, :] < ctx[:, None]
        if self.sliding_window is not None:
            mask &= k[None, :] >= ctx[:, None] - self.sliding_window
        return mask[:, None, None, :]

    def chunk_mask(self, p: PrefillChunk) -> torch.Tensor | None:
        """[q_len, ctx] bool for a chunk; None when plain causal attention is exact."""
        ctx = p.start_pos + p.q_len
        w = self.sliding_window
        if p.start_pos == 0 and (w is None or ctx <= w):
            return None
        dev = self.positions.device
        pos = torch.arange(p.start_pos, ctx, device=dev)
        k = torch.arange(ctx, device=dev)
        mask = k[None, :] <= pos[:, None]
        if w is not None:
            mask &= k[None, :] > pos[:, None] - w
        return mask


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_metadata(
    block_size: int,
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[list[int], int, int]],
    sliding_window: int | None,
    device: torch.device,
) -> AttentionMetadata:
    """decodes: (block_ids, position) per decode token; prefills: (block_ids, start, length)."""
    bs = block_size
    rows: list[list[int]] = []
    positions: list[int] = []
    blocks: list[int] = []
    offsets: list[int] = []
    token_row: list[int] = []
    for bids, pos in decodes:
        token_row.append(len(rows))
        rows.append(bids[: pos // bs + 1])
        positions.append(pos)
        blocks.append(bids[pos // bs])
        offsets.append(pos % bs)
    chunks = []
    for bids, start, n in prefills:
        chunks.append(PrefillChunk(len(positions), n, start, len(rows)))
        token_row.extend([len(rows)] * n)
        rows.append(bids[: cdiv(start + n, bs)])
        span = range(start, start + n)
        positions.extend(span)
        blocks.extend([bids[p // bs] for p in span])
        offsets.extend([p % bs for p in span])
    width = max(len(r) for r in rows)
    table = [r + [0] * (width - len(r)) for r in rows]

    def t(xs: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(xs, dtype=dtype, device=device)

    return AttentionMetadata(
        block_size=bs,
        positions=t(positions, torch.long),
        slot_block=t(blocks, torch.long),
        slot_offset=t(offsets, torch.long),
        block_tables=t(table, torch.long),
        token_row=t(token_row, torch.int32),
        ctx_lens=t([p + 1 for p in positions], torch.int32),
        max_ctx=max(positions) + 1,
        num_decode=len(decodes),
        sliding_window=sliding_window,
        prefills=chunks,
    )


def _gather(cache: torch.Tensor, kv: int, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K (kv=0) or V (kv=1) rows of `blocks` of one layer, as [..., tokens, kvh, dim] in `dtype`
    (dequantized from an int8 pool)."""
    return kv_quant.read(cache[:, kv][blocks].flatten(-4, -3), dtype)


def _decode_torch(q: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    b, heads, dim = md.num_decode, q.shape[1], q.shape[2]
    blocks = md.block_tables[:b]
    kc = _gather(cache, 0, blocks, q.dtype).transpose(1, 2)
    vc = _gather(cache, 1, blocks, q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q[:b].unsqueeze(2), kc, vc, attn_mask=md.decode_mask, enable_gqa=True
    )
    return o.reshape(b, heads * dim)


def _prefill_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    md: AttentionMetadata,
    p: PrefillChunk,
) -> torch.Tensor:
    heads, dim = q.shape[1], q.shape[2]
    sl = slice(p.q_start, p.q_start + p.q_len)
    qs = q[sl].transpose(0, 1)
    if p.start_pos == 0:
        ks, vs = k[sl].transpose(0, 1), v[sl].transpose(0, 1)
    else:
        ctx = p.start_pos + p.q_len
        blocks = md.block_tables[p.row, : cdiv(ctx, md.block_size)]
        ks = _gather(cache, 0, blocks, q.dtype)[:ctx].transpose(0, 1)
        vs = _gather(cache, 1, blocks, q.dtype)[:ctx].transpose(0, 1)
    mask = md.chunk_mask(p)
    o = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    return o.transpose(0, 1).reshape(p.q_len, heads * dim)


def paged_attention(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D], q and k rotated, K/V already in the pool
    heads: int,
    kv_cache: torch.Tensor,  # the whole pool
    layer: int,
    md: AttentionMetadata,
    lib: ctypes.CDLL | None,
    step_ptr: int,
    kernel_prefill: bool,
) -> torch.Tensor:
    """Attention output [T, H * D]. `lib`/`step_ptr`: the CPU kernels and this step's `Step`
    (None/0: torch only); `kernel_prefill`: prefill chunks use the kernel too."""
    t = qkv.shape[0]
    kvh, dim = kv_cache.shape[4], kv_quant.head_dim(kv_cache)
    out = torch.empty((t, heads * dim), dtype=qkv.dtype, device=qkv.device)
    n_kernel = 0
    if lib is not None:
        nd = md.num_decode
        if nd:
            lib.paged_attention(
                step_ptr, layer, 0, nd, qkv.data_ptr(), qkv.stride(0), out.data_ptr(), heads * dim
            )
        n_kernel = nd
        if kernel_prefill and t > nd:
            lib.prefill_attention(
                step_ptr,
                layer,
                nd,
                t - nd,
                qkv.data_ptr(),
                qkv.stride(0),
                out[nd:].data_ptr(),
                heads * dim,
            )
            n_kernel = t
    if n_kernel == t:
        return out
    q = qkv[:, : heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim : (heads + kvh) * dim].view(t, kvh, dim)
    v = qkv[:, (heads + kvh) * dim :].view(t, kvh, dim)
    cache = kv_cache[:, layer]
    if md.num_decode and n_kernel == 0:
        out[: md.num_decode] = _decode_torch(q, cache, md)
    int8 = kv_quant.is_quantized(kv_cache)
    for p in md.prefills:
        if lib is not None and int8 and p.start_pos > 0 and INT8_PREFIX_ON_KERNEL:
            # its whole context comes back from the int8 pool either way: the kernel widens the
            # rows once for its query blocks (or reads them in place per token), where SDPA
            # would gather and dequantize them in torch once per layer
            lib.prefill_attention(
                step_ptr,
                layer,
                p.q_start,
                p.q_len,
                qkv.data_ptr(),
                qkv.stride(0),
                out[p.q_start :].data_ptr(),
                heads * dim,
            )
        else:
            out[p.q_start : p.q_start + p.q_len] = _prefill_torch(q, k, v, cache, md, p)
    return out
