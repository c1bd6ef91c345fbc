"""DecodePlan: a model's layers as `decode_layers` (engine/kernels/decode_layers.c) runs them, so a
decode step crosses from Python to C once instead of ~9 times a layer. Every dtype and scheme: a
bf16 engine (bf16 activations and KV, fp32 residual stream) or an fp32 one; its linears quantized
(QLinear on the kernels: int8, int4, W8A8, int4-w4a8), bf16 weights on linear_bf16.c (Linear with
panels) or fp32 weights on linear_f32.c (Linear with `lib32`).

Built once per model (ctypes mirrors of `DecLinear` / `DecLayer`); `run` is what
`LlamaModel.hidden_states` calls for a step it applies to (`applies`). The C loop calls the same
kernels as the Python loop, with the same arguments QLinear would pass, in the same order, so
the step's result is bitwise the Python loop's (tests/engine/test_decode_layers.py).

Invariant: the plan holds raw pointers into the layers' weight and norm tensors; the model keeps
those tensors (its Layer objects and their linears own them) for as long as it keeps the plan.
"""

from __future__ import annotations

import ctypes
from enum import IntEnum

import torch

from engine.linear import F32_KERNEL_MAX_ROWS, Linear
from engine.qlinear import BF16_GEMM_MIN_ROWS, QLinear


class DecKind(IntEnum):
    """How decode_layers.c calls one linear (its DEC_* values)."""

    INT8 = 1
    INT4 = 2
    W8A8 = 3
    #: int4-w4a8: the int4 weight-only GEMV for one row, W8A8 for more (as QLinear does)
    W4A8 = 4
    #: a bf16 weight in linear_bf16.c's panels
    BF16 = 5
    #: an fp32 weight on linear_f32.c
    F32 = 6


class DecLinear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("n", ctypes.c_int64),
        ("q", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("group", ctypes.c_int32),
        ("act_group", ctypes.c_int32),
        ("wp", ctypes.c_void_p),
        ("wscale", ctypes.c_void_p),
        ("wsum", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class DecLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", DecLinear),
        ("o", DecLinear),
        ("gate_up", DecLinear),
        ("down", DecLinear),
    ]


def _linear(f: QLinear | Linear) -> DecLinear:
    if isinstance(f, Linear):
        weight = f.panels if f.panels is not None else f.weight
        assert weight is not None  # build() takes a Linear with panels, or with lib32 and weight
        return DecLinear(
            kind=DecKind.BF16 if f.panels is not None else DecKind.F32,
            k=f.in_features,
            n=f.out_features,
            q=weight.data_ptr(),
            bias=0 if f.bias is None else f.bias.data_ptr(),
        )
    w = f.weight
    d = DecLinear(
        k=f.in_features,
        n=f.out_features,
        q=w.q.data_ptr(),
        scales=w.scales.data_ptr(),
        mins=0 if w.mins is None else w.mins.data_ptr(),
        group=w.group,
        act_group=f.act_group,
        bias=0 if f.bias is None else f.bias.data_ptr(),
    )
    if f.w8 is not None:
        d.kind = DecKind.W4A8 if f.gemv_weight_only else DecKind.W8A8
        d.wp, d.wscale, d.wsum = f.w8_args
    else:
        d.kind = DecKind.INT8 if w.scheme == "int8" else DecKind.INT4
    return d


class DecodePlan:
    def __init__(self, lib: ctypes.CDLL, layers: list, hidden: int, inter: int, eps: float) -> None:
        self.lib = lib
        self.layers = (DecLayer * len(layers))(
            *[
                DecLayer(
                    input_norm=L.input_norm.data_ptr(),
                    post_norm=L.post_norm.data_ptr(),
                    qkv=_linear(L.qkv),
                    o=_linear(L.o),
                    gate_up=_linear(L.gate_up),
                    down=_linear(L.down),
                )
                for L in layers
            ]
        )
        self.hidden, self.inter, self.eps = hidden, inter, eps

    @classmethod
    def build(
        cls,
        lib: ctypes.CDLL | None,
        layers: list,
        dtype: torch.dtype,
        hidden: int,
        inter: int,
        eps: float,
    ) -> DecodePlan | None:
        """A plan when every layer qualifies (a bf16 or fp32 engine; every linear a QLinear on the
        kernels, a bf16 Linear on linear_bf16.c or an fp32 one on linear_f32.c, its bias in the
        engine dtype; no q/k norms), else None (the Python loop runs)."""
        if lib is None or dtype not in (torch.bfloat16, torch.float32) or not layers:
            return None
        for L in layers:
            if L.q_norm is not None or L.k_norm is not None:
                return None
            for f in (L.qkv, L.o, L.gate_up, L.down):
                if isinstance(f, Linear):
                    if (f.panels if dtype == torch.bfloat16 else f.lib32) is None:
                        return None
                elif not isinstance(f, QLinear) or f.lib is None:
                    return None
                if f.bias is not None and f.bias.dtype != dtype:
                    return None
            if L.input_norm.dtype != dtype or L.post_norm.dtype != dtype:
                return None
        return cls(lib, layers, hidden, inter, eps)

    @staticmethod
    def applies(num_tokens: int, num_decode: int, kernel_prefill: bool) -> bool:
        """Few enough tokens that each linear takes the kernel QLinear / Linear picks below
        BF16_GEMM_MIN_ROWS and F32_KERNEL_MAX_ROWS (larger steps keep the Python loop), all of
        them decode tokens or the prefill ones on the attention kernel the Python loop would call
        (`kernel_prefill`)."""
        rows = min(BF16_GEMM_MIN_ROWS, F32_KERNEL_MAX_ROWS)
        return 0 < num_tokens < rows and (num_tokens == num_decode or kernel_prefill)

    def run(self, step_ptr: int, h: torch.Tensor, x: torch.Tensor, num_decode: int) -> None:
        """All layers: h (fp32 [m, hidden], in place) from x ([m, hidden] in the engine dtype, the
        first layer's normed input; used as scratch); the step's first `num_decode` tokens
        decode."""
        rc = self.lib.decode_layers(
            step_ptr,
            self.layers,
            len(self.layers),
            h.data_ptr(),
            x.data_ptr(),
            h.shape[0],
            num_decode,
            self.hidden,
            self.inter,
            self.eps,
        )
        if rc != 0:
            raise MemoryError(f"decode_layers failed ({rc}) for a {h.shape[0]}-token step")
