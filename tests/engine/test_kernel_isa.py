"""Every kernel source compiles for every x86 ISA level duet runs on, not only this machine's.

The kernels build with `-march=native` on the machine that runs them, so a source that only
compiles where AVX-512 is present passes every test on an AVX-512 machine and then fails, under
`CI=true`, on the first AVX2-only one (a Zen 3 EPYC did: `NULL` came only via immintrin.h). This
compiles each source, with the flags engine/kernels uses, for each level from plain x86-64 to
AMX, on whatever machine runs the suite; the numerics of the level this machine has are checked
by the kernel tests beside it.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

import engine.kernels as kernels

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 ISA levels")

# portable C, SSE4.2, AVX2 (Zen 3, Haswell+), AVX-512 baseline, + VNNI/BF16 without AMX (as on
# Zen 4; gcc 12 has no znver4), + AMX (Sapphire Rapids)
LEVELS = ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4", "cooperlake", "sapphirerapids")


@pytest.mark.parametrize("march", LEVELS)
def test_every_kernel_source_compiles_at(march: str, tmp_path: Path) -> None:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "no C compiler (engine/kernels needs one)"
    flags = [f"-march={march}" if f == "-march=native" else f for f in kernels._BASE_FLAGS]
    assert f"-march={march}" in flags, "engine/kernels no longer builds with -march=native"
    failures = []
    for name, extra in kernels._SOURCES:
        proc = subprocess.run(
            [
                cc,
                *flags,
                *extra,
                "-Werror=implicit-function-declaration",
                f"-I{kernels._DIR}",
                "-c",
                str(kernels._DIR / name),
                "-o",
                str(tmp_path / f"{name}.o"),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            failures.append(f"{name}: {proc.stderr.strip()[:400]}")
    assert not failures, f"-march={march}:\n" + "\n".join(failures)
