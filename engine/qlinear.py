"""QLinear: a linear layer over a quantized matrix (engine/quant.py), weight-only or W8A8.

On the CPU with the native kernels (bf16 or fp32 activations) it calls `qlinear_int8` /
`qlinear_int4`, which read the packed weights directly (decode; int8 also for batches of up to
64 rows, each converted chunk shared by 8 activation rows) or dequantize 16 rows at a time into a
cached fp32 tile (larger batches). bf16 batches of `BF16_GEMM_MIN_ROWS` rows or more
(prefill, batched decode) take `qlinear_int8_bf16` / `qlinear_int4_bf16` instead where the CPU
has AMX or AVX-512 BF16: weight panels dequantized to bf16 in cache and the bf16 GEMM of the
bf16 model (engine/kernels/qgemm_bf16.h), so the cost is that GEMM plus one O(n k) dequant
amortized over the rows; activations stay bf16 (weight-only arithmetic). On AVX2 CPUs batches of
that many rows, bf16 or fp32, take the fp32 panel GEMM the bf16 weights use there
(engine/kernels/qgemm_f32.h: weights dequantized exactly, fp32 sums). Elsewhere (CUDA, no compiler,
DUET_DISABLE_KERNELS) it dequantizes a tile of output rows at a time with torch and runs F.linear on
it, so no full dequantized copy of the matrix ever exists.

With `act_int8` (the int8-w8a8 / int4-w4a8 schemes) the activations are quantized per token
to int8 and the GEMM sums int8 products in int32 (`qlinear_w8a8`: AMX, VNNI or portable; torch:
`w8a8_reference`, the same bits) over the weight's int8 form (`int8_for_gemm`), packed once into
the kernels' blocked layout; a linear in the scheme's `ACT_GROUPS` has one activation scale per
group of inputs instead of one per token. int4-w4a8 keeps its packed int4 for one-row calls
(single-stream decode reads half the bytes, weight-only) and the int8 form for batches and prefill.

Invariant: the weight-only paths compute x @ dequantize(w)^T (+ bias) with fp32 accumulation on
the CPU (the bf16 GEMM path: int8 q exact and the scale in fp32, int4 weights rounded to bf16;
within bf16 tolerance of the others, `bf16_gemm_reference`), the W8A8 paths w8a8_reference; the
result is rounded once to the activation dtype. Below BF16_GEMM_MIN_ROWS every path is bitwise
equal to the one-row GEMV, so small decode batches and speculative verification (k + 1 rows)
compute a sequence's tokens exactly as single-stream decode does. With CI=true a missing kernel
library is an error, never a silent torch fallback (DESIGN §6); DUET_DISABLE_KERNELS picks torch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.kernels import kernels_lib
from engine.linear import Linear
from engine.quant import QuantizedWeight, dequantize, int8_for_gemm, pack_w8a8, w8a8_reference

#: output rows dequantized per torch tile: ~4-16 MiB of fp32 for common hidden sizes
_TILE_ROWS = 2048

#: bf16 activation rows from which the weight-only linears take the bf16 GEMM path. Measured
#: crossover against the fp32 tile path (AMX, 1 thread, SmolLM2's shapes): ~4 rows for int8,
#: ~8 for int4; 16 keeps every batch a speculative verification or a small decode step makes
#: on the path that is bitwise equal to single-stream decode.
BF16_GEMM_MIN_ROWS = 16


#: qgemm_bf16_isa()'s value for AVX2's GEMM path (engine/kernels/qgemm_f32.h): fp32 weight panels,
#: bf16 or fp32 activations; qlinear_int8 / qlinear_int4 take it themselves from
#: BF16_GEMM_MIN_ROWS rows whatever the activations' dtype
GEMM_AVX2 = 3


def bf16_gemm_isa() -> int:
    """The GEMM path the kernels run on this CPU: 2 AMX, 1 AVX-512 BF16, 3 AVX2's fp32 panels, 0
    none (no kernels, or a CPU with neither: batches keep the fp32 tile path)."""
    lib = kernels_lib()
    return 0 if lib is None else int(lib.qgemm_bf16_isa())


def bf16_gemm_reference(
    x: torch.Tensor,
    qw: QuantizedWeight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    isa: int | None = None,
) -> torch.Tensor:
    """The bf16 GEMM path's arithmetic in torch: bf16 x times the weight as the panel holds it
    (int8: q, exact; int4: dequantized and rounded to bf16, or exact in AVX2's fp32 panels), fp32
    sums, the int8 scale and the bias in fp32, one rounding. Equal to the kernels up to the order
    of the fp32 sums. `isa` names the path whose panels are meant (by default the one this
    process's kernels take): a build for another CPU keeps int4 weights as that CPU's path does."""
    xf = x.to(torch.bfloat16).float()
    if qw.scheme == "int8":
        out = (xf @ qw.q.float().T) * qw.scales
    elif (bf16_gemm_isa() if isa is None else isa) == GEMM_AVX2:
        out = xf @ dequantize(qw).T
    else:
        out = xf @ dequantize(qw).to(torch.bfloat16).float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype)


class QLinear:
    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        act_int8: bool = False,
        act_group: int = 0,
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = weight.out_features
        self.in_features = weight.in_features
        dev = weight.q.device
        self.lib = kernels_lib() if dev.type == "cpu" else None
        strict = os.environ.get("CI", "").lower() == "true" and not os.environ.get(
            "DUET_DISABLE_KERNELS"
        )
        if self.lib is None and dev.type == "cpu" and strict:
            raise RuntimeError(
                "quantized linears need the native kernels under CI=true (no silent torch fallback)"
            )
        w = weight
        self._args = (
            (w.q.data_ptr(), w.scales.data_ptr())
            if w.scheme == "int8"
            else (w.q.data_ptr(), w.scales.data_ptr(), w.int4_mins.data_ptr(), w.group)
        )
        self.w8: QuantizedWeight | None = None
        #: inputs per activation scale of the W8A8 GEMM (0: one scale per token;
        #: engine/quant.py::ACT_GROUPS)
        self.act_group = act_group if act_int8 else 0
        if act_int8:
            self.w8 = int8_for_gemm(weight)
            self._packed, self._wsum = pack_w8a8(self.w8.q.cpu(), self.act_group)
            #: the W8A8 kernel's weight arguments (packed int8, scales, wsum), as qlinear_w8a8
            #: and decode_layers take them
            self.w8_args = (
                self._packed.data_ptr(),
                self.w8.scales.data_ptr(),
                self._wsum.data_ptr(),
            )
        #: one-row calls of int4-w4a8 keep the int4 weight-only GEMV
        self.gemv_weight_only = act_int8 and weight.scheme != "int8"
        #: the GEMM path the kernels have (bf16_gemm_isa; 0 without kernels)
        self.gemm_isa = 0 if self.lib is None else int(self.lib.qgemm_bf16_isa())
        #: bf16 batches of at least this many rows take the bf16 GEMM path (0: never, no such path)
        self.bf16_min_rows = BF16_GEMM_MIN_ROWS if self.gemm_isa > 0 else 0
        #: fp32 batches of bf16_min_rows rows or more leave the GEMV's arithmetic too (AVX2)
        self.gemm_fp32 = self.gemm_isa == GEMM_AVX2
        #: what a one-row call (single-stream decode) reads: the W8A8 packing, or the packed weight
        one_row = (
            [self._packed, self.w8.scales, self._wsum]
            if self.w8 is not None and not self.gemv_weight_only
            else [t for t in (weight.q, weight.scales, weight.mins) if t is not None]
        )
        self.decode_bytes = sum(t.nbytes for t in one_row) + (0 if bias is None else bias.nbytes)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W^T (+ bias), in x's dtype or in `out_dtype` (torch.float32 for the logits: the
        fp32 accumulator stored without rounding to bf16)."""
        if self.lib is not None and x.dtype in (torch.bfloat16, torch.float32):
            return self._kernel(x, out_dtype or x.dtype)
        return self._torch(x, out_dtype or x.dtype)

    def _kernel(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        assert self.lib is not None  # __call__ comes here only with the kernels
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        if k != self.in_features:
            raise ValueError(f"input has {k} features, the layer expects {self.in_features}")
        out_f32 = int(out_dtype == torch.float32 and x.dtype != torch.float32)
        if out_f32 and self.bias is not None:
            raise ValueError("an fp32 output of a bf16 layer is for bias-free layers (the lm_head)")
        out = torch.empty((m, self.out_features), dtype=torch.float32 if out_f32 else x.dtype)
        if m == 0:
            return out
        bf16 = int(x.dtype == torch.bfloat16)
        bias = 0 if self.bias is None else self.bias.data_ptr()
        if self.w8 is not None and not (m == 1 and self.gemv_weight_only):
            rc = self.lib.qlinear_w8a8(
                x.data_ptr(),
                x.stride(0),
                m,
                k,
                *self.w8_args,
                self.out_features,
                bias,
                out.data_ptr(),
                out.stride(0),
                bf16,
                out_f32,
                self.act_group,
            )
        elif bf16 and 0 < self.bf16_min_rows <= m:
            rc = self._bf16_gemm(x, m, k, bias, out, out_f32)
        elif self.weight.scheme == "int8":
            rc = self.lib.qlinear_int8(
                x.data_ptr(),
                x.stride(0),
                m,
                k,
                *self._args,
                self.out_features,
                bias,
                out.data_ptr(),
                out.stride(0),
                bf16,
                out_f32,
            )
        else:
            rc = self.lib.qlinear_int4(
                x.data_ptr(),
                x.stride(0),
                m,
                k,
                *self._args,
                self.out_features,
                bias,
                out.data_ptr(),
                out.stride(0),
                bf16,
                out_f32,
            )
        if rc != 0:
            raise MemoryError(f"quantized linear kernel failed ({rc}) for a [{m}, {k}] input")
        return out

    def _bf16_gemm(
        self,
        x: torch.Tensor,
        m: int,
        k: int,
        bias: int,
        out: torch.Tensor,
        out_f32: int,
        isa: int = 0,
    ) -> int:
        """The bf16 GEMM path (isa 0: the best this CPU has; 1 / 2 force AVX-512 BF16 / AMX)."""
        assert self.lib is not None  # only QLinears on the kernels have a bf16 GEMM path
        fn = (
            self.lib.qlinear_int8_bf16
            if self.weight.scheme == "int8"
            else self.lib.qlinear_int4_bf16
        )
        return fn(
            x.data_ptr(),
            x.stride(0),
            m,
            k,
            *self._args,
            self.out_features,
            bias,
            out.data_ptr(),
            out.stride(0),
            out_f32,
            isa,
        )

    def _torch(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        n = self.out_features
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        if self.w8 is not None and not (rows == 1 and self.gemv_weight_only):
            return w8a8_reference(x, self.w8, self.bias, out_dtype, self.act_group)
        # CPU: fp32 math, one rounding (what the kernels do); CUDA: the activation dtype's GEMM.
        cdt = torch.float32 if x.device.type == "cpu" or out_dtype == torch.float32 else x.dtype
        xc = x.to(cdt)
        out = torch.empty((*x.shape[:-1], n), dtype=out_dtype, device=x.device)
        for r0 in range(0, n, _TILE_ROWS):
            tile = slice(r0, min(n, r0 + _TILE_ROWS))
            w = dequantize(self.weight, tile).to(cdt)
            b = None if self.bias is None else self.bias[tile].to(cdt)
            out[..., tile] = F.linear(xc, w, b).to(out_dtype)
        return out


def make_linear(
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    act_int8: bool = False,
    act_group: int = 0,
) -> Linear | QLinear:
    """The layer for a plain (prepacked where possible) or a quantized weight (W8A8 with act_int8,
    `act_group` inputs per activation scale)."""
    if isinstance(weight, QuantizedWeight):
        return QLinear(weight, bias, act_int8, act_group)
    return Linear(weight, bias)
