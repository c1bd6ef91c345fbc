"""The engine's dtype: `--dtype auto` resolved on this machine, with the reason it was chosen.

auto is bf16 on CUDA; on a CPU, bf16 where the CPU's bf16 path beats fp32, else fp32:
- AVX-512 BF16 or AMX: bf16 arithmetic (the bf16 GEMM ~2.6x fp32 on Zen 4), whatever the
  checkpoint's dtype;
- AVX2 + FMA without AVX-512, the kernels built for it (qgemm_bf16_isa() 3) and their bf16 linears
  not switched off (DUET_BF16_LINEAR=onednn), for a checkpoint stored in bf16: the weights stay
  bf16 and are widened to fp32 in registers, half the bytes of fp32 to stream (engine/linear.py:
  the figures). The arithmetic is fp32's, so the only gain is the bytes; for an fp32 or fp16
  checkpoint rounding its weights to bf16 would be a loss of precision auto does not choose;
- anything else (no kernels, AVX-512 without BF16, another architecture) runs bf16 in torch's
  bf16 ops, slower than fp32, so fp32.
An explicit dtype is taken as it is. The node logs the choice and its reason at start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import linear
from engine.cpu import cpu_flags
from engine.kernels import kernels_lib

_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True, kw_only=True)
class DtypeChoice:
    """The dtype the engine runs in and why (one sentence, for the log)."""

    dtype: torch.dtype
    reason: str


def cpu_bf16_path() -> tuple[str, bool] | None:
    """This CPU's fast bf16 path, in words, and whether it is storage only (fp32 arithmetic on
    bf16 weights), or None where bf16 would be slower than fp32."""
    flags = cpu_flags()
    if {"avx512_bf16", "amx_bf16"} & flags:
        return "the CPU has bf16 arithmetic (AVX-512 BF16/AMX)", False
    if not {"avx2", "fma"} <= flags or "avx512f" in flags:
        return None
    lib = kernels_lib()
    if lib is None or lib.qgemm_bf16_isa() != linear.AVX2_GEMM:
        return None
    if not linear.avx2_bf16_layers():
        return None  # DUET_BF16_LINEAR=onednn: bf16 layers on F.linear
    return "the AVX2 bf16 linears stream bf16 weights and widen them to fp32 in registers", True


def choose_dtype(name: str, device: torch.device, weights_dtype: str) -> DtypeChoice:
    """`name` (auto or a dtype) on `device` for a checkpoint stored in `weights_dtype` (its
    config's torch_dtype); ValueError for an unknown name."""
    if name != "auto":
        if name not in _NAMES:
            raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
        return DtypeChoice(dtype=_NAMES[name], reason=f"--dtype {name}")
    if device.type == "cuda":
        return DtypeChoice(dtype=torch.bfloat16, reason="auto: CUDA")
    path = cpu_bf16_path()
    if path is None:
        return DtypeChoice(
            dtype=torch.float32, reason="auto: this CPU has no bf16 path faster than fp32"
        )
    words, storage_only = path
    if storage_only and _NAMES.get(weights_dtype) != torch.bfloat16:
        return DtypeChoice(
            dtype=torch.float32,
            reason=f"auto: {words}, but the weights are {weights_dtype}: fp32 keeps them whole",
        )
    return DtypeChoice(dtype=torch.bfloat16, reason=f"auto: {words}")
