"""bf16 linear layers on an x86 CPU oneDNN's bf16 reorder does not support (AVX2 only: Zen 3,
Haswell…): linear_bf16.c's AVX2 path where the kernels are built for it, else F.linear, by choice,
not a fallback — strict mode (CI=true) must not refuse it, as it
did on a Zen 3 EPYC, failing every bf16 engine test and every `--dtype bfloat16` node. On a CPU
that has the ISA, prepacking is still attempted (and still an error in strict mode if it fails).
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.linear as linear

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86 ISA rule")

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
ZEN4 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch):
    def use(flags: frozenset[str]) -> None:
        monkeypatch.setattr(linear, "cpu_flags", lambda: flags)
        linear.cpu_can_prepack_bf16.cache_clear()

    monkeypatch.setenv("CI", "true")  # strict: a real fallback would raise
    yield use
    linear.cpu_can_prepack_bf16.cache_clear()


def test_an_avx2_cpu_runs_bf16_layers_on_f_linear_even_in_strict_mode(cpu) -> None:
    cpu(AVX2_ONLY)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 32, generator=g).bfloat16(), torch.randn(3, 32, generator=g).bfloat16()
    layer = linear.Linear(w)
    assert layer.packed is None
    from engine.kernels import kernels_lib

    lib = kernels_lib()
    if lib is not None and lib.qgemm_bf16_isa() == 3 and linear.avx2_bf16_layers():
        # kernels built for AVX2: linear_bf16.c's AVX2 path (bf16 weights widened to fp32), one
        # rounding of the fp32 sum to bf16
        assert layer.panels is not None
        want = (x.double() @ w.double().T).float()
        assert ((layer(x).float() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()
    else:
        assert layer.weight is w and torch.equal(layer(x), F.linear(x, w))


def test_a_cpu_with_the_isa_still_prepacks() -> None:
    linear.cpu_can_prepack_bf16.cache_clear()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(linear, "cpu_flags", lambda: ZEN4)
        assert linear.cpu_can_prepack_bf16()
        m.setattr(linear, "cpu_flags", lambda: AVX2_ONLY | {"avx_ne_convert"})
        linear.cpu_can_prepack_bf16.cache_clear()
        assert linear.cpu_can_prepack_bf16()
    linear.cpu_can_prepack_bf16.cache_clear()


def test_prefill_attention_runs_on_a_kernel_only_where_a_blocked_path_exists(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocked prefill kernels are AVX-512 BF16 code (bf16) and AVX2 code (fp32 and bf16, CPUs
    without AVX-512); elsewhere prefill_attention is the per-token loop, slower than SDPA, so SDPA
    prefills there and the decode kernel still decodes."""
    import engine.model as model
    from engine import LLM
    from engine.kernels import kernels_lib

    if kernels_lib() is None:
        pytest.skip("no kernels here")
    skylake = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    cases = [
        (AVX2_ONLY, "bfloat16", True),
        (AVX2_ONLY, "float32", True),
        (ZEN4, "bfloat16", True),
        (ZEN4, "float32", False),
        (skylake, "bfloat16", False),
    ]
    for flags, dtype, want in cases:
        monkeypatch.setattr(model, "cpu_flags", lambda flags=flags: flags)
        m = LLM(str(tiny_llama), dtype=dtype, max_model_len=128).engine.runner.model
        assert (m.fused or m.fused32, m.kernel_prefill) == (True, want), (sorted(flags), dtype)
