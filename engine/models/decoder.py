"""DecoderModel: the forward pass of the decoder families that are not Llama-shaped (Gemma 1/2/3,
the mixture-of-experts families), over a flat batch of tokens and the paged KV pool.

One loop covers them, each difference a setting of `DecoderSpec` or a part of `DecoderLayer`:
- sandwich norms (Gemma 2/3): the attention and MLP outputs are normed before the residual add,
  and the MLP input has a norm of its own (`pre_ff_norm`); otherwise (Gemma 1, MoE) the
  post-attention norm is the MLP input's, as in Llama;
- per-layer attention (Gemma 2/3): each layer is "full" or "sliding" (a window of
  `spec.window` keys), with a rotary table per kind (Gemma 3: a local base frequency for
  sliding layers); the KV pool keeps every layer's keys, so prefix caching and P/D transfer move
  whole blocks as for any model;
- query scaling `spec.query_scale` (Gemma: query_pre_attn_scalar^-½) and attention soft-capping
  (Gemma 2: tanh(s / cap) · cap over the scores, engine/models/softcap.py), scaled embeddings
  (Gemma: × √hidden, rounded to the weights' dtype as transformers does) and final-logit
  soft-capping;
- the MLP: a gated MLP (SiLU or tanh-GeLU) or a mixture of experts (engine/models/moe.py);
- norms whose weights the loader stored as (1 + w) where the checkpoint means that (Gemma).

Attention and the rotary embedding run on the CPU kernels where `LlamaModel` would (engine/
attention.py: one KernelStep per layer kind, which carries that kind's window and rotary
tables), except soft-capped layers, which run in torch; norms and activations run in torch. The
query scale is applied to q after the rotary embedding (q · s·√d, then the kernels' and SDPA's
own 1/√d), so every path shares it. In fp32 the arithmetic follows transformers' (norms in
fp32, softmax in fp32), which is what the token-identity tests check; in bf16 the residual
stream stays fp32, as in LlamaModel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.cpu import cpu_flags
from engine.kernel_step import KernelStep
from engine.kernels import kernels_lib
from engine.linear import Linear
from engine.logits_head import LogitsHead
from engine.qlinear import QLinear
from engine.rope import Rope

LinearLike = Linear | QLinear
FULL, SLIDING = "full", "sliding"
_ACTS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class DecoderSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    eps: float
    #: each layer's attention kind (FULL or SLIDING)
    layer_kinds: tuple[str, ...]
    #: keys a SLIDING layer sees (FULL layers see the whole context, or the model-wide window
    #: the step's metadata carries)
    window: int | None = None
    #: multiplies q·k instead of 1/√head_dim
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float | None = None
    #: sandwich norms (Gemma 2/3): see the module docstring
    sandwich: bool = False


class GatedMLP:
    """down(act(gate) · up), gate and up fused in one linear (gate rows first)."""

    def __init__(self, gate_up: LinearLike, down: LinearLike, act: str) -> None:
        self.gate_up, self.down, self.act = gate_up, down, _ACTS[act]
        self.inter = down.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        return self.down(self.act(gu[:, : self.inter]) * gu[:, self.inter :])

    @property
    def decode_bytes(self) -> int:
        return self.gate_up.decode_bytes + self.down.decode_bytes


class MLPBlock(Protocol):
    """A layer's MLP, x [T, hidden] -> [T, hidden]: GatedMLP, or MoE (engine/models/moe.py)."""

    @property
    def decode_bytes(self) -> int: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: LinearLike
    o: LinearLike
    #: sandwich: the attention output's norm; else the MLP input's (Llama's post-attention norm)
    post_attn_norm: torch.Tensor
    mlp: MLPBlock
    kind: str = FULL
    pre_ff_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class _Kind:
    """One step's view for the layers of one attention kind."""

    md: AttentionMetadata
    rope: Rope
    #: the kernels' step (its window and rotary tables), or None on the torch path
    step: KernelStep | None
    #: the step's rotary rows (torch path only)
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class DecoderModel:
    def __init__(
        self,
        spec: DecoderSpec,
        layers: list[DecoderLayer],
        embed: torch.Tensor,
        norm: torch.Tensor,
        lm_head: LogitsHead,
        ropes: dict[str, Rope],
    ) -> None:
        self.spec = spec
        self.layers = layers
        self.embed, self.norm, self.lm_head, self.ropes = embed, norm, lm_head, ropes
        self.dtype = dtype = embed.dtype
        d = spec.head_dim
        usable = (
            embed.device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and d % 2 == 0
            and spec.num_heads // spec.num_kv_heads <= 64
        )
        self.kernels = kernels_lib() if usable else None
        #: an int8 KV pool (engine/kv_quant.py::kv_int8_pool): prefill chunks attend on SDPA
        self.kv_int8 = False
        self._prefill_isa = dtype == torch.bfloat16 and "avx512_bf16" in cpu_flags()
        self.res32 = dtype == torch.bfloat16
        #: q's factor so that the attention paths' own 1/√d gives spec.query_scale
        self.q_factor = 1.0 if spec.query_scale is None else spec.query_scale * math.sqrt(d)
        self.embed_scale = (
            None
            if spec.embed_scale is None
            else torch.tensor(spec.embed_scale, dtype=embed.dtype).item()
        )
        #: LlamaModel's attribute: a one-C-call decode loop (none here)
        self.decode_plan = None

    @property
    def kernel_prefill(self) -> bool:
        """Prefill attention runs on the kernels (bf16 with AVX-512 BF16, a float pool)."""
        return self.kernels is not None and self._prefill_isa and not self.kv_int8

    def decode_weight_bytes(self) -> int:
        """Bytes of weights a one-token decode step reads (every expert counted: an upper bound
        for a mixture of experts, which reads top_k of them per token)."""
        total = self.lm_head.decode_bytes + self.embed.shape[1] * self.embed.element_size()
        for L in self.layers:
            total += L.qkv.decode_bytes + L.o.decode_bytes + L.mlp.decode_bytes
        return total

    # -- pieces ----------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """RMSNorm(x) · w computed in fp32 (as every family here does), rounded to out_dtype
        (w None: F.rms_norm's, no scale)."""
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.spec.eps).to(out_dtype)

    def _qk_norm(self, qkv: torch.Tensor, layer: DecoderLayer) -> None:
        d, nh = self.spec.head_dim, self.spec.num_heads
        t = qkv.shape[0]
        nk = (qkv.shape[1] // d - nh) // 2
        for part, w in (
            (qkv[:, : nh * d], layer.q_norm),
            (qkv[:, nh * d : (nh + nk) * d], layer.k_norm),
        ):
            heads = part.view(t, -1, d)
            heads.copy_(self._rms(heads, w, qkv.dtype))

    def _kinds(self, kv_cache: torch.Tensor, md: AttentionMetadata) -> dict[str, _Kind]:
        """What the layers of each attention kind share in this step."""
        out = {}
        for kind in set(self.spec.layer_kinds):
            kmd = md if kind == FULL else replace(md, sliding_window=self.spec.window)
            rope = self.ropes.get(kind, self.ropes[FULL])
            step = cos = sin = None
            if self.kernels is None:
                cos, sin = rope.tables(kmd.positions)
            else:
                step = KernelStep(
                    kv_cache,
                    kmd.block_tables,
                    kmd.token_row,
                    kmd.ctx_lens,
                    kmd.positions,
                    kmd.slot_block,
                    kmd.slot_offset,
                    rope.cos,
                    rope.sin,
                    self.spec.num_heads,
                    kmd.max_ctx,
                    kmd.sliding_window,
                )
            out[kind] = _Kind(kmd, rope, step, cos, sin)
        return out

    def _attention(
        self,
        i: int,
        layer: DecoderLayer,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        kind: _Kind,
    ) -> torch.Tensor:
        md, step = kind.md, kind.step
        nh, d = self.spec.num_heads, self.spec.head_dim
        qkv = layer.qkv(x)
        if layer.q_norm is not None:
            self._qk_norm(qkv, layer)
        if step is not None:
            assert self.kernels is not None  # a kernel step is made only with the kernels
            self.kernels.rope_store(step.ptr, i, qkv.data_ptr(), qkv.stride(0))
        else:
            assert kind.cos is not None and kind.sin is not None  # the torch path's tables
            kind.rope.store_torch(
                qkv, nh, kv_cache, i, md.slot_block, md.slot_offset, kind.cos, kind.sin
            )
        if self.spec.attn_softcap is not None:
            from engine.models.softcap import softcap_attention

            scale = self.spec.query_scale or d**-0.5
            return softcap_attention(qkv, nh, kv_cache, i, md, scale, self.spec.attn_softcap)
        if self.q_factor != 1.0:
            qkv[:, : nh * d] *= self.q_factor
        lib = self.kernels if step is not None else None
        return paged_attention(
            qkv, nh, kv_cache, i, md, lib, 0 if step is None else step.ptr, self.kernel_prefill
        )

    # -- the forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        sample_idx: torch.Tensor,
    ) -> torch.Tensor:
        logits = self.lm_head(self.hidden_states(input_ids, kv_cache, md, sample_idx))
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final norm's output for `rows` of the step (None: every token), fp32."""
        dt = self.dtype
        kinds = self._kinds(kv_cache, md)
        h = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if self.res32:
            h = h.float()
        for i, L in enumerate(self.layers):
            attn = self._attention(i, L, self._rms(h, L.input_norm, dt), kv_cache, kinds[L.kind])
            out = L.o(attn)
            if self.spec.sandwich:
                h += self._rms(out, L.post_attn_norm, h.dtype)
                mlp = L.mlp(self._rms(h, L.pre_ff_norm, dt))
                h += self._rms(mlp, L.post_ff_norm, h.dtype)
            else:
                h += out.to(h.dtype)
                h += L.mlp(self._rms(h, L.post_attn_norm, dt)).to(h.dtype)
        del kinds  # the kernels are done with the steps' tensors
        return self._rms(h if rows is None else h[rows], self.norm, torch.float32)
