"""The attention, rope and norm kernels level against level: this checkout's kernels built for
AVX2 + FMA (x86-64-v3, the path of CPUs without AVX-512), for the portable C (x86-64-v2) and, where
this CPU runs it, for AVX-512 (skylake-avx512 / cooperlake), on the same inputs in one process.

What each must hold (and why not more):
- rope_store: bitwise across levels (the same products and roundings, lane for lane);
- fp32 norms, SiLU·up and linear_f32: AVX2 and AVX-512 bitwise (both run the same 8 lanes), the
  portable C within fp32 rounding of its in-order sums;
- attention (decode tokens and prefill blocks): within fp32 rounding of each other (fp32): the
  paths sum the same products in different orders. In bf16 the AVX2 path rounds the
  probabilities to bf16 for the V sum (as torch's SDPA does) and the portable and AVX-512F paths
  keep them fp32: one bf16 rounding of the output apart, plus the weights' rounding (each weight
  within 2^-9 of itself, so the weighted mean of V moves by at most 2^-9 max|V|); the AVX-512
  BF16 path (dpbf16 sums, normalized by the rounded weights' sum) within test_kernels' bound
  against torch;
- the bf16 norms and SiLU·up: within one bf16 ulp (the sum of squares in a different order moves
  the scale by an fp32 ulp, which can move a rounding), the fp32 residual stream bitwise.
"""

from __future__ import annotations

import platform

import pytest
import torch

from engine.attention import paged_attention
from engine.kernel_step import KernelStep
from tests.engine import isa
from tests.engine.test_kernels import SHAPES, _step, _ulps

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 ISA levels")

DTYPES = [torch.float32, torch.bfloat16]
#: the levels an AVX2 result is compared with: the portable C everywhere, AVX-512 where it runs
OTHERS = [isa.PORTABLE, isa.AVX512, isa.AVX512_BF16]


def _kstep(cache, md, rope, heads: int, window: int | None) -> KernelStep:
    return KernelStep(
        cache,
        md.block_tables,
        md.token_row,
        md.ctx_lens,
        md.positions,
        md.slot_block,
        md.slot_offset,
        rope.cos,
        rope.sin,
        heads,
        md.max_ctx,
        window,
    )


def _attend(lib, dtype: torch.dtype, shape: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rope_store then attention of a mixed step (decodes at several contexts, a fresh prefill and
    one after a cached prefix) through `lib`: (qkv after rope, the pool, the attention output)."""
    heads, kvh, dim, window = SHAPES[shape]
    cache, rope, md, qkv = _step(dtype, heads, kvh, dim, window, seed=7)
    step = _kstep(cache, md, rope, heads, window)
    lib.rope_store(step.ptr, 1, qkv.data_ptr(), qkv.stride(0))
    out = paged_attention(qkv, heads, cache, 1, md, lib, step.ptr, kernel_prefill=True)
    return qkv, cache, out


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, other: str, vmax: float) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    elif other == isa.AVX512_BF16:  # dpbf16 sums over rounded weights (test_kernels' bound)
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    else:  # AVX2's bf16 weights against fp32 ones: one bf16 rounding of the output apart, plus
        # the weights' rounding, 2^-9 max|V| at most (vmax: max|V| of the pool)
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-9 * vmax)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("other", OTHERS)
def test_avx2_attention_and_rope_against_another_level(
    dtype: torch.dtype, shape: str, other: str
) -> None:
    avx2 = isa.library(isa.AVX2)
    theirs = isa.library(other)
    q2, c2, o2 = _attend(avx2, dtype, shape)
    q1, c1, o1 = _attend(theirs, dtype, shape)
    assert torch.equal(q2, q1), "rotary embedding differs between levels"
    assert torch.equal(c2, c1), "K/V stored differently"
    _close(o2.float(), o1.float(), dtype, other, c2[:, :, 1].abs().max().item())


@pytest.mark.parametrize("rows,n", [(1, 576), (5, 576), (300, 64), (3, 40)])
@pytest.mark.parametrize("other", OTHERS)
def test_avx2_norms_against_another_level(rows: int, n: int, other: str) -> None:
    avx2, theirs = isa.library(isa.AVX2), isa.library(other)
    g = torch.Generator().manual_seed(rows + n)
    h = torch.randn(rows, n, generator=g)
    d32, w32 = torch.randn(rows, n, generator=g), 1 + 0.1 * torch.randn(n, generator=g)
    gu32 = 3 * torch.randn(rows, 2 * n, generator=g)
    d16, w16, gu16 = d32.bfloat16(), w32.bfloat16(), gu32.bfloat16()
    eps = 1e-5

    def run(lib) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        hb, xb = h.clone(), torch.empty(rows, n, dtype=torch.bfloat16)
        lib.res_norm_f32(
            hb.data_ptr(), d16.data_ptr(), w16.data_ptr(), xb.data_ptr(), rows, n, eps, 0
        )
        out["res_h"], out["res_x"] = hb, xb
        h16, x16 = h.bfloat16(), torch.empty(rows, n, dtype=torch.bfloat16)
        lib.add_rms_norm_bf16(
            h16.data_ptr(), d16.data_ptr(), w16.data_ptr(), x16.data_ptr(), rows, n, eps
        )
        out["add16_h"], out["add16_x"] = h16, x16
        a16 = torch.empty(rows, n, dtype=torch.bfloat16)
        lib.silu_mul_bf16(gu16.data_ptr(), a16.data_ptr(), rows, n)
        out["silu16"] = a16
        h32, x32 = h.clone(), torch.empty(rows, n)
        lib.add_rms_norm_f32(
            h32.data_ptr(), d32.data_ptr(), w32.data_ptr(), x32.data_ptr(), rows, n, eps
        )
        out["add32_h"], out["add32_x"] = h32, x32
        a32 = torch.empty(rows, n)
        lib.silu_mul_f32(gu32.data_ptr(), a32.data_ptr(), rows, n)
        out["silu32"] = a32
        return out

    mine, ref = run(avx2), run(theirs)
    for k in ("res_h", "add16_h", "add32_h"):  # the residual sums are one addition each
        assert torch.equal(mine[k], ref[k]), k
    for k in ("res_x", "add16_x", "silu16"):
        assert _ulps(mine[k], ref[k]) <= 2.0, k  # one bf16 ulp
    for k in ("add32_x", "silu32"):
        if other == isa.PORTABLE:
            torch.testing.assert_close(mine[k], ref[k], atol=1e-6, rtol=2e-6)
        else:
            assert torch.equal(mine[k], ref[k]), f"{k}: AVX2 and AVX-512 run the same 8 lanes"


@pytest.mark.parametrize("n,k", [(576, 576), (37, 100), (3072, 576)])
@pytest.mark.parametrize("other", OTHERS)
def test_linear_f32_against_another_level_and_batch_invariant(n: int, k: int, other: str) -> None:
    avx2, theirs = isa.library(isa.AVX2), isa.library(other)
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(15, k, generator=g)

    def call(lib, rows: torch.Tensor, bias: torch.Tensor | None = b) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n)
        bp = None if bias is None else bias.data_ptr()
        rc = lib.linear_f32(
            rows.data_ptr(), k, rows.shape[0], k, w.data_ptr(), n, bp, out.data_ptr(), n
        )
        assert rc == 0
        return out

    mine = call(avx2, x)
    torch.testing.assert_close(mine, x @ w.T + b, atol=1e-4, rtol=1e-5)
    assert torch.equal(call(avx2, x, None) + b, mine), "the bias is one addition after the sum"
    for size in (1, 2, 3, 7):  # a row's output does not depend on the rows beside it
        parts = [call(avx2, x[i : i + size]) for i in range(0, 15, size)]
        assert torch.equal(torch.cat(parts), mine), size
    ref = call(theirs, x)
    if other == isa.PORTABLE:
        torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-5)
    else:
        assert torch.equal(mine, ref), "AVX2 and AVX-512 run the same 8 lanes"
