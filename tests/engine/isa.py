"""Whether this CPU can run a kernel build made for another `-march`.

The kernel tests build some sources for other ISA levels than this machine's (the portable C, the
AVX-512 path without VNNI, ...) and run them. A build for a level this CPU lacks dies of SIGILL
and takes the whole pytest process with it (it did, on an AVX2-only Zen 3): such a build is
skipped here, with the reason. That every source still *compiles* at every level is
tests/engine/test_kernel_isa.py's job, on any machine.
"""

from __future__ import annotations

import functools
import subprocess

import pytest

from engine.cpu import cpu_flags

#: gcc's predefined macro → the /proc/cpuinfo flag a CPU needs for it
_MACROS = {
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__BMI2__": "bmi2",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512VL__": "avx512vl",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16",
    "__AVXVNNI__": "avx_vnni",
    "__AMX_TILE__": "amx_tile",
    "__AMX_INT8__": "amx_int8",
    "__AMX_BF16__": "amx_bf16",
}


@functools.cache
def needs(march: str) -> frozenset[str]:
    """The CPU flags a `-march=march` build may use (of those the kernels care about)."""
    out = subprocess.run(
        ["gcc", f"-march={march}", "-dM", "-E", "-"],
        input="",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    defined = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
    return frozenset(flag for macro, flag in _MACROS.items() if macro in defined)


def skip_unless_runs_here(march: str) -> None:
    missing = needs(march) - cpu_flags()
    if missing:
        pytest.skip(
            f"this CPU cannot run a -march={march} build (no {', '.join(sorted(missing))}); "
            "that it compiles is checked by test_kernel_isa.py"
        )


#: the x86 levels the kernels have paths for, as gcc's -march: the portable C, AVX2 + FMA (Zen 1-3,
#: Haswell+), AVX-512 without VNNI or BF16, with VNNI, with BF16 (Zen 4's set; gcc 12 has no
#: znver4), with AMX
PORTABLE, AVX2, AVX512, AVX512_VNNI, AVX512_BF16, AMX = (
    "x86-64-v2",
    "x86-64-v3",
    "skylake-avx512",
    "icelake-server",
    "cooperlake",
    "sapphirerapids",
)


@functools.cache
def _built(march: str):
    import torch  # noqa: F401 - torch's libgomp first, as engine.kernels.kernels_lib does

    from engine.kernels import build_library

    return build_library(private_copy=True, march=march)


def library(march: str):
    """This checkout's kernels built for `march` and loaded beside the engine's own (one build per
    level and test process), so a test compares the AVX2, AVX-512 and portable paths on whatever
    CPU runs it. Skips the test where this CPU cannot run that build."""
    skip_unless_runs_here(march)
    return _built(march)
