"""Linear layers: oneDNN-prepacked weights for bf16 on the CPU, plain F.linear otherwise.

A prepacked weight is reordered once into oneDNN's blocked layout, which skips the per-call
reorder F.linear pays: measured 2-3x faster at decode batch sizes (M=1: 70 vs 141 us for a
3072x576 weight; lm_head 2.3 vs 5.8 ms) and equal at prefill sizes. fp32 keeps F.linear, the
same kernel transformers calls, so fp32 greedy output stays token-identical to it.

Invariant: `Linear(x)` equals `F.linear(x, weight, bias)` up to bf16 rounding; when prepacking
fails or fails its self-check the layer stays on F.linear with one warning — except in strict
mode (CI=true, protocol/strict.py), where that is an error. A dtype or device prepacking does not
apply to (fp32, CUDA) is a choice, not a fallback; so is an x86 CPU that oneDNN's bf16 reorder
does not support (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only Zen 3 has neither),
where bf16 layers run F.linear, said once at info level.
"""

from __future__ import annotations

import functools
import logging
import platform

import torch
import torch.nn.functional as F

from engine.cpu import cpu_flags
from protocol.strict import fallback

log = logging.getLogger("duet.engine.linear")


#: what oneDNN's bf16 weight reorder needs on x86 (its own error message names these)
_BF16_REORDER_ISA = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))


@functools.cache
def cpu_can_prepack_bf16() -> bool:
    """False on an x86 CPU without the ISA oneDNN's bf16 reorder needs (there it always fails:
    a property of the CPU, not a broken install). Other architectures: attempted, and checked."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return True
    flags = cpu_flags()
    if any(need <= flags for need in _BF16_REORDER_ISA):
        return True
    log.info("bf16 linear layers use F.linear: oneDNN's bf16 weight prepacking needs AVX-512 BW/VL/DQ or "
             "AVX-NE-CONVERT, which this CPU lacks")  # fmt: skip
    return False


def can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and cpu_can_prepack_bf16())  # fmt: skip


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True) -> None:
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.out_features = weight.shape[0]
        #: what a one-row call reads (oneDNN's packed copy is opaque: its padding is not counted)
        self.decode_bytes = weight.numel() * weight.element_size() + (0 if bias is None else bias.nbytes)
        if prepack and can_prepack(weight):
            self.packed = self._pack(weight, bias)
            if self.packed is not None:
                self.weight = None  # the packed copy replaces it (the caller may still hold it)

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=32)
            x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            want = F.linear(x, weight, bias)
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                raise RuntimeError("prepacked linear disagrees with F.linear")
        except RuntimeError as e:
            fallback(log, f"oneDNN weight prepacking failed ({e})", "F.linear")  # raises in strict mode
            return None
        return packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
