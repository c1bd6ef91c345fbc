"""The native CPU kernels against their torch twins (the DUET_DISABLE_KERNELS=1 path).

rope_store must be bit-exact in both dtypes (it is the same arithmetic); attention equals the
torch SDPA path within fp32 rounding (fp32) or one bf16 rounding step (bf16); the bf16 norm
and SiLU kernels equal transformers' bf16 arithmetic within one bf16 ulp.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine.attention import build_metadata, paged_attention
from engine.kernel_step import KernelStep
from engine.kernels import kernels_lib
from engine.rope import Rope

lib = kernels_lib()
pytestmark = pytest.mark.skipif(
    lib is None, reason="kernels unavailable (no C compiler, or DUET_DISABLE_KERNELS)"
)

SHAPES = {  # heads, kv heads, head_dim, sliding window
    "smollm2": (9, 3, 64, None),
    "tiny": (4, 2, 16, None),
    "gqa8-d128": (8, 1, 128, None),
    "mha-window": (4, 4, 32, 20),
}


def _step(dtype: torch.dtype, heads: int, kvh: int, dim: int, window: int | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    bs, nb, layers = 16, 64, 2
    cache = torch.randn(nb, layers, 2, bs, kvh, dim, generator=g).to(dtype)
    rope = Rope(dim, 10000.0, None, 2048, dtype, torch.device("cpu"))
    blocks = list(range(nb))
    random.Random(seed).shuffle(blocks)
    # decodes at context 1, 16, 17 and 300; a fresh prefill and one continuing after a prefix
    decodes = [(blocks[0:20], 0), (blocks[20:40], 15), (blocks[40:60], 16), (blocks[0:20], 299)]
    prefills = [(blocks[20:40], 0, 17), (blocks[40:60], 40, 33)]
    md = build_metadata(bs, decodes, prefills, window, torch.device("cpu"))
    qkv = torch.randn(md.num_tokens, (heads + 2 * kvh) * dim, generator=g).to(dtype)
    return cache, rope, md, qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_rope_store_and_attention_match_torch(dtype: torch.dtype, shape: str) -> None:
    heads, kvh, dim, window = SHAPES[shape]
    cache, rope, md, qkv = _step(dtype, heads, kvh, dim, window)
    c_k, c_t, q_k, q_t = cache.clone(), cache.clone(), qkv.clone(), qkv.clone()
    step = KernelStep(
        c_k,
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
    lib.rope_store(step.ptr, 1, q_k.data_ptr(), q_k.stride(0))
    out_k = paged_attention(q_k, heads, c_k, 1, md, lib, step.ptr, kernel_prefill=True)
    cos, sin = rope.tables(md.positions)
    rope.store_torch(q_t, heads, c_t, 1, md.slot_block, md.slot_offset, cos, sin)
    out_t = paged_attention(q_t, heads, c_t, 1, md, None, 0, kernel_prefill=False)
    assert torch.equal(q_k, q_t), "rotary embedding differs from the torch path"
    assert torch.equal(c_k, c_t), "K/V written to different slots or values"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_k.float(), out_t.float(), atol=tol, rtol=tol)


def test_fp32_decode_kernel_with_sdpa_prefill_matches_torch() -> None:
    """The fp32 engine path: kernel for decodes, SDPA for prefill chunks."""
    heads, kvh, dim, window = SHAPES["smollm2"]
    cache, rope, md, qkv = _step(torch.float32, heads, kvh, dim, window, seed=1)
    step = KernelStep(
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
    lib.rope_store(step.ptr, 0, qkv.data_ptr(), qkv.stride(0))
    mixed = paged_attention(qkv, heads, cache, 0, md, lib, step.ptr, kernel_prefill=False)
    torch_only = paged_attention(qkv, heads, cache, 0, md, None, 0, kernel_prefill=False)
    torch.testing.assert_close(mixed, torch_only, atol=1e-5, rtol=1e-5)
    assert torch.equal(mixed[md.num_decode :], torch_only[md.num_decode :])


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of bf16 precision at each element's magnitude."""
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-30)
    return float(((a.float() - b.float()).abs() / scale).max() * 2**8)


@pytest.mark.parametrize("rows,n", [(1, 576), (37, 576), (300, 64), (3, 40)])
def test_bf16_norm_and_silu_kernels(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, n, generator=g).bfloat16()
    d = torch.randn(rows, n, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(n, generator=g)).bfloat16()
    eps = 1e-5
    out = torch.empty_like(h)
    lib.rms_norm_bf16(h.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, eps)
    assert _ulps(out, _hf_rms_norm(h, w, eps)) <= 2
    h2 = h.clone()
    lib.add_rms_norm_bf16(h2.data_ptr(), d.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, eps)
    assert torch.equal(h2, h + d)
    assert _ulps(out, _hf_rms_norm(h + d, w, eps)) <= 2
    gu = (3 * torch.randn(rows, 2 * n, generator=g)).bfloat16()
    act = torch.empty(rows, n, dtype=torch.bfloat16)
    lib.silu_mul_bf16(gu.data_ptr(), act.data_ptr(), rows, n)
    assert _ulps(act, F.silu(gu[:, :n]) * gu[:, n:]) <= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_argmax_rows_matches_torch_first_maximum(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 1000, generator=g).to(dtype)  # 1000: a tail past the last 16-lane vector
    x[1, 10] = x[1, 900] = x[1].max() + 1  # a tie: the first index wins
    x[2] = float("-inf")
    x[3, 999] = 50.0  # the max in the scalar tail
    x[4, 5] = float("nan")  # torch treats NaN as the maximum
    idx = torch.empty(7, dtype=torch.long)
    lib.argmax_rows(
        x.data_ptr(), x.stride(0), 7, 1000, int(dtype == torch.bfloat16), idx.data_ptr()
    )
    assert idx.tolist() == x.argmax(dim=-1).tolist()


def _long_prefill_step(
    dtype: torch.dtype, heads: int, kvh: int, dim: int, window: int | None, spike: bool = False
):
    """Decodes beside three prefill chunks that cross many 32-key steps: a fresh 100-token prompt,
    70 tokens after a 203-token cached prefix, and a single token after 40 (a 1-row work item).
    `spike`: the keys of later blocks are 10x larger, so scores jump past a row's running max
    after its first steps (the accumulator must be rescaled)."""
    g = torch.Generator().manual_seed(7)
    bs, nb = 16, 96
    cache = torch.randn(nb, 1, 2, bs, kvh, dim, generator=g).to(dtype)
    if spike:
        cache[torch.arange(nb) % 3 == 2, :, 0] *= 10
    rope = Rope(dim, 10000.0, None, 2048, dtype, torch.device("cpu"))
    blocks = list(range(nb))
    random.Random(7).shuffle(blocks)
    decodes = [(blocks[0:8], 77), (blocks[60:80], 250)]
    prefills = [(blocks[8:16], 0, 100), (blocks[16:36], 203, 70), (blocks[36:40], 40, 1)]
    md = build_metadata(bs, decodes, prefills, window, torch.device("cpu"))
    qkv = torch.randn(md.num_tokens, (heads + 2 * kvh) * dim, generator=g).to(dtype)
    step = KernelStep(
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
    lib.rope_store(step.ptr, 0, qkv.data_ptr(), qkv.stride(0))
    return cache, md, qkv, step


#: head_dim 64 keeps the output accumulator in tiles; 32, 96 and 128 pass it through memory in
#: slices of 2, 4 + 2 and 4 + 4 tiles
AMX_SHAPES = {**SHAPES, "d32": (4, 2, 32, None), "d96": (6, 2, 96, None)}


@pytest.mark.parametrize("spike", [False, True], ids=["plain", "spiked-keys"])
@pytest.mark.parametrize("shape", ["smollm2", "gqa8-d128", "d32", "d96"])
def test_amx_prefill_attention_matches_torch(shape: str, spike: bool) -> None:
    """The AMX tile path (flash-style, 32 keys a step) against SDPA over the same pool: causal
    inside a chunk, the whole cached prefix before it, partial key steps and 1..16-row blocks."""
    from engine.cpu import cpu_flags

    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        pytest.skip(
            "no AMX bf16 on this CPU (prefill_attention_amx returns 1 there; the AVX-512 path runs)"
        )
    heads, kvh, dim, window = AMX_SHAPES[shape]
    cache, md, qkv, step = _long_prefill_step(torch.bfloat16, heads, kvh, dim, window, spike)
    nd, t = md.num_decode, md.num_tokens
    out = torch.zeros((t - nd, heads * dim), dtype=torch.bfloat16)
    rc = lib.prefill_attention_amx(
        step.ptr, 0, nd, t - nd, qkv.data_ptr(), qkv.stride(0), out.data_ptr(), heads * dim
    )
    assert rc == 0, "the AMX path declined a bf16 step it supports"
    want = paged_attention(qkv, heads, cache, 0, md, None, 0, kernel_prefill=False)[nd:]
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    # the engine's entry point takes the same path
    got = paged_attention(qkv, heads, cache, 0, md, lib, step.ptr, kernel_prefill=True)[nd:]
    assert torch.equal(got, out)


def test_amx_prefill_attention_declines_what_it_does_not_do() -> None:
    """fp32, a sliding window and a head_dim that is not a multiple of 32 return 1 (the caller's
    other paths run) on every CPU."""
    for dtype, shape in (
        (torch.float32, "smollm2"),
        (torch.bfloat16, "mha-window"),
        (torch.bfloat16, "tiny"),
    ):
        heads, kvh, dim, window = SHAPES[shape]
        _cache, md, qkv, step = _long_prefill_step(dtype, heads, kvh, dim, window)
        nd, t = md.num_decode, md.num_tokens
        out = torch.zeros((t - nd, heads * dim), dtype=dtype)
        rc = lib.prefill_attention_amx(
            step.ptr, 0, nd, t - nd, qkv.data_ptr(), qkv.stride(0), out.data_ptr(), heads * dim
        )
        assert rc == 1, (dtype, shape)
        assert not out.any(), "a declined call wrote output"
