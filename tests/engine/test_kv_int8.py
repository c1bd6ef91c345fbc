"""The 8-bit KV pool (`--kv-cache-dtype int8`, engine/kv_quant.py): rows round-trip within half a
step of their scale, the pool holds more blocks in the same memory, the engine's output stays
close to the fp32 pool's, and a prefix hit, a spill to the host tier and back, and a digest
check all work on the int8 bytes (scales included). The CPU kernels store and read the int8 pool
(tests/engine/test_kv_int8_kernels.py checks them against the torch path): under strict mode an
int8 engine builds with no fallback, and its greedy decode equals the torch attention path's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, SamplingParams, kv_quant
from engine.core import EngineCore
from protocol.block_hash import block_hashes, domain_root
from protocol.kv_layout import KVLayout
from tests.engine.test_kv_digest import run

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [(7 * i) % 300 + 3 for i in range(53)]  # 3 full blocks of 16 and a 5-token tail


def engine(model: Path, kv: str, **kw: object) -> EngineCore:
    cfg = EngineConfig(model=str(model), dtype="float32", kv_cache_dtype=kv, **kw)  # type: ignore[arg-type]
    return EngineCore(cfg)


def test_rows_round_trip_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 3, 16, generator=g) * torch.logspace(-3, 2, 16)
    x[0, 0, 0] = 0.0  # an all-zero row: scale 0, read back as zeros
    rows = kv_quant.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (64, 2, 3, 20)
    back = kv_quant.dequantize(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((back - x).abs() <= step / 2 + 1e-7 * x.abs()).all())
    assert bool((back[0, 0, 0] == 0).all())
    assert back.dtype == torch.float32 and kv_quant.head_dim(rows) == 16


def test_layout_counts_the_scales_and_never_pairs_int8_with_float() -> None:
    def layout(dtype: str) -> KVLayout:
        return KVLayout(
            num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype, num_blocks=8
        )

    i8, bf, f32 = layout("int8"), layout("bfloat16"), layout("float32")
    assert i8.row_width == 68 and i8.block_bytes == 30 * 2 * 16 * 3 * 68
    assert i8.pool_shape == (8, 30, 2, 16, 3, 68)
    # SmolLM2's shape: 1.88x the blocks of bf16 in the same memory, 3.76x of fp32
    assert bf.block_bytes / i8.block_bytes == pytest.approx(128 / 68)
    assert f32.block_bytes / i8.block_bytes == pytest.approx(256 / 68)
    assert i8.compat_hash != bf.compat_hash
    assert i8.differences(bf) == ["dtype: int8 != bfloat16"]


def test_pool_holds_more_blocks_in_the_same_memory(tiny_llama: Path) -> None:
    f32 = engine(tiny_llama, "auto", kv_memory="1MiB")
    i8 = engine(tiny_llama, "int8", kv_memory="1MiB")
    assert i8.runner.kv_cache.dtype == torch.int8 and i8.runner.kv_layout.dtype == "int8"
    assert i8.pool_bytes.block_bytes == i8.runner.kv_layout.block_bytes
    # tiny llama: head_dim 16, so a row is 16 + 4 bytes against fp32's 64
    assert i8.pool.num_blocks == (2**20) // i8.runner.kv_layout.block_bytes
    assert i8.pool.num_blocks / f32.pool.num_blocks == pytest.approx(64 / 20, rel=0.01)


def test_kernels_decode_as_the_torch_path_under_strict_mode(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.kernels import kernels_lib

    if kernels_lib() is None:
        pytest.skip("no CPU kernels here")
    monkeypatch.setenv("CI", "true")  # a fallback would raise
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    on = engine(tiny_llama, "int8", num_kv_blocks=64)
    assert on.runner.model.kernels is not None and on.runner.model.kv_int8
    off = engine(tiny_llama, "int8", num_kv_blocks=64)
    off.runner.model.kernels = None  # the torch path whole (store and attention)
    for i in range(3):
        prompt = [(17 * j + 5 * i) % 290 + 4 for j in range(20 + 9 * i)]
        assert run(on, f"a{i}", prompt, params=params) == run(off, f"a{i}", prompt, params=params)


def test_fp8_is_refused_by_the_native_engine(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="fp8 is vLLM's"):
        engine(tiny_llama, "fp8", num_kv_blocks=64)


def test_prompt_logprobs_close_to_the_fp32_pool(tiny_llama: Path) -> None:
    """Chunks of 16 tokens, so every chunk after the first attends to int8 keys and values."""
    prompt = [(11 * i) % 290 + 5 for i in range(96)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    got = {}
    for kv in ("auto", "int8"):
        core = engine(tiny_llama, kv, num_kv_blocks=64, max_num_batched_tokens=16)
        core.add_request(kv, prompt, params)
        while core.scheduler.requests:
            for o in core.step()[0]:
                if o.prompt_logprobs is not None:
                    got[kv] = torch.tensor([t.logprob for t in o.prompt_logprobs if t is not None])
    diff = (got["auto"] - got["int8"]).abs()
    assert len(diff) == len(prompt) - 1
    # the first chunk attends to its own K/V (unquantized): the fp32 pool's values exactly
    assert float(diff[:15].max()) < 1e-5
    # later chunks read the int8 pool: logprobs within 0.1 nats, 0.025 on average (measured
    # 0.054 and ~0.01 on the tiny random model, whose logits are flat)
    assert 0 < float(diff[16:].max()) < 0.1, float(diff.max())
    assert float(diff[16:].mean()) < 0.025, float(diff[16:].mean())


def test_prefix_hit_spill_and_onload_on_int8(tiny_llama: Path, tmp_path: Path) -> None:
    core = engine(
        tiny_llama,
        "int8",
        num_kv_blocks=8,
        max_model_len=128,
        kv_host_bytes="1MiB",
        kv_disk_dir=str(tmp_path),
    )
    first = run(core, "a", PROMPT)
    assert run(core, "a-hit", PROMPT) == first
    assert core.kv.reused["pool"] == 48  # three full blocks reused from the pool
    # other prompts evict a's blocks into the host tier ...
    for i in range(2):
        run(core, f"b{i}", [(13 * j + i) % 280 + 9 for j in range(90)])
    assert core.tiers is not None and len(core.tiers) >= 3
    # ... whence they come back, checked against their digests (scales included)
    assert run(core, "a-host", PROMPT) == first
    assert core.kv.reused["host"] == 48
    assert core.kv.checks["host"] == 3 and not core.kv.mismatches


def test_a_flipped_scale_byte_is_caught(tiny_llama: Path) -> None:
    core = engine(tiny_llama, "int8", num_kv_blocks=64)
    first = run(core, "a", PROMPT)
    b = core.pool.lookup(block_hashes(PROMPT, 16, parent=domain_root(None))[0])
    assert b is not None
    # the scale of block b's first row (layer 0, K, token 0, head 0) is bytes 16..19
    core.pool_bytes.row(b)[17] ^= 0x40
    assert run(core, "a-again", PROMPT) == first
    assert core.kv.mismatches["pool"] == 1
