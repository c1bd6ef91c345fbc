"""QLinear: a linear layer over a weight-only quantized matrix (engine/quant.py).

On the CPU with the native kernels (bf16 or fp32 activations) it calls `qlinear_int8` /
`qlinear_int4`, which read the packed weights directly (decode) or dequantize 16 rows at a time
into a cached tile (batches, prefill). Elsewhere (CUDA, no compiler, DUET_DISABLE_KERNELS) it
dequantizes a tile of output rows at a time with torch and runs F.linear on it, so no full
dequantized copy of the matrix ever exists.

Invariant: both paths compute x @ dequantize(w)^T (+ bias) with fp32 accumulation on the CPU;
the result is rounded once to the activation dtype. With CI=true a missing kernel library is an
error, not a silent torch fallback (DESIGN §6), unless DUET_DISABLE_KERNELS asks for torch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.kernels import kernels_lib
from engine.linear import Linear
from engine.quant import QuantizedWeight, dequantize

#: output rows dequantized per torch tile: ~4-16 MiB of fp32 for common hidden sizes
_TILE_ROWS = 2048


class QLinear:
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = weight.out_features
        self.in_features = weight.in_features
        dev = weight.q.device
        self.lib = kernels_lib() if dev.type == "cpu" else None
        strict = os.environ.get("CI", "").lower() == "true" and not os.environ.get("DUET_DISABLE_KERNELS")
        if self.lib is None and dev.type == "cpu" and strict:
            raise RuntimeError("quantized linears need the native kernels under CI=true (no silent torch fallback)")
        w = weight
        self._args = ((w.q.data_ptr(), w.scales.data_ptr()) if w.scheme == "int8"
                      else (w.q.data_ptr(), w.scales.data_ptr(), w.mins.data_ptr(), w.group))  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is not None and x.dtype in (torch.bfloat16, torch.float32):
            return self._kernel(x)
        return self._torch(x)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        if k != self.in_features:
            raise ValueError(f"input has {k} features, the layer expects {self.in_features}")
        out = torch.empty((m, self.out_features), dtype=x.dtype)
        if m == 0:
            return out
        bf16 = int(x.dtype == torch.bfloat16)
        bias = 0 if self.bias is None else self.bias.data_ptr()
        if self.weight.scheme == "int8":
            rc = self.lib.qlinear_int8(x.data_ptr(), x.stride(0), m, k, *self._args, self.out_features, bias,
                                       out.data_ptr(), out.stride(0), bf16)  # fmt: skip
        else:
            rc = self.lib.qlinear_int4(x.data_ptr(), x.stride(0), m, k, *self._args, self.out_features, bias,
                                       out.data_ptr(), out.stride(0), bf16)  # fmt: skip
        if rc != 0:
            raise MemoryError(f"quantized linear kernel failed ({rc}) for a [{m}, {k}] input")
        return out

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        # CPU: fp32 math, one rounding (what the kernels do); CUDA: the activation dtype's GEMM.
        cdt = torch.float32 if x.device.type == "cpu" else x.dtype
        xc = x.to(cdt)
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        for r0 in range(0, n, _TILE_ROWS):
            rows = slice(r0, min(n, r0 + _TILE_ROWS))
            w = dequantize(self.weight, rows).to(cdt)
            b = None if self.bias is None else self.bias[rows].to(cdt)
            out[..., rows] = F.linear(xc, w, b).to(x.dtype)
        return out


def make_linear(weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> Linear | QLinear:
    """The layer for a plain (prepacked where possible) or a quantized weight."""
    if isinstance(weight, QuantizedWeight):
        return QLinear(weight, bias)
    return Linear(weight, bias)
