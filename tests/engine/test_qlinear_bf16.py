"""The weight-only linears' bf16 GEMM path (engine/kernels/qgemm_bf16.h) for large bf16 batches.

Checked against `bf16_gemm_reference` (the same arithmetic in torch: int8 q exact, int4 weights
rounded to bf16, fp32 sums, one rounding) to one bf16 rounding, against the small-batch fp32
path within bf16 tolerance, on every path this CPU runs (AMX and AVX-512 BF16 here) and in the
builds a CPU without them compiles (the entry points then refuse, and QLinear keeps the fp32
path). QLinear must route a batch of BF16_GEMM_MIN_ROWS rows to this path and a smaller one to
the fp32 path, so both are exercised.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import engine.kernels
from engine.kernels import kernels_lib
from engine.qlinear import (
    BF16_GEMM_MIN_ROWS,
    GEMM_AVX2,
    QLinear,
    bf16_gemm_isa,
    bf16_gemm_reference,
)
from engine.quant import dequantize, quantize
from tests.engine.isa import skip_unless_runs_here

lib = kernels_lib()
isa = bf16_gemm_isa()
needs_path = pytest.mark.skipif(
    isa == 0, reason="no bf16 GEMM path here (no kernels, or no AMX / AVX-512 BF16)"
)
#: (scheme, out, in): SmolLM2's qkv / down, rows and k not multiples of 16 / 32, int4 groups of 64
CASES = [
    ("int8", 960, 576),
    ("int8", 576, 1536),
    ("int8", 100, 200),
    ("int8", 37, 40),
    ("int4", 960, 576),
    ("int4", 70, 128),
    ("int4-g64", 100, 192),
]


def _within_ulp(got: torch.Tensor, ref: torch.Tensor) -> None:
    """One bf16 rounding of the fp32 result, plus fp32 order noise at a rounding boundary."""
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
    err = (got.float() - ref).abs()
    assert (err <= ulp).all(), (
        f"max error {err.max()} (at |ref| {ref.flatten()[err.argmax()].abs()})"
    )


def _paths() -> list[int]:
    if isa == GEMM_AVX2:
        return [isa]
    return [p for p in (1, 2) if p <= isa]


@needs_path
@pytest.mark.parametrize(("scheme", "n", "k"), CASES, ids=[f"{s}-{n}x{k}" for s, n, k in CASES])
def test_bf16_path_matches_its_reference(scheme: str, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    qw = quantize(torch.randn(n, k, generator=g) * 0.05, scheme)
    for bias in (None, torch.randn(n, generator=g).bfloat16()):
        lin = QLinear(qw, bias)
        b = 0 if bias is None else bias.data_ptr()
        for m in (17, 200) if n * k < 200_000 else (16, 45):
            wide = torch.randn(m, k + 24, generator=g).bfloat16()
            x = wide[:, 8 : 8 + k]  # strided rows
            ref = bf16_gemm_reference(x, qw, bias, torch.float32)
            for path in _paths():
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
                assert lin._bf16_gemm(x, m, k, b, out, 0, path) == 0
                _within_ulp(out, ref)
            if bias is None:  # the fp32 logits form (out_f32)
                out32 = torch.empty(m, n)
                assert lin._bf16_gemm(x, m, k, 0, out32, 1) == 0
                torch.testing.assert_close(
                    out32, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()
                )


@needs_path
def test_an_output_larger_than_l2_matches_its_reference() -> None:
    """400 x 3072 bf16 outputs (2.4 MiB) take the non-temporal 64-byte stores of whole blocks;
    n = 3050 leaves a partial last block on the per-16 stores."""
    g = torch.Generator().manual_seed(3)
    for n in (3072, 3050):
        qw = quantize(torch.randn(n, 576, generator=g) * 0.05, "int8")
        bias = torch.randn(n, generator=g).bfloat16()
        lin = QLinear(qw, bias)
        x = torch.randn(400, 576, generator=g).bfloat16()
        ref = bf16_gemm_reference(x, qw, bias, torch.float32)
        for path in _paths():
            out = torch.full((400, n), float("nan"), dtype=torch.bfloat16)
            assert lin._bf16_gemm(x, 400, 576, bias.data_ptr(), out, 0, path) == 0
            _within_ulp(out, ref)


@needs_path
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_large_and_small_batches_agree_and_both_paths_run(
    scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, k = 576, 1536
    g = torch.Generator().manual_seed(1)
    qw = quantize(torch.randn(n, k, generator=g) * 0.05, scheme)
    lin = QLinear(qw, torch.randn(n, generator=g).bfloat16())
    assert lin.bf16_min_rows == BF16_GEMM_MIN_ROWS > 1
    m = BF16_GEMM_MIN_ROWS
    x = torch.randn(m, k, generator=g).bfloat16()
    calls: list[int] = []
    real = QLinear._bf16_gemm
    monkeypatch.setattr(
        QLinear, "_bf16_gemm", lambda self, *a: calls.append(a[1]) or real(self, *a)
    )
    large = lin(x)  # the bf16 GEMM path
    assert calls == [m]
    small = torch.cat(
        [lin(x[i : i + m - 1]) for i in range(0, m, m - 1)]
    )  # the fp32 path (m - 1, then 1 row)
    assert calls == [m]
    one = torch.cat([lin(x[i : i + 1]) for i in range(m)])
    assert torch.equal(small, one)  # below the threshold: bitwise the single-stream result
    ref = large.float().abs().max().item()
    assert (
        large.float() - small.float()
    ).abs().max().item() <= 2e-2 * ref  # int4: its weights rounded to bf16
    if (
        scheme == "int8"
    ):  # q exact in bf16: only the order of the fp32 sums and the one rounding differ
        _within_ulp(large, bf16_gemm_reference(x, qw, lin.bias, torch.float32))
        _within_ulp(small, bf16_gemm_reference(x, qw, lin.bias, torch.float32))


@needs_path
def test_fp32_activations_keep_the_fp32_path() -> None:
    """The bf16 path would round fp32 activations: an fp32 model keeps fp32 arithmetic."""
    qw = quantize(torch.randn(64, 128), "int8")
    lin = QLinear(qw)
    x = torch.randn(32, 128)
    if lin.gemm_fp32:
        # AVX2's GEMM path takes fp32 rows as they are (fp32 panels): fp32 accuracy, which a
        # rounding of x to bf16 (~2^-9) would miss by far
        want = (x.double() @ dequantize(qw).double().T).float()
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        return
    torch.testing.assert_close(
        lin(x), torch.cat([lin(x[i : i + 1]) for i in range(32)]), rtol=0, atol=0
    )


#: -march → the path that build runs on a CPU with every feature it was built for
#: (the native build of the other tests is the AMX one on an AMX machine)
BUILDS = {"x86-64-v2": 0, "x86-64-v3": GEMM_AVX2, "skylake-avx512": 0, "cooperlake": 1}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("march", list(BUILDS))
def test_other_builds(march: str, tmp_path: Path) -> None:
    """What CPUs without AMX (Zen 4, Cooper Lake: AVX-512 BF16) or without bf16 at all compile:
    the path is there and correct, or the entry point refuses (-3) so QLinear keeps fp32."""
    skip_unless_runs_here(march)
    kdir = Path(engine.kernels.__file__).parent
    so = tmp_path / f"{march}.so"
    subprocess.run(
        [
            "gcc",
            "-O2",
            f"-march={march}",
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
    plib.qlinear_int8_bf16.argtypes = [p, i64, i32, i32, p, p, i64, p, p, i64, i32, i32]
    plib.qlinear_int4_bf16.argtypes = [p, i64, i32, i32, p, p, p, i32, i64, p, p, i64, i32, i32]
    plib.qgemm_bf16_isa.restype = i32
    want = BUILDS[march]
    have = plib.qgemm_bf16_isa()
    assert have == want
    n, k, m = 70, 128, 20
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=g).bfloat16()
    for scheme in ("int8", "int4"):
        qw = quantize(torch.randn(n, k, generator=g), scheme)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        head = (x.data_ptr(), k, m, k, qw.q.data_ptr(), qw.scales.data_ptr())
        tail = (n, None, out.data_ptr(), n, 0, 0)
        rc = (
            plib.qlinear_int8_bf16(*head, *tail)
            if scheme == "int8"
            else plib.qlinear_int4_bf16(*head, qw.mins.data_ptr(), qw.group, *tail)
        )
        if have == 0:
            assert rc == -3
        else:
            assert rc == 0
            _within_ulp(out, bf16_gemm_reference(x, qw, None, torch.float32, isa=have))


TOPICS = [
    "the capital of France",
    "how a bicycle works",
    "photosynthesis",
    "the moon landing",
    "prime numbers",
    "the water cycle",
    "how to bake bread",
    "why the sky is blue",
    "the French revolution",
    "volcanoes",
    "black holes",
    "the internet",
    "honey bees",
    "the Roman empire",
    "electric cars",
    "chess openings",
]


@pytest.mark.smollm2
@needs_path
def test_engine_greedy_is_stable_against_the_fp32_path(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2 in bf16 with int8 weights: 16 prompts at once (prefill and every decode step at
    >= 16 rows, on the bf16 GEMM path) against the same engine with that path off (the fp32
    tile path every batch took before). q is exact in bf16, so only the order of fp32 sums
    differs: greedy output may part only at a near-tie."""
    import engine.qlinear
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    n_new = 12
    params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    rows: list[int] = []
    real = QLinear._bf16_gemm
    monkeypatch.setattr(QLinear, "_bf16_gemm", lambda self, *a: rows.append(a[1]) or real(self, *a))
    llm = LLM(str(smollm2), dtype="bfloat16", quantization="int8", max_model_len=256)
    prompts = [
        llm.tokenizer.encode_chat([{"role": "user", "content": f"Explain {t} in two sentences."}])
        for t in TOPICS
    ]
    new = [o.token_ids for o in llm.generate(prompts, params)]
    del llm
    assert (
        rows and min(rows) >= BF16_GEMM_MIN_ROWS and max(rows) > 100
    )  # decode steps and prefill took it
    monkeypatch.setattr(engine.qlinear, "BF16_GEMM_MIN_ROWS", 1 << 30)
    rows.clear()
    llm = LLM(str(smollm2), dtype="bfloat16", quantization="int8", max_model_len=256)
    old = [o.token_ids for o in llm.generate(prompts, params)]
    assert not rows
    agree = sum(
        next((i for i, (a, b) in enumerate(zip(o, n, strict=True)) if a != b), n_new)
        for o, n in zip(old, new, strict=True)
    )
    print(
        f"tokens before divergence, bf16 GEMM path vs fp32 path: {agree} of {n_new * len(prompts)}"
    )
    assert agree >= 0.8 * n_new * len(prompts)  # 173 of 192 measured
