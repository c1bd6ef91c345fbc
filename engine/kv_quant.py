"""The 8-bit KV pool (`--kv-cache-dtype int8`): quantize K/V rows on write, dequantize on read.

An int8 pool is `[num_blocks, layers, 2, block_size, kv_heads, head_dim + 4]` int8: each row (one
token's K or V of one KV head) is `head_dim` int8 values and then its fp32 scale's 4 bytes
(protocol/kv_layout.py). Symmetric absmax quantization per row: scale = max|x| / 127,
q = round(x / scale) in [-127, 127], so x ≈ q · scale within scale / 2 per element (an all-zero
row has scale 0 and reads back as zeros). Keeping the scale inside the row keeps a block one
contiguous byte range: transfers, spill tiers and digests move and cover the scales without
knowing they are there.

The rows are written by the `rope_store` kernel (engine/kernels/rope_store.c, the same bytes as
`quantize`) or the torch store step (engine/rope.py), and read by the decode attention kernel
(engine/kernels/attention_int8.h) or the torch attention paths (engine/attention.py: prefill
chunks, and every step without kernels; engine/models/softcap.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from protocol.kv_layout import SCALE_BYTES

#: what the native engine's pool stores (`--kv-cache-dtype`; auto: the model's own dtype)
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8")
_SCALE = SCALE_BYTES["int8"]


def kv_layout_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The pool's dtype name (KVLayout.dtype) for a `--kv-cache-dtype` value."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype!r} is not served by the native engine (its 8-bit "
            f"KV is int8; fp8 is vLLM's, --engine vllm): use one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return kv_cache_dtype


def is_quantized(pool: torch.Tensor) -> bool:
    return pool.dtype == torch.int8


def head_dim(pool: torch.Tensor) -> int:
    """The model's head_dim for a pool of either kind (the last dimension less the scale)."""
    return pool.shape[-1] - (_SCALE if is_quantized(pool) else 0)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float → [..., D + 4] int8 rows (values, then the fp32 scale's bytes)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = (xf * inv).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat((q, scale.view(torch.int8)), dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows → [..., D] in `dtype`."""
    d = rows.shape[-1] - _SCALE
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def store(dst: torch.Tensor, index: tuple, x: torch.Tensor) -> None:
    """dst[index] = x, quantized when dst is an int8 pool."""
    dst[index] = quantize(x) if is_quantized(dst) else x


def read(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a pool, as `dtype` (dequantized from an int8 pool)."""
    return dequantize(rows, dtype) if is_quantized(rows) else rows


class _KernelModel(Protocol):
    kv_int8: bool


def kv_int8_pool(model: _KernelModel) -> None:
    """`model` runs over an int8 pool. On the CPU kernels its K/V rows are quantized by
    `rope_store` (these bytes, bitwise) and decode tokens attend through `paged_attention`'s int8
    paths (engine/kernels/attention_int8.h). Prefill chunks attend on SDPA: a chunk with no cached
    prefix then reads its own K/V unquantized, as the torch path does (the blocked prefill
    kernels read float pools only)."""
    model.kv_int8 = True
