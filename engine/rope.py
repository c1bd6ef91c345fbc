"""Rotary position embeddings as in transformers' Llama ("rotate half", non-interleaved).

cos/sin tables for every position are built once in fp32 (as transformers computes them) and
cast to the model dtype; a step gathers the rows of its positions once and every layer reuses
them (the `rope_store` CPU kernel reads the full tables directly, with the same rounding).
Scaling: default, linear, llama3 and longrope (Phi-3). longrope scales cos/sin by its attention
factor and uses its short factors for positions below `original_max_position_embeddings`, its
long factors from there on (vLLM's rule: a position's rotation never changes once its K is in
the pool). transformers switches a whole forward to the long factors once the sequence passes
that length, cached K included, so the two agree exactly up to it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine import kv_quant


def _kind(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def longrope_attention_factor(scaling: dict[str, Any]) -> float:
    """transformers' default: sqrt(1 + ln(factor) / ln(original context)) past a factor of 1."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


def inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, long: bool = False
) -> torch.Tensor:
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    kind = _kind(scaling)
    if kind == "longrope":
        assert scaling is not None
        ext = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**shape)
    freq = 1.0 / (theta**shape)
    if kind == "linear":
        assert scaling is not None
        freq = freq / float(scaling["factor"])
    elif kind == "llama3":
        assert scaling is not None
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        freq = torch.where(medium, smoothed, scaled)
    return freq


class Rope:
    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        t = torch.arange(max_positions, dtype=torch.int64).float()
        emb = torch.outer(t, inv_freq(head_dim, theta, scaling))
        scale = 1.0
        if _kind(scaling) == "longrope":
            assert scaling is not None
            scale = longrope_attention_factor(scaling)
            short = scaling["original_max_position_embeddings"]
            if max_positions > short:
                emb[short:] = torch.outer(t[short:], inv_freq(head_dim, theta, scaling, long=True))
        emb = torch.cat([emb, emb], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)
        self.half = head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for `positions`, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        x1, x2 = x[..., : self.half], x[..., self.half :]
        rotated = torch.cat([-x2, x1], dim=-1)
        return x * cos + rotated * sin

    def store_torch(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_cache: torch.Tensor,
        layer: int,
        slot_block: torch.Tensor,
        slot_offset: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Torch twin of the `rope_store` kernel: rotate q and k of the fused qkv activations
        [T, (H + 2 KVH) * D] in place and write k, v into their pool slots (quantized into an
        int8 pool: engine/kv_quant.py)."""
        t = qkv.shape[0]
        kvh, dim = kv_cache.shape[4], kv_quant.head_dim(kv_cache)
        width = (heads + kvh) * dim
        qk = self.apply(qkv[:, :width].view(t, heads + kvh, dim), cos, sin)
        qkv[:, :width] = qk.view(t, width)
        v = qkv[:, width:].view(t, kvh, dim)
        kv = torch.stack((qk[:, heads:], v), dim=1)
        kv_quant.store(kv_cache[:, layer], (slot_block, slice(None), slot_offset), kv)
