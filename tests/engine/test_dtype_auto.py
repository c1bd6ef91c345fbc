"""`--dtype auto` on the CPU: bf16 where it is faster than fp32 (bf16 arithmetic: AVX-512 BF16 or
AMX; or AVX2 + FMA without AVX-512, where the kernels store bf16 weights and widen them in
registers, for a checkpoint stored in bf16); fp32 elsewhere (no kernels, AVX-512 without BF16,
other architectures, DUET_BF16_LINEAR=onednn on AVX2, fp32 or fp16 weights on AVX2). A real engine
logs its choice and the reason."""

from __future__ import annotations

import logging
import platform
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import engine.dtype_choice as dc
from engine import LLM
from engine.kernels import kernels_lib

CPU = torch.device("cpu")
AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
SKYLAKE = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN4 = SKYLAKE | {"avx512_bf16", "avx512_vnni"}


@pytest.mark.parametrize(
    ("flags", "gemm_isa", "weights", "want"),
    [
        (ZEN4, 1, "bfloat16", torch.bfloat16),
        (AVX2_ONLY, 3, "bfloat16", torch.bfloat16),  # the kernels' AVX2 bf16-weight path
        (AVX2_ONLY, 3, "float32", torch.float32),  # rounding fp32 weights to bf16 is a loss
        (AVX2_ONLY, 3, "float16", torch.float32),
        (ZEN4, 1, "float32", torch.bfloat16),  # bf16 arithmetic: fast whatever the weights
        (AVX2_ONLY, None, "bfloat16", torch.float32),  # no kernels (DUET_DISABLE_KERNELS)
        (SKYLAKE, 0, "bfloat16", torch.float32),
        (frozenset(), None, "bfloat16", torch.float32),  # another architecture
    ],
)
def test_auto_picks_bf16_only_where_it_is_faster(
    monkeypatch: pytest.MonkeyPatch,
    flags: frozenset[str],
    gemm_isa: int | None,
    weights: str,
    want: torch.dtype,
) -> None:
    lib = None if gemm_isa is None else SimpleNamespace(qgemm_bf16_isa=lambda: gemm_isa)
    monkeypatch.setattr(dc, "cpu_flags", lambda: flags)
    monkeypatch.setattr(dc, "kernels_lib", lambda: lib)
    choice = dc.choose_dtype("auto", CPU, weights)
    assert choice.dtype == want and choice.reason.startswith("auto: ")
    # an explicit dtype is kept, whatever the CPU or the weights
    assert dc.choose_dtype("float32", CPU, weights).dtype == torch.float32
    assert dc.choose_dtype("bf16", CPU, weights).dtype == torch.bfloat16
    assert dc.choose_dtype("auto", torch.device("cuda"), weights).dtype == torch.bfloat16


def test_the_onednn_switch_takes_avx2_off_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dc, "cpu_flags", lambda: AVX2_ONLY)
    monkeypatch.setattr(dc, "kernels_lib", lambda: SimpleNamespace(qgemm_bf16_isa=lambda: 3))
    monkeypatch.setenv("DUET_BF16_LINEAR", "onednn")
    assert dc.choose_dtype("auto", CPU, "bfloat16").dtype == torch.float32


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        dc.choose_dtype("int3", CPU, "bfloat16")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 ISA levels")
def test_this_cpu_gets_what_its_path_allows_and_the_engine_says_why(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine logs what auto chose and why; on an AVX2-only CPU with the kernels, the tiny
    model (fp32 weights) stays fp32 and a bf16 checkpoint gets bf16."""
    with caplog.at_level(logging.INFO, logger="duet.engine"):
        eng = LLM(str(tiny_llama), threads=1).engine
    name = str(eng.dtype).removeprefix("torch.")
    assert any(r.getMessage().startswith(f"dtype {name} (auto: ") for r in caplog.records), (
        caplog.text
    )
    flags = dc.cpu_flags()
    if {"avx2", "fma"} <= flags and "avx512f" not in flags and kernels_lib() is not None:
        assert kernels_lib().qgemm_bf16_isa() == 3
        assert eng.dtype == torch.float32
        assert dc.choose_dtype("auto", CPU, "bfloat16").dtype == torch.bfloat16
