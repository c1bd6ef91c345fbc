"""What this CPU is: model name and ISA flags, read once from /proc/cpuinfo (empty elsewhere).

Used to pick the default dtype, to key the compiled-kernel cache, and by bench to report the
machine.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset[str]()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name") and not model:
                model = ln.split(":", 1)[1].strip()
            elif ln.startswith("flags") and not flags:
                flags = frozenset(ln.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    return _cpuinfo()[1]


def cpu_kind(flags: frozenset[str] | None = None) -> str:
    """The x86 kind the kernels have paths for (bench reports it beside every figure): "AMX",
    "AVX-512 BF16", "AVX-512", "AVX2" (+ FMA, no AVX-512: Haswell+, Zen 1-3), or "portable"."""
    f = cpu_flags() if flags is None else flags
    if {"amx_tile", "amx_bf16"} <= f:
        return "AMX"
    if "avx512_bf16" in f:
        return "AVX-512 BF16"
    if {"avx512f", "avx512bw", "avx512vl"} <= f:
        return "AVX-512"
    if {"avx2", "fma"} <= f:
        return "AVX2"
    return "portable"
