"""Native CPU kernels, compiled on first use with the system C compiler and loaded via ctypes.

Compiled once per machine into `$DUET_HOME/kernels/` (keyed by source, flags and CPU
features, written atomically), in well under a second. Linked against the OpenMP runtime torch
already loaded, so kernels and torch share one thread pool (two pools spinning on two cores
is catastrophic). When no compiler is available the engine falls back to torch ops, with one
log line.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from protocol.models import duet_home

log = logging.getLogger("duet.engine.kernels")

_SRC = Path(__file__).with_name("paged_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]  # fmt: skip


def _cpu_key() -> str:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return flags


def _compile() -> Path | None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *_FLAGS, _cpu_key()]).encode()).hexdigest()[:16]
    out_dir = duet_home() / "kernels"
    target = out_dir / f"paged_attention-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    proc = subprocess.run([cc, *_FLAGS, str(_SRC), "-o", tmp, "-lm"], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        log.warning("compiling the CPU attention kernel failed: %s", proc.stderr.strip()[:500])
        return None
    os.replace(tmp, target)
    return target


@functools.cache
def paged_attention_lib() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (torch fallback)."""
    if os.environ.get("DUET_DISABLE_KERNELS"):
        return None
    import torch  # noqa: F401 - load torch's libgomp first so the kernel binds to it

    path = _compile()
    if path is None:
        log.warning("no C compiler: decode attention uses the slower torch path")
        return None
    lib = ctypes.CDLL(str(path))
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
            ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
            ctypes.c_float]  # fmt: skip
    for name in ("paged_decode_attention_f32", "paged_decode_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = None
    return lib
