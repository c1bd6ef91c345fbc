"""Linear layers: bf16 on the project's own GEMM where the CPU has AVX-512 BF16 (AMX or not) or
AVX2 + FMA without AVX-512 (bf16 weights widened to fp32 in registers: half the bytes of fp32 to
stream, fp32 arithmetic), oneDNN-prepacked weights for bf16 on other CPUs that oneDNN's bf16
reorder supports, plain F.linear otherwise.

On CPUs with AVX-512 BF16 and the native kernels, a bf16 weight is packed once into the panel
layout of engine/kernels/linear_bf16.c and every call, whatever its row count, runs that one
kernel (AMX tiles where the CPU has them, else vdpbf16ps): a row's output is bitwise the same
whether it is computed alone (single-stream decode), in a decode batch, in a speculative
verification or in a prefill, which oneDNN, choosing its kernel by the row count, does not
promise (bf16 speculation was not greedy-identical on Zen 4/5 with oneDNN). Measured against
oneDNN's prepacked call on SmolLM2's shapes, 2 threads: AMX Xeon 1.3-2.4x at 1-32 rows, 0.8-1.2x
at 512; Zen 4 (vdpbf16ps) 1.2-2.0x at one row, 0.9-2.7x at 2-8, 0.8-1.6x at 16-128, 0.7-1.2x at
512 (a 512-token prefill's four linears together 0.98-1.01x). bench.engine_tiers measures the engine
(W2 is single-stream decode). `DUET_BF16_LINEAR=onednn` keeps oneDNN there (an A/B switch for
benchmarks, not a fallback).

A prepacked weight is reordered once into oneDNN's blocked layout, which skips the per-call
reorder F.linear pays: measured 2-3x faster at decode batch sizes (M=1: 70 vs 141 us for a
3072x576 weight; lm_head 2.3 vs 5.8 ms) and equal at prefill sizes. fp32 keeps F.linear, the
same kernel transformers calls, so fp32 greedy output stays token-identical to it.

Invariant: `Linear(x)` equals `F.linear(x, weight, bias)` up to bf16 rounding; when prepacking
fails or fails its self-check the layer stays on F.linear with one warning — except in strict
mode (CI=true, runtime/strict.py), where that is an error. A dtype or device prepacking does not
apply to (fp32, CUDA) is a choice, not a fallback; so is an x86 CPU that oneDNN's bf16 reorder
does not support (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only Zen 3 has neither),
where bf16 layers run linear_bf16.c's AVX2 path, or F.linear without the kernels (said once at
info level).
"""

from __future__ import annotations

import functools
import logging
import os
import platform

import torch
import torch.nn.functional as F

from engine.cpu import cpu_flags
from engine.kernels import kernels_lib
from runtime.strict import fallback

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
    log.info(
        "bf16 linear layers use F.linear: oneDNN's bf16 weight prepacking needs "
        "AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks"
    )
    return False


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and cpu_can_prepack_bf16()
    )


#: qgemm_bf16_isa()'s AVX2 path (engine/qlinear.py GEMM_AVX2): bf16 weights widened to fp32
AVX2_GEMM = 3


def bf16_linear_choice() -> str:
    """DUET_BF16_LINEAR, read when a layer is built: "own" (the project's GEMM wherever it has a
    path), "onednn" (oneDNN, or F.linear where the CPU has no oneDNN bf16 reorder: the A/B
    switch), or "" (the default: the own GEMM on AVX-512 BF16 and on AVX2 + FMA)."""
    return os.environ.get("DUET_BF16_LINEAR", "").strip().lower()


def avx2_bf16_layers() -> bool:
    """Whether bf16 layers take the AVX2 path on an AVX2 + FMA CPU without AVX-512: yes unless
    DUET_BF16_LINEAR=onednn (then F.linear: oneDNN has no bf16 reorder there). Against F.linear
    on the same bf16 weights, Zen 3, one thread: SmolLM2 single-stream decode 1.53x (the whole
    engine, bench.decode_ab), a layer's four linears 4.7x at 16 rows, 6.0x at 32, 8.3x at 512
    (F.linear has no bf16 arithmetic to use there); docs/benchmarks.md. SmolLM2's bf16 greedy
    output agrees with fp32 on 118 positions, transformers bf16 on 110 (test_logits_fp32)."""
    return bf16_linear_choice() != "onednn"


def own_kernel_lib(weight: torch.Tensor):
    """The kernel library when this bf16 CPU weight takes linear_bf16.c (a CPU with AVX-512 BF16,
    or with AVX2 + FMA and no AVX-512, the kernels built for it, not switched off by
    DUET_BF16_LINEAR=onednn), else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    if bf16_linear_choice() == "onednn":
        return None
    lib = kernels_lib()
    if lib is None:
        return None
    # the flags as well as the build's answer: the kernels are built with -march=native, so the two
    # agree on a real CPU, and tests that stand in another CPU's flags see its choice
    isa, flags = lib.qgemm_bf16_isa(), cpu_flags()
    if isa in (1, 2):
        return lib if "avx512_bf16" in flags else None
    ok = isa == AVX2_GEMM and avx2_bf16_layers() and {"avx2", "fma"} <= flags
    return lib if ok else None


#: fp32 layers take linear_f32.c below this many rows (decode steps: one pass over the weights,
#: bound by memory bandwidth, where the decode plan must compute what this layer does); larger
#: batches keep F.linear's GEMM
F32_KERNEL_MAX_ROWS = 16


def f32_kernel_lib(weight: torch.Tensor):
    """The kernel library when this fp32 CPU weight takes linear_f32.c at few rows, else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    return kernels_lib()


class Linear:
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True
    ) -> None:
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        #: linear_bf16.c's panels (int32 words) and the kernel library, on AVX-512 BF16 CPUs
        self.panels: torch.Tensor | None = None
        self.lib = None
        self.out_features, self.in_features = weight.shape[0], weight.shape[-1]
        #: the kernels, for an fp32 weight's few-row calls (linear_f32.c); None: F.linear always
        self.lib32 = None
        if (
            prepack
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and (lib32 := f32_kernel_lib(weight)) is not None
        ):
            self.weight, self.lib32 = weight.contiguous(), lib32
        lib = own_kernel_lib(weight) if prepack else None
        if lib is not None and (
            bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
        ):
            w = weight.contiguous()
            self.panels = torch.empty(lib.linear_bf16_packed_words(*w.shape), dtype=torch.int32)
            if (
                lib.linear_bf16_pack(w.data_ptr(), w.shape[0], w.shape[1], self.panels.data_ptr())
                != 0
            ):
                raise RuntimeError("linear_bf16_pack failed in a build that has AVX-512 BF16")
            self.lib, self.weight = (
                lib,
                None,
            )  # the panels replace the weight (the caller may still hold it)
        elif prepack and can_prepack(weight):
            self.packed = self._pack(weight, bias)
            if self.packed is not None:
                self.weight = None  # the packed copy replaces it (the caller may still hold it)
        #: what a one-row call reads: the panels (their padding included), else the weight's bytes
        #: (oneDNN's packed copy is opaque: its padding is not counted)
        read = (
            self.panels.nbytes
            if self.panels is not None
            else weight.numel() * weight.element_size()
        )
        self.decode_bytes = read + (0 if bias is None else bias.nbytes)

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=32)
            x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(
                weight.dtype
            )
            got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            want = F.linear(x, weight, bias)
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                raise RuntimeError("prepacked linear disagrees with F.linear")
        except RuntimeError as e:
            fallback(
                log, f"oneDNN weight prepacking failed ({e})", "F.linear"
            )  # raises in strict mode
            return None
        return packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.lib32 is not None
            and x.dtype == torch.float32
            and x.dim() == 2
            and 0 < x.shape[0] < F32_KERNEL_MAX_ROWS
        ):
            return self._own32(x)
        if self.panels is not None:
            assert self.lib is not None  # the panels come with the library that packed them
            if x.dtype == torch.float32 and self.lib.qgemm_bf16_isa() == AVX2_GEMM:
                return self._own(x)  # AVX2 widens the weights to fp32 anyway: fp32 rows as they are
            if x.dtype != torch.bfloat16:
                raise TypeError(f"a bf16 linear layer got {x.dtype} input")
            return self._own(x)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None  # neither panels nor a packed copy replaced it
        return F.linear(x, self.weight, self.bias)

    def _own32(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1 or x.stride(0) < self.in_features:
            x = x.contiguous()
        m = x.shape[0]
        out = torch.empty((m, self.out_features), dtype=torch.float32)
        assert self.lib32 is not None and self.weight is not None  # set together, fp32 only
        self.lib32.linear_f32(
            x.data_ptr(),
            x.stride(0),
            m,
            self.in_features,
            self.weight.data_ptr(),
            self.out_features,
            None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(),
            self.out_features,
        )
        return out

    def _own(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1 or x2.stride(0) < self.in_features:
            x2 = x2.contiguous()
        m = x2.shape[0]
        out = torch.empty((m, self.out_features), dtype=x2.dtype)
        assert self.lib is not None and self.panels is not None  # _own runs on the panels
        if m and x2.dtype == torch.float32:
            b32 = None if self.bias is None else self.bias.float()  # held until the call returns
            rc = self.lib.linear_bf16_xf32(
                x2.data_ptr(),
                x2.stride(0),
                m,
                self.in_features,
                self.panels.data_ptr(),
                self.out_features,
                None if b32 is None else b32.data_ptr(),
                out.data_ptr(),
                self.out_features,
            )
            if rc != 0:
                raise MemoryError(f"linear_bf16_xf32 failed ({rc}) for {m} rows")
        elif m:
            rc = self.lib.linear_bf16(
                x2.data_ptr(),
                x2.stride(0),
                m,
                self.in_features,
                self.panels.data_ptr(),
                self.out_features,
                None if self.bias is None else self.bias.data_ptr(),
                out.data_ptr(),
                self.out_features,
                0,
                0,
            )
            if rc != 0:
                raise MemoryError(f"linear_bf16 failed ({rc}) for {m} rows of {self.in_features}")
        return out.reshape(*lead, self.out_features)
