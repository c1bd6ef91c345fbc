"""LogitsHead: the lm_head, producing fp32 logits whatever the engine dtype.

A bf16 lm_head that rounds its output to bf16 keeps 8 bits of mantissa: logits a few hundredths
apart tie, and the tie goes to the lower token id (SmolLM2 bf16: "What is the capital of France?"
answered "L'Étoile…" because "The" and "L" both came out as -1.8766; in fp32 they are -1.883
and -1.965). vLLM's sampler works on fp32 logits; so does ours: every product of two bf16 values
is exact in fp32 and the sums accumulate in fp32, so the logits carry no bf16 rounding at all.

Paths: a bf16 weight on the CPU with the native kernels → `logits_bf16` (AMX tiles where the CPU
has them, else vdpbf16ps where it has avx512_bf16, or its two FMAs on AVX2); a quantized weight →
its QLinear kernel storing the fp32 accumulator (a batch of BF16_GEMM_MIN_ROWS rows or more: its
bf16 GEMM path over the input's two bf16 halves, below); an fp32
engine → F.linear as before (the transformers-parity path). Elsewhere (CUDA, no kernels) the
weight is converted to fp32 a tile of rows at a time, so no fp32 copy of the matrix exists.

An fp32 input (bf16 engines feed the final norm's fp32 output: engine/model.py) meets a bf16
weight as two bf16 halves, x = hi + lo with hi = bf16(x) and lo = bf16(x - hi) (x to 2^-17
relative): both go through one `logits_bf16` call as 2m rows, so each weight block is read once
for both, and the logits are the two fp32 sums added.

Invariant: the output is fp32 [rows, vocab]; the decode (1 row) and batched kernel paths agree
bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import kernels_lib
from engine.qlinear import QLinear
from engine.quant import QuantizedWeight

#: vocabulary rows converted per fp32 tile on the torch path (~9 MiB at hidden size 576)
_TILE_ROWS = 4096


def _halves(x: torch.Tensor) -> torch.Tensor:
    """fp32 x [m, k] as 2m bf16 rows: hi = bf16(x), then lo = bf16(x - hi) (module docstring)."""
    hi = x.bfloat16()
    return torch.cat([hi, (x - hi.float()).bfloat16()])


def _joined(out: torch.Tensor, m: int) -> torch.Tensor:
    """The logits of `_halves`' 2m rows added back into m rows."""
    return out[:m] + out[m:]


class LogitsHead:
    def __init__(self, weight: torch.Tensor | QuantizedWeight) -> None:
        self.q = QLinear(weight) if isinstance(weight, QuantizedWeight) else None
        self.weight = None if isinstance(weight, QuantizedWeight) else weight.contiguous()
        self.out_features = (
            weight.out_features if isinstance(weight, QuantizedWeight) else weight.shape[0]
        )
        dev = weight.q.device if isinstance(weight, QuantizedWeight) else weight.device
        bf16 = self.weight is not None and self.weight.dtype == torch.bfloat16
        self.lib = kernels_lib() if (bf16 and dev.type == "cpu") else None
        #: what one row of logits reads of the weight
        self.decode_bytes = self.q.decode_bytes if self.q is not None else weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.q is not None:
            q = self.q
            if (
                x.dtype == torch.float32
                and q.w8 is None
                and q.weight.scheme == "int8"
                and 0 < q.bf16_min_rows <= x.shape[0]
                and not q.gemm_fp32  # AVX2's GEMM takes fp32 rows as they are
            ):
                # a batch: the bf16 GEMM path (AMX / AVX-512 BF16; int8 q is exact in bf16) over
                # fp32 x's two bf16 halves, as below, instead of the fp32 tile path (32 rows of
                # SmolLM2's int8 head: 10.6 -> 5.0 ms at 2 threads, AMX). Not for int4, whose bf16
                # GEMM path rounds the dequantized weights to bf16.
                return _joined(q(_halves(x), torch.float32), x.shape[0])
            return q(x, torch.float32)
        w = self.weight
        assert w is not None  # a head holds its QLinear or its weight
        if w.dtype == torch.float32:
            return F.linear(x.float(), w)
        if self.lib is not None and x.dtype in (torch.bfloat16, torch.float32):
            m = x.shape[0]
            if x.dtype == torch.float32:
                x = _halves(x)
            elif x.stride(-1) != 1:
                x = x.contiguous()
            out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
            if m:
                rc = self.lib.logits_bf16(
                    x.data_ptr(),
                    x.stride(0),
                    x.shape[0],
                    x.shape[1],
                    w.data_ptr(),
                    self.out_features,
                    out.data_ptr(),
                    out.stride(0),
                )
                if rc != 0:
                    raise MemoryError(f"logits_bf16 failed ({rc}) for {x.shape[0]} rows")
            return out if out.shape[0] == m else _joined(out, m)
        xf = x.float()
        out = torch.empty((*x.shape[:-1], self.out_features), dtype=torch.float32, device=x.device)
        for r0 in range(0, self.out_features, _TILE_ROWS):
            rows = slice(r0, min(self.out_features, r0 + _TILE_ROWS))
            out[..., rows] = F.linear(xf, w[rows].float())
        return out
