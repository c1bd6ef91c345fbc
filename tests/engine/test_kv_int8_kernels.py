"""The CPU kernels over an int8 KV pool (engine/kernels/attention_int8.h, rope_store.c).

What each must hold:
- rope_store into an int8 pool writes the bytes engine/kv_quant.py's quantizer writes (values and
  scales), bitwise, at every ISA level;
- paged attention over the int8 pool equals attention over the pool dequantized (fp32 math in the
  test) within fp32 rounding (fp32 steps: the kernel scales the dot products, the reference the
  rows) or one bf16 rounding (bf16 steps); every token of a mixed step is checked (prefill tokens
  too: prefill_attention hands an int8 pool to the per-token path);
- the engine's own split (decodes and a chunk after a cached prefix on the kernel, a fresh chunk on
  SDPA) against the torch path;
- the AVX2 + FMA path against the portable C, within fp32 rounding of each other.
"""

from __future__ import annotations

import platform

import pytest
import torch

from engine import kv_quant
from engine.attention import AttentionMetadata, paged_attention
from engine.kernel_step import KernelStep
from engine.kernels import kernels_lib
from engine.rope import Rope
from tests.engine import isa
from tests.engine.test_kernels import SHAPES, _step

lib = kernels_lib()
pytestmark = pytest.mark.skipif(
    lib is None, reason="kernels unavailable (no C compiler, or DUET_DISABLE_KERNELS)"
)
DTYPES = [torch.float32, torch.bfloat16]


def _int8_step(dtype: torch.dtype, shape: str, seed: int = 3):
    """A mixed step (decodes at several contexts, a fresh prefill, one after a cached prefix) over
    an int8 pool quantized from random rows, whose scales span three decades."""
    heads, kvh, dim, window = SHAPES[shape]
    cache, rope, md, qkv = _step(dtype, heads, kvh, dim, window, seed=seed)
    g = torch.Generator().manual_seed(seed)
    n = cache.shape[3] * kvh
    spread = torch.logspace(-2, 1, n)[torch.randperm(n, generator=g)].view(-1, kvh, 1)
    rows = cache.float() * spread
    return kv_quant.quantize(rows), rope, md, qkv


def _kstep(cache: torch.Tensor, md: AttentionMetadata, rope: Rope, heads: int) -> KernelStep:
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
        md.sliding_window,
    )


def _reference(qkv: torch.Tensor, heads: int, cache: torch.Tensor, md: AttentionMetadata):
    """Every token's attention over the dequantized pool (layer 1), in fp32: [T, heads * dim]."""
    kvh, dim = cache.shape[4], kv_quant.head_dim(cache)
    pool = kv_quant.dequantize(cache[:, 1], torch.float32)  # [blocks, 2, bs, kvh, dim]
    q = qkv[:, : heads * dim].float().view(-1, heads, dim)
    out = torch.empty(q.shape[0], heads * dim)
    for t in range(q.shape[0]):
        ctx = int(md.ctx_lens[t])
        start = max(0, ctx - md.sliding_window) if md.sliding_window else 0
        blocks = md.block_tables[int(md.token_row[t])]
        k = pool[blocks, 0].flatten(0, 1)[start:ctx].repeat_interleave(heads // kvh, 1)
        v = pool[blocks, 1].flatten(0, 1)[start:ctx].repeat_interleave(heads // kvh, 1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[t], k) * dim**-0.5, -1)
        out[t] = torch.einsum("hk,khd->hd", p, v).flatten()
    return out


def _run(lib, cache, rope, md, qkv, heads: int, kernel_prefill: bool = True):
    """rope_store then attention through `lib`: (qkv after rope, the pool, the output)."""
    cache, qkv = cache.clone(), qkv.clone()
    step = _kstep(cache, md, rope, heads)
    lib.rope_store(step.ptr, 1, qkv.data_ptr(), qkv.stride(0))
    out = paged_attention(qkv, heads, cache, 1, md, lib, step.ptr, kernel_prefill)
    return qkv, cache, out


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, cache: torch.Tensor) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(a.float(), b.float(), atol=2e-5, rtol=1e-4)
    else:  # bf16 roundings of q, the weights, the output (and torch's of K/V): 2^-8 of max|V|
        vmax = kv_quant.dequantize(cache[:, 1, 1], torch.float32).abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), atol=2**-8 * vmax, rtol=2**-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_store_bytes_and_attention_match_the_dequantized_pool(
    dtype: torch.dtype, shape: str
) -> None:
    heads = SHAPES[shape][0]
    cache, rope, md, qkv = _int8_step(dtype, shape)
    q_k, c_k, out = _run(lib, cache, rope, md, qkv, heads)
    q_t, c_t = qkv.clone(), cache.clone()
    cos, sin = rope.tables(md.positions)
    rope.store_torch(q_t, heads, c_t, 1, md.slot_block, md.slot_offset, cos, sin)
    assert torch.equal(q_k, q_t), "rotary embedding differs from the torch path"
    assert torch.equal(c_k, c_t), "int8 rows or scales differ from engine/kv_quant.py's"
    assert not torch.equal(c_k, cache), "the step's K/V were not stored"
    _close(out, _reference(q_k, heads, c_k, md), dtype, c_k)


def _chunk_on(lib_, c_k, md, rope, q_k, heads: int, p) -> torch.Tensor:
    """prefill_attention of `lib_` for chunk `p` alone: [q_len, heads * dim]."""
    step = _kstep(c_k, md, rope, heads)
    o = torch.empty((p.q_len, heads * kv_quant.head_dim(c_k)), dtype=q_k.dtype)
    lib_.prefill_attention(
        step.ptr, 1, p.q_start, p.q_len, q_k.data_ptr(), q_k.stride(0), o.data_ptr(), o.stride(0)
    )
    return o


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_engine_split_matches_the_torch_path(dtype: torch.dtype) -> None:
    """What the engine runs for an int8 pool: decodes and a chunk after a cached prefix on the
    int8 kernels (the chunk through prefill_attention: its rows widened once for the query
    blocks where a float pool would take them, else read in place per token), a fresh chunk on
    SDPA over its own unquantized K/V. The fresh chunk's rows equal the torch path's, the others
    are within rounding of it (the same rows in the activation dtype on SDPA), and the chunk
    after a prefix is the kernel's own answer, bit for bit."""
    heads = SHAPES["smollm2"][0]
    cache, rope, md, qkv = _int8_step(dtype, "smollm2", seed=5)
    q_k, c_k, mixed = _run(lib, cache, rope, md, qkv, heads, kernel_prefill=False)
    torch_only = paged_attention(q_k, heads, c_k, 1, md, None, 0, kernel_prefill=False)
    nd = md.num_decode
    fresh, after = md.prefills
    assert fresh.start_pos == 0 and after.start_pos > 0
    f = slice(fresh.q_start, fresh.q_start + fresh.q_len)
    a = slice(after.q_start, after.q_start + after.q_len)
    assert torch.equal(mixed[f], torch_only[f])
    _close(mixed[:nd], torch_only[:nd], dtype, c_k)
    _close(mixed[a], torch_only[a], dtype, c_k)
    kernel = _chunk_on(lib, c_k, md, rope, q_k, heads, after)
    assert torch.equal(mixed[a], kernel), "the chunk after a prefix ran on SDPA"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 ISA levels")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("march", [isa.AVX2, isa.PORTABLE, "native"])
def test_chunk_after_a_prefix_on_each_build(dtype: torch.dtype, march: str) -> None:
    """A chunk after a cached prefix through each build's prefill_attention (the AVX2 build's
    query blocks over the widened rows, the portable per-token path, this CPU's own) against
    attention over the pool dequantized to the activation dtype (SDPA on the torch path; in
    bf16, where the build attends per token with K in fp32, fp32 attention over the dequantized
    pool) and, in fp32, the per-token int8 kernel of the same build."""
    lib_ = lib if march == "native" else isa.library(march)
    heads = SHAPES["smollm2"][0]
    cache, rope, md, qkv = _int8_step(dtype, "smollm2", seed=7)
    q_k, c_k, _ = _run(lib_, cache, rope, md, qkv, heads, kernel_prefill=False)
    after = md.prefills[1]
    a = slice(after.q_start, after.q_start + after.q_len)
    torch_only = paged_attention(q_k, heads, c_k, 1, md, None, 0, kernel_prefill=False)
    got = _chunk_on(lib_, c_k, md, rope, q_k, heads, after)
    if dtype == torch.float32 or march == isa.AVX2:  # AVX2: query blocks in both dtypes
        _close(got, torch_only[a], dtype, c_k)
    else:  # the query blocks round the widened rows to bf16 as SDPA's do; per token, K stays fp32
        try:
            _close(got, torch_only[a], dtype, c_k)
        except AssertionError:
            _close(got, _reference(q_k, heads, c_k, md)[a], dtype, c_k)
    if dtype == torch.float32:
        step = _kstep(c_k, md, rope, heads)
        per_token = torch.empty_like(got)
        lib_.paged_attention(
            step.ptr,
            1,
            after.q_start,
            after.q_len,
            q_k.data_ptr(),
            q_k.stride(0),
            per_token.data_ptr(),
            per_token.stride(0),
        )
        _close(got, per_token, dtype, c_k)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 ISA levels")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_avx2_against_the_portable_path(dtype: torch.dtype, shape: str) -> None:
    heads = SHAPES[shape][0]
    cache, rope, md, qkv = _int8_step(dtype, shape, seed=11)
    q2, c2, o2 = _run(isa.library(isa.AVX2), cache, rope, md, qkv, heads)
    q1, c1, o1 = _run(isa.library(isa.PORTABLE), cache, rope, md, qkv, heads)
    assert torch.equal(q2, q1) and torch.equal(c2, c1), "int8 rows stored differently"
    # fp32: the same products summed in other orders (V up to ~40 here); bf16: AVX2 rounds the V
    # weights to bf16, the portable C keeps them fp32
    _close(o2, o1, dtype, c2)
