"""The AVX2 + FMA paths of the linears, the logits and argmax against the portable C and, on a CPU
that can run them, the AVX-512 paths, whichever CPU runs the suite (the AVX2 build is
`-march=x86-64-v3`, loaded beside the others: tests/engine/isa.py).

What each comparison promises, and why:
- int8 / int4 weight-only below 16 rows: the AVX2 GEMV keeps the AVX-512 GEMV's 16 lane chains
  and its reduction tree as 8-lane halves, so it is bitwise the AVX-512 (no BF16) build's result;
  the portable C sums in input order with two roundings: within fp32 rounding of the sums.
- From 16 rows AVX2 runs its fp32 panel GEMM (qgemm_f32.h: one FMA chain per output): a row's
  result is bitwise the same in every batch of 16+ rows, and within fp32 rounding of the others.
- W8A8: integer sums, so bitwise the reference (w8a8_reference) and every other path.
- bf16 linears: every row count bitwise alike (one chain per output, odd input of a pair first, as
  vdpbf16ps adds them), within fp32 rounding of the exact products' sum.
- bf16 logits: the AVX-512 blocks' chains as halves: bitwise the avx512f build's (its two-FMA
  emulation of vdpbf16ps); within fp32 rounding of the portable C.
- argmax: the same index everywhere (the first maximum; the first NaN).
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from engine.quant import dequantize, pack_w8a8, quantize, w8a8_reference
from tests.engine import isa

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 ISA levels")


def _close(got: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    """Within fp32 rounding of a k-term sum (each path orders its sums its own way)."""
    tol = 4 * k * torch.finfo(torch.float32).eps * ref.abs().max().item() + 1e-6
    assert (got.float() - ref.float()).abs().max().item() <= tol


def _q(lib, qw, x: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n, bf16 = qw.out_features, int(x.dtype == torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.float32)
    if qw.scheme == "int8":
        rc = lib.qlinear_int8(
            x.data_ptr(),
            k,
            m,
            k,
            qw.q.data_ptr(),
            qw.scales.data_ptr(),
            n,
            None,
            out.data_ptr(),
            n,
            bf16,
            1,
        )
    else:
        rc = lib.qlinear_int4(
            x.data_ptr(),
            k,
            m,
            k,
            qw.q.data_ptr(),
            qw.scales.data_ptr(),
            qw.mins.data_ptr(),
            qw.group,
            n,
            None,
            out.data_ptr(),
            n,
            bf16,
            1,
        )
    assert rc == 0
    return out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_only_linears(scheme: str, dtype: torch.dtype) -> None:
    avx2, portable = isa.library(isa.AVX2), isa.library(isa.PORTABLE)
    assert avx2.kernels_isa() == 1
    n, k = (70, 136) if scheme == "int8" else (70, 192)  # int8: k's tail past 16-byte chunks
    g = torch.Generator().manual_seed(1)
    qw = quantize(torch.randn(n, k, generator=g) * 0.05, scheme)
    ref_w = dequantize(qw)
    for m in (1, 3, 7, 16, 21):
        x = torch.randn(m, k, generator=g).to(dtype)
        got = _q(avx2, qw, x)
        _close(got, F.linear(x.float(), ref_w), k)
        _close(got, _q(portable, qw, x), k)
        if m < 16:  # the GEMV's chains: one row alone gives the same bits
            alone = torch.cat([_q(avx2, qw, x[i : i + 1]) for i in range(m)])
        else:  # the GEMM path's: each row in another batch of 16
            alone = torch.cat([_q(avx2, qw, torch.cat([x[i : i + 1]] * 16))[:1] for i in range(m)])
        assert torch.equal(got, alone), m


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_weight_only_gemv_is_the_avx512_builds(scheme: str) -> None:
    avx2, avx512 = isa.library(isa.AVX2), isa.library(isa.AVX512)
    g = torch.Generator().manual_seed(2)
    qw = quantize(torch.randn(50, 576, generator=g) * 0.05, scheme)
    for m in (1, 2, 9):
        x = torch.randn(m, 576, generator=g)
        assert torch.equal(_q(avx2, qw, x), _q(avx512, qw, x)), m


@pytest.mark.parametrize("group", [0, 128])
def test_w8a8_is_the_reference_bit_for_bit(group: int) -> None:
    lib = isa.library(isa.AVX2)
    g = torch.Generator().manual_seed(3)
    n, k = 70, 256
    qw = quantize(torch.randn(n, k, generator=g), "int8")
    packed, wsum = pack_w8a8(qw.q, group)
    for m in (1, 2, 5, 9, 20):
        x = (torch.randn(m, k, generator=g) * 3).bfloat16()
        x[0, 5] = 40.0  # an outlier: activations near the int8 range's ends
        bias = torch.randn(n, generator=g).bfloat16()
        out = torch.empty(m, n, dtype=torch.bfloat16)
        rc = lib.qlinear_w8a8(
            x.data_ptr(),
            k,
            m,
            k,
            packed.data_ptr(),
            qw.scales.data_ptr(),
            wsum.data_ptr(),
            n,
            bias.data_ptr(),
            out.data_ptr(),
            n,
            1,
            0,
            group,
        )
        assert rc == 0 and torch.equal(out, w8a8_reference(x, qw, bias, group=group)), m


def _bf16_linear(lib, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    panels = torch.empty(lib.linear_bf16_packed_words(n, k), dtype=torch.int32)
    assert lib.linear_bf16_pack(w.data_ptr(), n, k, panels.data_ptr()) == 0
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if x.dtype == torch.float32:
        rc = lib.linear_bf16_xf32(
            x.data_ptr(), k, m, k, panels.data_ptr(), n, None, out.data_ptr(), n
        )
    else:
        rc = lib.linear_bf16(
            x.data_ptr(), k, m, k, panels.data_ptr(), n, None, out.data_ptr(), n, 1, 0
        )
    assert rc == 0
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_weights_widened_to_fp32(dtype: torch.dtype) -> None:
    lib = isa.library(isa.AVX2)
    assert lib.qgemm_bf16_isa() == 3
    g = torch.Generator().manual_seed(4)
    n, k = 40, 72  # k's tail past a 32-input chunk, n past a 32-row block
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(100, k, generator=g).to(dtype)
    full = _bf16_linear(lib, w, x)  # the panel GEMM (test_bf16_rows_pick_their_path)
    _close(full, x.double() @ w.double().T, k)
    for m in (1, 4, 5, 6, 16, 95, 96):  # the few-row kernel (1-95), the panels again: same bits
        assert torch.equal(_bf16_linear(lib, w, x[:m]), full[:m]), m


def test_bf16_rows_pick_their_path() -> None:
    """linear_bf16's AVX2 path: the few-row kernel below 96 rows, where it measured faster, the
    panel GEMM from 96 (SmolLM2's linears on Zen 3: docs/benchmarks.md); an AVX-512 build has no
    such choice."""
    panel = isa.library(isa.AVX2).linear_bf16_avx2_panel
    assert [panel(m) for m in (1, 15, 16, 95, 96, 512)] == [0, 0, 0, 0, 1, 1]
    assert isa.library(isa.PORTABLE).linear_bf16_avx2_panel(96) == -3


def _logits(lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    out = torch.empty(m, w.shape[0])
    assert (
        lib.logits_bf16(
            x.data_ptr(), k, m, k, w.data_ptr(), w.shape[0], out.data_ptr(), out.shape[1]
        )
        == 0
    )
    return out


def test_logits() -> None:
    avx2, portable = isa.library(isa.AVX2), isa.library(isa.PORTABLE)
    assert avx2.logits_bf16_isa() == 3
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 96, generator=g).bfloat16()
    x = torch.randn(5, 96, generator=g).bfloat16()
    got = _logits(avx2, x, w)
    _close(got, _logits(portable, x, w), 96)
    assert torch.equal(torch.cat([_logits(avx2, x[i : i + 1], w) for i in range(5)]), got)
    try:
        avx512 = isa.library(isa.AVX512)
    except pytest.skip.Exception:
        return
    assert torch.equal(got, _logits(avx512, x, w))


def test_argmax_everywhere() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 1003, generator=g)
    x[1, 9] = x[1, 700] = 30.0
    x[2, 500] = float("nan")
    want = x.argmax(dim=1).tolist()
    for march in (isa.AVX2, isa.PORTABLE, isa.AVX512):
        try:
            lib = isa.library(march)
        except pytest.skip.Exception:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            xx = x.to(dtype)
            out = torch.empty(4, dtype=torch.int64)
            lib.argmax_rows(
                xx.data_ptr(), 1003, 4, 1003, int(dtype == torch.bfloat16), out.data_ptr()
            )
            assert out.tolist() == xx.float().argmax(dim=1).tolist(), (march, dtype)
            if dtype == torch.float32:
                assert out.tolist() == want
