"""Native CPU kernels, compiled on first use with the system C compiler and loaded via ctypes.

Compiled once per machine into `$DUET_KERNEL_CACHE` (default `$DUET_HOME/kernels/`; keyed by
compiler, sources, flags and CPU features, written atomically, built by one process at a time
under a file lock while the others wait for its result), in about a second alone. Linked against the
OpenMP runtime torch already loaded, so kernels and torch share one thread pool (two pools spinning
on two cores is catastrophic). When no compiler is available or a source fails to compile, the
engine falls back to torch ops with one warning, except in strict mode (`CI=true`,
runtime/strict.py) where that raises `FallbackRefused` with the compiler's error, so CI never
passes on the torch path. DUET_DISABLE_KERNELS=1 is a deliberate choice and allowed in
strict mode too; it is logged as such.

Each source has paths per x86 level, chosen at compile time by the `-march` the library is built
for: the engine's own is `-march=native`; `build_library(march=...)` builds another level beside
it (`x86-64-v3`: the AVX2 + FMA paths, `x86-64-v2`: the portable C, `skylake-avx512`, ...), so the
tests compare the levels' outputs, and bench/kernel_ab.py their speed, on one CPU. `kernels_isa()`
says which level a build carries.

Kernels (see each .c file): `paged_attention` (attention of any step token against the paged
pool), `prefill_attention` (the same for prefill tokens, in query blocks; on AMX CPUs its
tile path `prefill_attention_amx`, which returns 1 where it does not apply) and `rope_store` (rotary
embedding in place + K/V write to the pool), which take the step's shared arguments as a `Step`
struct (step.h, mirrored in engine/kernel_step.py); and bf16 `rms_norm` / `add_rms_norm` /
`silu_mul` and the fp32 residual stream's `res_norm_f32` (norm_act.c), `argmax_rows` (greedy
sampling, argmax.c), the weight-only quantized linears `qlinear_int8` / `qlinear_int4`
(qgemv_int8.c, qgemv_int4.c, shared parts in qgemm.h; `qlinear_int4_path` says whether bf16
activations take int4's vdpbf16ps path) and their bf16-GEMM forms for large
batches `qlinear_int8_bf16` / `qlinear_int4_bf16` (AMX or AVX-512 BF16, `qgemm_bf16_isa`;
qgemm_bf16.h), `logits_bf16` (the bf16 lm_head with
fp32 output, logits_bf16.c) and `qlinear_w8a8` (int8 activations x int8 weights, int32 sums:
AMX, AVX-512 VNNI or portable, qgemm_w8a8.c); `decode_layers` runs a quantized bf16 model's
layers for a pure-decode step in one call, the same kernels in the same order (decode_layers.c,
engine/decode_plan.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import cast

from engine.cpu import cpu_flags
from runtime.models import duet_home
from runtime.strict import fallback

log = logging.getLogger("duet.engine.kernels")

_DIR = Path(__file__).parent
_HEADERS = (
    "common.h",
    "vec8.h",
    "step.h",
    "attention_parts.h",
    "attention_int8.h",
    "qgemm.h",
    "qgemm_bf16.h",
    "qgemm_f32.h",
)
_BASE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-fno-math-errno", "-fno-trapping-math")
# Attention may reassociate (its sums are reductions anyway); rope and the bf16 norms must round
# exactly where torch / transformers do, so they get neither reassociation nor FMA contraction.
_REASSOC = ("-fassociative-math", "-fno-signed-zeros")
_SOURCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("paged_attention.c", _REASSOC),
    ("prefill_attention.c", _REASSOC),
    ("prefill_attention_amx.c", _REASSOC),
    ("rope_store.c", ("-ffp-contract=off",)),
    ("norm_act.c", ("-ffp-contract=off",)),
    ("argmax.c", ()),
    # int4's lookup table must be d * q + m with two roundings, as engine/quant.py dequantizes;
    # and both files' decode and batched paths must round identically (explicit FMAs only)
    ("qgemv_int8.c", ("-ffp-contract=off",)),
    ("qgemv_int4.c", ("-ffp-contract=off",)),
    ("logits_bf16.c", ("-ffp-contract=off",)),
    ("qgemm_w8a8.c", ("-ffp-contract=off",)),
    ("decode_layers.c", ("-ffp-contract=off",)),
    ("linear_bf16.c", ("-ffp-contract=off",)),
    ("linear_f32.c", ("-ffp-contract=off",)),
)


class _CompileError(Exception):
    """Why the kernels could not be built (shown to the operator, or raised in strict mode)."""


def base_flags(march: str = "native") -> tuple[str, ...]:
    """The compiler flags every source gets, for the x86 level `march` (gcc's -march: "native",
    "x86-64-v3" for AVX2 + FMA, "x86-64-v2" for the portable C, "skylake-avx512", ...)."""
    return tuple(f"-march={march}" if f == "-march=native" else f for f in _BASE_FLAGS)


def _compile(src: Path = _DIR, march: str = "native") -> Path:
    """The shared library built from the kernel sources in `src` (this package's, or another
    revision's for bench/kernel_ab.py) for the x86 level `march`, compiled once per sources,
    flags and CPU."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise _CompileError("no C compiler found (set CC, or install gcc)")
    if shutil.which(cc) is None:
        raise _CompileError(f"the C compiler {cc!r} (from CC) is not an executable")
    flags = base_flags(march)
    # an older revision's sources (bench/kernel_ab.py) may lack a file added since: built without it
    sources = [(n, f) for n, f in _SOURCES if src == _DIR or (src / n).is_file()]
    h = hashlib.sha256(" ".join([cc, *flags, repr(sources), *sorted(cpu_flags())]).encode())
    for name in (*_HEADERS, *(n for n, _ in sources)):
        if src == _DIR or (src / name).is_file():
            h.update((src / name).read_bytes())
    out_dir = kernel_cache_dir()
    target = out_dir / f"duet_kernels-{h.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Every process of a node set starting at once would build the same library side by side
    # (14 compilers each, on a machine that has a few cores): one builds, the others wait and
    # load its result.
    with open(out_dir / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        _build(cc, flags, src, sources, target)
    return target


def kernel_cache_dir() -> Path:
    """Where built kernel libraries are kept: `$DUET_KERNEL_CACHE`, else `$DUET_HOME/kernels`."""
    env = os.environ.get("DUET_KERNEL_CACHE")
    return Path(env) if env else duet_home() / "kernels"


def _build(
    cc: str,
    flags: tuple[str, ...],
    src: Path,
    sources: list[tuple[str, tuple[str, ...]]],
    target: Path,
) -> None:
    """Compile `sources` (name, extra flags) in `src` and move the library to `target` (atomic
    rename)."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objs = [str(Path(tmp) / (name + ".o")) for name, _ in sources]
        # The sources compile in parallel (about a second in all).
        procs = [
            subprocess.Popen(
                [cc, *flags, *extra, f"-I{src}", "-c", str(src / name), "-o", obj],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for (name, extra), obj in zip(sources, objs, strict=True)
        ]
        errors = [
            _error(p) for p in procs
        ]  # a list: wait for every compiler, not just the first failure
        if any(errors):
            raise _CompileError(next(e for e in errors if e))
        so = Path(tmp) / "lib.so"
        err = _error(
            subprocess.Popen(
                [cc, "-shared", "-fopenmp", *objs, "-o", str(so), "-lm"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        if err:
            raise _CompileError(err)
        os.replace(so, target)


def _error(proc: subprocess.Popen[str]) -> str | None:
    """The compiler's complaint (None: it succeeded)."""
    _, err = proc.communicate()
    if proc.returncode == 0:
        return None
    cmd = cast("list[str]", proc.args)  # every compiler here is started with an argument list
    return f"{cmd[0]} exited with {proc.returncode}: {err.strip()[:500] or '(no output)'}"


@functools.cache
def kernels_lib() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (torch fallback; FallbackRefused in strict mode)."""
    if os.environ.get("DUET_DISABLE_KERNELS"):
        log.info(
            "DUET_DISABLE_KERNELS is set: CPU kernels disabled on purpose, "
            "the engine uses torch ops"
        )
        return None
    import torch  # noqa: F401 - load torch's libgomp first so the kernels bind to it

    try:
        path = _compile()
    except _CompileError as e:
        fallback(log, f"the CPU kernels cannot be built ({e})", "the slower torch ops")
        return None
    return _load(path)


def build_library(
    src: Path = _DIR, private_copy: bool = False, march: str = "native"
) -> ctypes.CDLL:
    """The kernels in `src` compiled for the x86 level `march` and loaded beside this process's
    own (bench/kernel_ab.py; tests comparing the AVX2, AVX-512 and portable paths on one CPU).
    `private_copy`: load from a copy in a fresh temporary directory, so that sources equal to the
    loaded ones still give a second library rather than the same handle. Functions the sources
    lack are left out (a call to one raises AttributeError). Raises ValueError when they do not
    build. A build for a level this CPU lacks loads, and dies of SIGILL when a kernel runs: the
    caller checks first (tests/engine/isa.py)."""
    try:
        path = _compile(src, march)
    except _CompileError as e:
        raise ValueError(f"the kernels in {src} do not build for -march={march}: {e}") from e
    if private_copy:
        copy = Path(tempfile.mkdtemp(prefix="duet-kernels-")) / path.name
        shutil.copyfile(path, copy)
        path = copy
    try:
        return _load(path, partial=True)
    finally:
        if private_copy:  # loaded (mapped) or not, the copy's file is not needed any more
            shutil.rmtree(path.parent, ignore_errors=True)


_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_STEP = [
    _P,
    _I32,
    _I32,
    _I32,
    _P,
    _I64,
    _P,
    _I64,
]  # (Step *, layer, first, count, q, q_stride, out, out_stride)
#: every exported kernel: (argument types, return type)
_SIGNATURES: dict[str, tuple[list, object]] = {
    "paged_attention": (_STEP, None),
    "prefill_attention": (_STEP, None),
    "prefill_attention_amx": (_STEP, _I32),
    "rope_store": ([_P, _I32, _P, _I64], None),
    "rms_norm_bf16": ([_P, _P, _P, _I32, _I32, _F32], None),
    "add_rms_norm_bf16": ([_P, _P, _P, _P, _I32, _I32, _F32], None),
    "silu_mul_bf16": ([_P, _P, _I32, _I32], None),
    "res_norm_f32": ([_P, _P, _P, _P, _I32, _I32, _F32, _I32], None),
    "add_rms_norm_f32": ([_P, _P, _P, _P, _I32, _I32, _F32], None),
    "silu_mul_f32": ([_P, _P, _I32, _I32], None),
    "argmax_rows": ([_P, _I64, _I32, _I32, _I32, _P], None),
    "kernels_isa": ([], _I32),
    "qlinear_int8": ([_P, _I64, _I32, _I32, _P, _P, _I64, _P, _P, _I64, _I32, _I32], _I32),
    "qlinear_int4": (
        [_P, _I64, _I32, _I32, _P, _P, _P, _I32, _I64, _P, _P, _I64, _I32, _I32],
        _I32,
    ),
    "qlinear_int4_path": ([], _I32),
    "logits_bf16": ([_P, _I64, _I32, _I32, _P, _I64, _P, _I64], _I32),
    "logits_bf16_path": ([_P, _I64, _I32, _I32, _P, _I64, _P, _I64, _I32], _I32),
    "logits_bf16_isa": ([], _I32),
    "qlinear_w8a8": (
        [_P, _I64, _I32, _I32, _P, _P, _P, _I64, _P, _P, _I64, _I32, _I32, _I32],
        _I32,
    ),
    "qlinear_int8_bf16": ([_P, _I64, _I32, _I32, _P, _P, _I64, _P, _P, _I64, _I32, _I32], _I32),
    "qlinear_int4_bf16": (
        [_P, _I64, _I32, _I32, _P, _P, _P, _I32, _I64, _P, _P, _I64, _I32, _I32],
        _I32,
    ),
    "qgemm_bf16_isa": ([], _I32),
    "linear_bf16_packed_words": ([_I64, _I32], _I64),
    "linear_bf16_pack": ([_P, _I64, _I32, _P], _I32),
    "linear_bf16": ([_P, _I64, _I32, _I32, _P, _I64, _P, _P, _I64, _I32, _I32], _I32),
    "linear_bf16_xf32": ([_P, _I64, _I32, _I32, _P, _I64, _P, _P, _I64], _I32),
    "linear_bf16_avx2_panel": ([_I32], _I32),
    "linear_f32": ([_P, _I64, _I32, _I32, _P, _I64, _P, _P, _I64], _I32),
    "decode_layers": ([_P, _P, _I32, _P, _P, _I32, _I32, _I32, _I32, _F32], _I32),
}


def _load(path: Path, partial: bool = False) -> ctypes.CDLL:
    """The library at `path` with every kernel's ctypes signature declared. `partial`: a function
    the library lacks (an older revision's build, bench/kernel_ab.py) is left out instead of
    refused; calling it then raises AttributeError."""
    lib = ctypes.CDLL(str(path))
    for name, (args, res) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if partial:
                continue
            raise
        fn.argtypes, fn.restype = args, res
    return lib
