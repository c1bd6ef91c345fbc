"""The Llama-family forward pass over a flat batch of tokens and the paged KV pool.

Written as plain functions over fused weights (one GEMM for q/k/v, one for gate/up) rather
than nn.Modules: the per-step Python overhead is what bounds single-stream decode on a CPU.
The math follows transformers' Llama/Qwen2/Mistral exactly (RMSNorm, rotate-half RoPE, SwiGLU,
SDPA attention), which is what makes greedy output token-identical in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.kernels import paged_attention_lib
from engine.model_config import ModelConfig
from engine.rope import Rope
from engine.weights import ModelWeights


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, rope: Rope, device: torch.device) -> None:
        self.cfg = cfg
        lib = paged_attention_lib() if device.type == "cpu" else None
        self.kernels = lib if weights.embed.dtype in (torch.float32, torch.bfloat16) else None
        self.w = weights
        self.rope = rope
        self.eps = cfg.rms_norm_eps
        self.hidden = (cfg.hidden_size,)
        self.qk_width = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.hidden, weight, self.eps)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_blocks, layers, 2, block_size, KVH, D]
        md: AttentionMetadata,
        sample_idx: torch.Tensor,  # [S] rows of the step whose logits are wanted
    ) -> torch.Tensor:
        cfg = self.cfg
        t = input_ids.shape[0]
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = F.embedding(input_ids, self.w.embed)
        cos, sin = self.rope.tables(positions)
        for i, lw in enumerate(self.w.layers):
            x = self._norm(h, lw.input_norm)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)
            qk = self.rope.apply(qkv[:, : self.qk_width].view(t, nh + nkv, hd), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, self.qk_width :].view(t, nkv, hd)
            kv_cache[:, i][md.slot_block, :, md.slot_offset] = torch.stack((k, v), dim=1)
            h = h + F.linear(paged_attention(q, k, v, kv_cache, i, md, self.kernels), lw.o)
            gate, up = F.linear(self._norm(h, lw.post_norm), lw.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, lw.down)
        x = self._norm(h[sample_idx], self.w.norm)
        return F.linear(x, self.w.lm_head).float()
