"""fp32 logits (issue 25): the lm_head kernel against an fp64 reference, its decode and batched
paths bitwise equal, the portable build, and on SmolLM2 the point of it all: bf16 greedy agrees
with fp32 greedy at least as often as transformers' bf16 does."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import engine.kernels
from engine import LLM, SamplingParams
from engine.kernels import kernels_lib
from engine.logits_head import LogitsHead
from engine.quant import quantize

lib = kernels_lib()
needs_kernels = pytest.mark.skipif(lib is None, reason="kernels unavailable (no C compiler, or DUET_DISABLE_KERNELS)")


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@needs_kernels
@pytest.mark.parametrize(("n", "k"), [(49152, 576), (37, 100), (1000, 64)])
def test_bf16_head_is_fp32_accurate_and_batch_invariant(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(7, k, generator=g).bfloat16()
    head = LogitsHead(w)
    got = head(x)
    assert got.dtype == torch.float32 and got.shape == (7, n)
    ref = _ref(x, w)
    # fp32 accumulation of exact products: errors of k fp32 roundings, far below one bf16 ulp
    tol = 1e-6 * k * (x.float().abs() @ w.float().abs().T)
    assert ((got - ref).abs() <= tol).all()
    for r in range(7):  # a row's logits do not depend on the rows batched with it
        assert torch.equal(head(x[r : r + 1]), got[r : r + 1])


@needs_kernels
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_head_stores_the_fp32_accumulator(scheme: str) -> None:
    g = torch.Generator().manual_seed(1)
    qw = quantize(torch.randn(300, 128, generator=g), scheme)
    x = torch.randn(3, 128, generator=g).bfloat16()
    head = LogitsHead(qw)
    got = head(x)
    assert got.dtype == torch.float32
    from engine.quant import dequantize

    ref = _ref(x, dequantize(qw))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    # not rounded to bf16: some values are not representable in bf16
    assert not torch.equal(got, got.bfloat16().float())


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_portable_build_matches_reference(tmp_path: Path) -> None:
    """The C path a CPU without AVX-512 compiles, and the avx512f path without bf16 dot products."""
    kdir = Path(engine.kernels.__file__).parent
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 96, generator=g).bfloat16()
    x = torch.randn(5, 96, generator=g).bfloat16()
    for march in ("x86-64-v2", "skylake-avx512"):
        so = tmp_path / f"{march}.so"
        subprocess.run(["gcc", "-O2", f"-march={march}", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off",
                        f"-I{kdir}", str(kdir / "logits_bf16.c"), "-o", str(so), "-lm"], check=True)  # fmt: skip
        plib = ctypes.CDLL(str(so))
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        plib.logits_bf16.argtypes = [p, i64, i32, i32, p, i64, p, i64]
        out = torch.empty(5, 70)
        plib.logits_bf16(x.data_ptr(), 96, 5, 96, w.data_ptr(), 70, out.data_ptr(), 70)
        torch.testing.assert_close(out, _ref(x, w), rtol=1e-5, atol=1e-4)


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "What is 12 times 7?",
    "Name the planets of the solar system.",
    "Why is the sky blue?",
    "Suggest a name for a black cat.",
    "How do I reverse a list in Python?",
]


def _agreement(ref: list[list[int]], got: list[list[int]]) -> int:
    """Tokens generated before the first divergence, summed over the prompts."""
    return sum(next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
               for r, o in zip(ref, got, strict=True))  # fmt: skip


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The comparison at a fixed intra-op thread count: an earlier test's engine may have left
    torch at one thread (EngineCore sets the process-wide count), and a bf16 sum's order —
    so which of two tied logits wins — follows the thread count (81 vs 85 in a full run, 89 vs
    85 alone, both engines in the same process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.smollm2
@pytest.mark.usefixtures("two_threads")
def test_bf16_greedy_agrees_with_fp32_at_least_as_often_as_transformers_bf16(smollm2: Path) -> None:
    from transformers import AutoModelForCausalLM

    n_new = 16
    fp32 = LLM(str(smollm2), dtype="float32", max_model_len=256)
    prompts = [fp32.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in fp32.generate(prompts, params)]
    del fp32
    bf16 = LLM(str(smollm2), dtype="bfloat16", max_model_len=256)
    ours = [o.token_ids for o in bf16.generate(prompts, params)]
    paris = bf16.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=0))[0].text
    assert "Paris" in paris, paris
    del bf16
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16).eval()
    theirs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
            theirs.append(out[0, len(p) :].tolist())
    ours_agree, theirs_agree = _agreement(ref, ours), _agreement(ref, theirs)
    print(f"tokens before divergence from fp32 greedy: engine bf16 {ours_agree}, transformers bf16 {theirs_agree} "
          f"of {n_new * len(prompts)}")  # fmt: skip
    assert ours_agree >= theirs_agree
