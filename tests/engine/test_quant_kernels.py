"""The int8/int4 weight-only linears against a torch reference of the same quantized weights.

Reference: F.linear in fp32 over `dequantize(w)` (the exact values the kernels multiply by).
The kernels accumulate in another order, so fp32 agrees to fp32 rounding and bf16 to one bf16
rounding of the output. Decode (m = 1) and batched (m > 1) paths must agree bitwise below
BF16_GEMM_MIN_ROWS, or a sequence's tokens would depend on the small batch it happens to decode
in; bf16 batches from there on take the bf16 GEMM path (tests/engine/test_qlinear_bf16.py),
checked here against its own reference.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.kernels
from engine.cpu import cpu_flags
from engine.kernels import kernels_lib
from engine.qlinear import QLinear, bf16_gemm_reference
from engine.quant import dequantize, pack_int4, quantize, unpack_int4

lib = kernels_lib()
needs_kernels = pytest.mark.skipif(
    lib is None, reason="kernels unavailable (no C compiler, or DUET_DISABLE_KERNELS)"
)

SHAPES = {  # (out, in): tiny, SmolLM2's qkv / down / gate_up, rows not a multiple of 16
    "int8": [(37, 64), (960, 576), (576, 1536), (100, 136)],
    "int4": [(37, 64), (960, 576), (576, 1536), (3072, 576)],
    "int4-g64": [(37, 64), (960, 576), (576, 1536)],
}
CASES = [(s, n, k) for s, shapes in SHAPES.items() for n, k in shapes]


def _check(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    else:  # one bf16 rounding of the fp32 result (plus fp32 order noise at a rounding boundary)
        ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
        assert ((got.float() - ref).abs() <= ulp).all(), (
            f"max error {(got.float() - ref).abs().max()}"
        )


def test_int4_packing_roundtrips() -> None:
    q = torch.randint(0, 16, (7, 192), generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 96)
    assert torch.equal(unpack_int4(packed, 192), q)


def test_quantization_error_is_bounded() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    q8 = quantize(w, "int8")
    assert ((dequantize(q8) - w).abs() <= q8.scales[:, None] / 2 * 1.0001).all()
    for scheme, group in (("int4", 32), ("int4-g64", 64)):
        q4 = quantize(w, scheme)
        assert q4.group == group
        g = w.reshape(-1, group)
        lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
        plain = (
            (torch.round((g - lo) / ((hi - lo) / 15)).clamp(0, 15) * ((hi - lo) / 15) + lo - g)
            .pow(2)
            .sum()
        )
        err = (dequantize(q4) - w).pow(2).sum()
        # the fitted scales beat plain min/max (Q4_1) rounding by a margin on Gaussian weights
        assert err < 0.95 * plain, (err, plain)
        step = q4.scales.float().repeat_interleave(group, dim=1)
        assert ((dequantize(q4) - w).abs() <= 2 * step).all()


def test_int4_recovers_a_q4_1_grid_exactly() -> None:
    """Weights that already lie on a Q4_1 grid (fp16 d and m, q in 0..15, both ends used) come
    back bit for bit: SmolLM2's layers arrive that way from its Q4_1 GGUF."""
    g = torch.Generator().manual_seed(2)
    d = (torch.rand(16, 4, generator=g) * 0.05 + 0.001).half()
    m = (-torch.rand(16, 4, generator=g) * 0.3).half()
    q = torch.randint(0, 16, (16, 4, 32), generator=g)
    q[:, :, 0], q[:, :, 1] = 0, 15
    w = (q.float() * d.float()[..., None] + m.float()[..., None]).reshape(16, 128)
    assert torch.equal(dequantize(quantize(w, "int4")), w)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("scheme", "n", "k"), CASES, ids=[f"{s}-{n}x{k}" for s, n, k in CASES])
def test_kernel_matches_torch_reference(scheme: str, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * k)
    qw = quantize(torch.randn(n, k, generator=g) * 0.05, scheme)
    ref_w = dequantize(qw)
    for bias in (None, torch.randn(n, generator=g).to(dtype)):
        lin = QLinear(qw, bias)
        assert lin.lib is not None
        for m in (1, 3, 70):
            x = torch.randn(m, k, generator=g).to(dtype)
            got = lin(x)
            assert got.dtype == dtype and got.shape == (m, n)
            # AVX2's GEMM path (gemm_fp32) multiplies the exact weights: F.linear's reference
            if dtype == torch.bfloat16 and 0 < lin.bf16_min_rows <= m and not lin.gemm_fp32:
                _check(got, bf16_gemm_reference(x, qw, bias, torch.float32), dtype)
            else:
                _check(
                    got, F.linear(x.float(), ref_w, None if bias is None else bias.float()), dtype
                )
        # decode path (m = 1) and batched paths agree bitwise: int4's vdpbf16ps path decodes the
        # weights in registers for up to 4 rows and through an L1 buffer for more; int8 shares
        # each converted chunk among 8 activation rows up to 64 (9: a second pass of one row)
        # and takes the fp32 tile from 65 (the bf16 GEMM path, where it applies, is checked above;
        # on AVX2 fp32 rows take it too). The GEMM path's rows agree bitwise among its own batches.
        for m in (2, 4, 5, 9, 15, 64, 65):
            x = torch.randn(m, k, generator=g).to(dtype)
            if 0 < lin.bf16_min_rows <= m and (dtype == torch.bfloat16 or lin.gemm_fp32):
                lone = [lin(torch.cat([x[i : i + 1]] * lin.bf16_min_rows))[:1] for i in range(m)]
                assert torch.equal(torch.cat(lone), lin(x)), m
                continue
            assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(m)]), lin(x)), m


@needs_kernels
def test_int4_bf16_activations_take_the_dot_path_where_the_cpu_has_avx512_bf16() -> None:
    # int4 with bf16 activations runs on vdpbf16ps where the CPU has it (1.2-1.4x one row, 1.3-2.8x
    # a few rows, Zen 4); the test above checks its values and its batch invariance, this that
    # a build with AVX-512 BF16 does not quietly keep the fp32 table path
    assert lib.qlinear_int4_path() == int("avx512_bf16" in cpu_flags())


@needs_kernels
def test_kernel_reads_strided_rows() -> None:
    qw = quantize(torch.randn(48, 128), "int4")
    lin = QLinear(qw)
    wide = torch.randn(4, 300)
    x = wide[:, 10:138]  # rows 300 elements apart
    torch.testing.assert_close(lin(x), lin(x.contiguous()), rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_torch_fallback_matches_reference(scheme: str) -> None:
    """The path CUDA and compiler-less machines take: per-tile dequantize + F.linear."""
    qw = quantize(torch.randn(70, 128), scheme)
    lin = QLinear(qw, torch.randn(70))
    x = torch.randn(9, 128)
    _check(lin._torch(x, x.dtype), F.linear(x, dequantize(qw), lin.bias), torch.float32)
    if lin.lib is not None:
        _check(lin._kernel(x, x.dtype), lin._torch(x, x.dtype), torch.float32)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 64"):
        quantize(torch.randn(8, 96), "int4")
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(torch.randn(8, 64), "int3")
    lin = QLinear(quantize(torch.randn(8, 64), "int8"))
    if lin.lib is not None:
        with pytest.raises(ValueError, match="expects 64"):
            lin(torch.randn(2, 32))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("scheme", ["int8", "int4", "int4-g64"])
def test_portable_build_matches_reference(scheme: str, tmp_path: Path) -> None:
    """The C fallback a CPU without AVX-512 compiles (built here for x86-64-v2)."""
    kdir = Path(engine.kernels.__file__).parent
    so = tmp_path / "portable.so"
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-march=x86-64-v2",
            "-fopenmp",
            "-fPIC",
            "-shared",
            "-ffp-contract=off",
            f"-I{kdir}",
            str(kdir / "qgemv_int8.c"),
            str(kdir / "qgemv_int4.c"),
            "-o",
            str(so),
            "-lm",
        ],
        check=True,
    )
    plib = ctypes.CDLL(str(so))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    plib.qlinear_int8.argtypes = [p, i64, i32, i32, p, p, i64, p, p, i64, i32, i32]
    plib.qlinear_int4.argtypes = [p, i64, i32, i32, p, p, p, i32, i64, p, p, i64, i32, i32]
    n, k = 70, 128
    qw = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(3)), scheme)
    for dtype in (torch.float32, torch.bfloat16):
        bias = torch.randn(n).to(dtype)
        for m in (1, 5):
            x = torch.randn(m, k).to(dtype)
            out = torch.empty(m, n, dtype=dtype)
            common = (x.data_ptr(), k, m, k)
            tail = (n, bias.data_ptr(), out.data_ptr(), n, int(dtype == torch.bfloat16), 0)
            if qw.scheme == "int8":
                rc = plib.qlinear_int8(*common, qw.q.data_ptr(), qw.scales.data_ptr(), *tail)
            else:
                rc = plib.qlinear_int4(
                    *common,
                    qw.q.data_ptr(),
                    qw.scales.data_ptr(),
                    qw.mins.data_ptr(),
                    qw.group,
                    *tail,
                )
            assert rc == 0
            _check(out, F.linear(x.float(), dequantize(qw), bias.float()), dtype)
