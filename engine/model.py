"""The Llama-family forward pass over a flat batch of tokens and the paged KV pool.

Written as plain functions over fused weights (one GEMM for q/k/v, one for gate/up) rather
than nn.Modules: per-op Python overhead adds up over 30 layers at small batch sizes.
The math follows transformers' Llama/Qwen2/Mistral exactly (RMSNorm, rotate-half RoPE, SwiGLU,
SDPA attention), which is what makes greedy output token-identical in fp32.

On the CPU, with the native kernels (engine/kernels/), each layer is: qkv GEMM → `rope_store`
(rotary in place + K/V into the pool) → `paged_attention` → o GEMM → residual add + norm →
gate/up GEMM → SiLU·up → down GEMM → residual add + the next layer's norm. In bf16 the norms,
SiLU·up and every token's attention are kernels and GEMMs use the project's bf16 GEMM or
oneDNN-prepacked weights (engine/linear.py), or weight-only int8/int4 kernels when the weights are
quantized (engine/qlinear.py). fp32 engines run their norms and SiLU·up on fp32 kernels
(transformers' arithmetic up to the order of a sum) and prefill attention on SDPA except where the
AVX2 prefill kernel runs (`prefill_on_kernels`).
In bf16 the residual stream h is kept in fp32 (`res_norm_f32`: each layer's bf16 output is
added to it in fp32, each norm reads it in fp32 and rounds its output once to bf16 for the
GEMMs), and the final norm's output stays fp32 for the head: a bf16 residual stream
moved "What is the capital of France?" onto "L'Étoile…" (logits of "L" and "The" within 0.06;
fp32 and transformers' bf16 both say "The capital… Paris"). The logits are fp32 in every dtype
(engine/logits_head.py).
Without kernels, the same steps run as torch ops. A decode step (every linear on the kernels:
quantized, bf16 on linear_bf16.c, fp32 on linear_f32.c at few rows) runs the layer loop in one C
call instead (engine/decode_plan.py, kernels/decode_layers.c: the same kernels in the same order,
bitwise the same result), since a single-stream step of a small model is memory-bound and ~9
Python calls a layer are a fixed cost the GEMVs do not hide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.cpu import cpu_flags
from engine.decode_plan import DecodePlan
from engine.kernel_step import KernelStep
from engine.kernels import kernels_lib
from engine.linear import Linear
from engine.logits_head import LogitsHead
from engine.model_config import ModelConfig
from engine.qlinear import QLinear, make_linear
from engine.rope import Rope
from engine.weights import ModelWeights


def prefill_on_kernels(dtype: torch.dtype) -> bool:
    """Whether prefill attention runs on the kernels (else SDPA, transformers' own arithmetic).
    The blocked prefill kernels are AVX-512 BF16 ones (bf16; AMX tiles where the CPU has them:
    prefill_attention_amx.c) and AVX2 ones (fp32 and bf16, on CPUs without AVX-512). Elsewhere
    prefill_attention runs the per-token loop, slower than SDPA (1024-token bf16 prefill on an AVX2
    Zen 3 before its AVX2 path: 28.3 vs 26.1 s). The AVX2 kernel against SDPA, SmolLM2's shape, a
    512-token prompt, one thread of a Zen 3: fp32 14.4 vs 31.8 ms a layer, bf16 9.8 vs 38.8."""
    flags = cpu_flags()
    if dtype == torch.bfloat16 and "avx512_bf16" in flags:
        return True
    return {"avx2", "fma"} <= flags and "avx512f" not in flags


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear | QLinear
    o: Linear | QLinear
    post_norm: torch.Tensor
    gate_up: Linear | QLinear
    down: Linear | QLinear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        rope: Rope,
        device: torch.device,
        act_int8: bool = False,
        act_groups: dict[str, int] | None = None,
    ) -> None:
        self.cfg = cfg
        dtype = weights.embed.dtype
        usable = (
            device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and cfg.head_dim % 2 == 0
            and cfg.num_heads // cfg.num_kv_heads <= 64
        )
        #: None: every step on torch ops (what the flags below derive from, so a test may set
        #: it to None on a built model and get the torch path whole)
        self.kernels = kernels_lib() if usable else None
        #: an int8 KV pool (engine/kv_quant.py::kv_int8_pool): a prefill chunk with no cached prefix
        #: attends on SDPA to its own unquantized K/V (engine/attention.py)
        self.kv_int8 = False
        #: bf16 engines keep the residual stream in fp32 (see the module docstring)
        self.res32 = dtype == torch.bfloat16
        self.dtype = dtype
        self._prefill_isa = prefill_on_kernels(dtype)
        a8 = act_int8  # W8A8 linears (engine/qlinear.py); the lm_head stays weight-only
        grp = (
            act_groups or {}
        )  # inputs per activation scale, by linear (engine/quant.py::ACT_GROUPS)
        self.layers = [
            Layer(
                lw.input_norm,
                make_linear(lw.qkv, lw.qkv_bias, a8, grp.get("qkv", 0)),
                make_linear(lw.o, None, a8, grp.get("o", 0)),
                lw.post_norm,
                make_linear(lw.gate_up, None, a8, grp.get("gate_up", 0)),
                make_linear(lw.down, None, a8, grp.get("down", 0)),
                lw.q_norm,
                lw.k_norm,
            )
            for lw in weights.layers
        ]
        weights.layers = []  # prepacked copies replace the plain weights
        self.embed = weights.embed
        self.norm = weights.norm
        self.lm_head = LogitsHead(weights.lm_head)
        self.rope = rope
        self.eps = cfg.rms_norm_eps
        self.hidden = (cfg.hidden_size,)
        self.inter = cfg.intermediate_size
        #: pure-decode steps of a quantized bf16 model run their layers in one C call (None: the
        #: Python loop always; engine/decode_plan.py says when it applies)
        self.decode_plan = DecodePlan.build(
            self.kernels, self.layers, dtype, cfg.hidden_size, self.inter, self.eps
        )

    @property
    def fused(self) -> bool:
        """bf16 norms and SiLU·up run on the kernels."""
        return self.kernels is not None and self.dtype == torch.bfloat16

    @property
    def fused32(self) -> bool:
        """fp32 norms and SiLU·up run on the kernels (fp32 engines)."""
        return self.kernels is not None and self.dtype == torch.float32

    @property
    def kernel_prefill(self) -> bool:
        """Prefill attention runs on the kernels (`prefill_on_kernels`)."""
        return self.kernels is not None and self._prefill_isa and not self.kv_int8

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one single-stream decode step reads: every layer's linears and norms,
        the final norm, the lm_head and one embedding row. A decode step of a model this small
        is bound by memory bandwidth, so bandwidth / this is its tokens/s ceiling
        (bench.engine_tiers' W2 roofline)."""
        norms = [
            self.norm,
            *(
                t
                for L in self.layers
                for t in (L.input_norm, L.post_norm, L.q_norm, L.k_norm)
                if t is not None
            ),
        ]
        linears = sum(f.decode_bytes for L in self.layers for f in (L.qkv, L.o, L.gate_up, L.down))
        row = self.embed.shape[1] * self.embed.element_size()
        return linears + sum(t.nbytes for t in norms) + self.lm_head.decode_bytes + row

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, final: bool = False) -> torch.Tensor:
        """RMSNorm(x) * weight in the engine dtype, or in fp32 for the final norm of an fp32
        residual stream (it feeds the fp32 logits head)."""
        if x.dtype == torch.float32 and self.res32:
            return self._res_norm(x, None, weight, final)
        if self.fused32:
            return self._norm32(x, None, weight)
        if self.fused:
            assert self.kernels is not None  # fused: the kernels are loaded
            out = torch.empty_like(x)
            self.kernels.rms_norm_bf16(
                x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], self.eps
            )
            return out
        return F.rms_norm(x, self.hidden, weight, self.eps)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """h += delta (the residual stream, in place); returns RMSNorm(h) * weight."""
        if self.res32:
            return self._res_norm(h, delta, weight, False)
        if self.fused32:
            return self._norm32(h, delta, weight)
        if self.fused:
            assert self.kernels is not None  # fused: the kernels are loaded
            out = torch.empty_like(h)
            self.kernels.add_rms_norm_bf16(
                h.data_ptr(),
                delta.data_ptr(),
                weight.data_ptr(),
                out.data_ptr(),
                h.shape[0],
                h.shape[1],
                self.eps,
            )
            return out
        h += delta
        return F.rms_norm(h, self.hidden, weight, self.eps)

    def _norm32(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        """fp32 engines: h (+= delta, in place), normed, on the kernel (add_rms_norm_f32)."""
        assert self.kernels is not None  # fused32: the kernels are loaded
        out = torch.empty_like(h)
        self.kernels.add_rms_norm_f32(
            h.data_ptr(),
            0 if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            h.shape[0],
            h.shape[1],
            self.eps,
        )
        return out

    def _res_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, final: bool
    ) -> torch.Tensor:
        """The fp32 residual stream h (+= delta, in place), normed: (h * inv_rms) * weight, rounded
        once to the engine dtype (fp32 when `final`)."""
        out = torch.empty(h.shape, dtype=torch.float32 if final else self.dtype)
        if self.fused:
            assert self.kernels is not None  # fused: the kernels are loaded
            self.kernels.res_norm_f32(
                h.data_ptr(),
                0 if delta is None else delta.data_ptr(),
                weight.data_ptr(),
                out.data_ptr(),
                h.shape[0],
                h.shape[1],
                self.eps,
                int(final),
            )
            return out
        if delta is not None:
            h += delta
        out.copy_(F.rms_norm(h, self.hidden, weight.float(), self.eps))
        return out

    def _qk_norm(self, qkv: torch.Tensor, layer: Layer) -> None:
        """Qwen3: RMSNorm over each head of q and of k, in place in the qkv rows, before the
        rotary embedding reads them (as transformers: in fp32, the weight applied after)."""
        t, d = qkv.shape[0], self.cfg.head_dim
        nq, nk = self.cfg.num_heads * d, self.cfg.num_kv_heads * d
        for part, w in ((qkv[:, :nq], layer.q_norm), (qkv[:, nq : nq + nk], layer.k_norm)):
            heads = part.view(t, -1, d)
            normed = F.rms_norm(heads.float(), (d,), None, self.eps).to(qkv.dtype)
            assert w is not None  # Qwen3 has both norms (_qk_norm runs where q_norm is set)
            heads.copy_(normed * w)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused or self.fused32:
            assert self.kernels is not None  # fused, fused32: the kernels are loaded
            out = torch.empty((gate_up.shape[0], self.inter), dtype=gate_up.dtype)
            fn = self.kernels.silu_mul_bf16 if self.fused else self.kernels.silu_mul_f32
            fn(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], self.inter)
            return out
        return F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_blocks, layers, 2, block_size, KVH, D]
        md: AttentionMetadata,
        sample_idx: torch.Tensor,  # [S] rows of the step whose logits are wanted
    ) -> torch.Tensor:
        x = self.hidden_states(input_ids, kv_cache, md, sample_idx)
        return self.lm_head(x)  # fp32 logits in every dtype (engine/logits_head.py)

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states (after the final norm) of `rows` of the step (None: every
        token): what the logits head reads, and what embeddings pool (engine/embed.py); fp32 in
        fp32 and bf16 engines."""
        lib = self.kernels
        ptr = 0
        step = None
        cos = sin = None
        if lib is not None:
            step = KernelStep(
                kv_cache,
                md.block_tables,
                md.token_row,
                md.ctx_lens,
                md.positions,
                md.slot_block,
                md.slot_offset,
                self.rope.cos,
                self.rope.sin,
                self.cfg.num_heads,
                md.max_ctx,
                md.sliding_window,
            )
            ptr = step.ptr
        else:
            cos, sin = self.rope.tables(md.positions)
        nh, layers = self.cfg.num_heads, self.layers
        h = F.embedding(input_ids, self.embed)
        if self.res32:
            h = h.float()
        x = self._norm(h, layers[0].input_norm)
        plan = self.decode_plan if step is not None else None
        if plan is not None and plan.applies(h.shape[0], md.num_decode, self.kernel_prefill):
            plan.run(ptr, h, x, md.num_decode)  # the loop below, in C: bitwise the same h
            layers = []
        for i, layer in enumerate(layers):
            qkv = layer.qkv(x)
            if layer.q_norm is not None:
                self._qk_norm(qkv, layer)
            if lib is not None:
                lib.rope_store(ptr, i, qkv.data_ptr(), qkv.stride(0))
            else:
                assert cos is not None and sin is not None  # set where lib is None
                self.rope.store_torch(qkv, nh, kv_cache, i, md.slot_block, md.slot_offset, cos, sin)
            attn = paged_attention(qkv, nh, kv_cache, i, md, lib, ptr, self.kernel_prefill)
            x = self._add_norm(h, layer.o(attn), layer.post_norm)
            down = layer.down(self._silu_mul(layer.gate_up(x)))
            if i + 1 < len(layers):
                x = self._add_norm(h, down, layers[i + 1].input_norm)
            else:
                h += down
        del step  # the kernels are done with the step's tensors
        return self._norm(h if rows is None else h[rows], self.norm, final=True)
