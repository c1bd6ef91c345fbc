"""fp32 logits: the lm_head kernel against an fp64 reference, its decode and batched
paths bitwise equal, the portable build, the fp32 residual stream's norm kernel against torch,
and on SmolLM2 the point of it all: bf16 greedy agrees with fp32 greedy at least as often as
transformers' bf16 does, and "What is the capital of France?" answers Paris in bf16 at 1, 2 and
4 threads, from the prefix cache, and through a real node's chat endpoint."""

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
from engine.cpu import cpu_flags
from engine.kernels import kernels_lib
from engine.logits_head import LogitsHead
from engine.quant import quantize
from tests.engine.isa import needs
from tests.procs import duet_node, running

lib = kernels_lib()
needs_kernels = pytest.mark.skipif(
    lib is None, reason="kernels unavailable (no C compiler, or DUET_DISABLE_KERNELS)"
)


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


_HAVE = 0 if lib is None else int(lib.logits_bf16_isa())
#: AMX and AVX-512 (1, 2), or the AVX2 halves of the AVX-512 blocks (3)
PATHS = [3] if _HAVE == 3 else [i for i in (1, 2) if i <= _HAVE]


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(("n", "k"), [(49152, 576), (37, 100), (1000, 64), (70, 33)])
def test_each_kernel_path_is_fp32_accurate_and_batch_invariant(isa: int, n: int, k: int) -> None:
    """Both paths the CPU has (2: AMX tiles over the weight rows as they lie, every m; 1: AVX-512
    blocks), odd shapes included (AMX stages a block that is not 32 whole rows of 32-k chunks):
    fp32-accurate, and a row's logits the same in a call of 1, 2, 5, 7 or 70 rows, bitwise (AVX-512:
    1 and 2 rows take block_rows_few, more take groups of 4 rows with a tail of 1, 2 or 3)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(70, k, generator=g).bfloat16()

    def call(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n)
        rc = lib.logits_bf16_path(
            rows.data_ptr(),
            rows.stride(0),
            rows.shape[0],
            k,
            w.data_ptr(),
            n,
            out.data_ptr(),
            n,
            isa,
        )
        assert rc == 0
        return out

    got = call(x)
    tol = 1e-6 * k * (x.float().abs() @ w.float().abs().T)
    assert ((got - _ref(x, w)).abs() <= tol).all()
    assert torch.equal(torch.cat([call(x[i : i + 1]) for i in range(70)]), got)
    for size in (2, 5, 7):
        assert torch.equal(torch.cat([call(x[i : i + size]) for i in range(0, 70, size)]), got)


@needs_kernels
def test_a_path_the_cpu_lacks_is_refused() -> None:
    w, x, out = torch.zeros(32, 32).bfloat16(), torch.zeros(1, 32).bfloat16(), torch.empty(1, 32)
    lacks = 1 if _HAVE == 3 else 3  # an AVX2 build has no AVX-512 blocks, and the converse
    assert (
        lib.logits_bf16_path(x.data_ptr(), 32, 1, 32, w.data_ptr(), 32, out.data_ptr(), 32, lacks)
        == -3
    )


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


@needs_kernels
@pytest.mark.parametrize("rows", [1, 20])
def test_an_int8_head_is_fp32_accurate_from_fp32_input_at_any_batch(rows: int) -> None:
    """bf16 engines feed the head fp32 hidden states; an int8 head takes the bf16 GEMM path over
    their two bf16 halves from BF16_GEMM_MIN_ROWS rows on (the fp32 tile path below): both stay
    within fp32 accumulation error of the fp64 reference, far below a bf16 rounding."""
    g = torch.Generator().manual_seed(2)
    qw = quantize(torch.randn(300, 128, generator=g), "int8")
    x = torch.randn(rows, 128, generator=g)
    from engine.quant import dequantize

    got = LogitsHead(qw)(x)
    ref = (x.double() @ dequantize(qw).double().T).float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-4)
    assert not torch.equal(got, got.bfloat16().float())


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_portable_build_matches_reference(tmp_path: Path) -> None:
    """The C path a CPU without AVX-512 compiles, and the avx512f path without bf16 dot products."""
    kdir = Path(engine.kernels.__file__).parent
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 96, generator=g).bfloat16()
    x = torch.randn(5, 96, generator=g).bfloat16()
    for march in ("x86-64-v2", "skylake-avx512"):
        if needs(march) - cpu_flags():
            continue  # this CPU cannot run it (SIGILL); test_kernel_isa.py checks that it compiles
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
                str(kdir / "logits_bf16.c"),
                "-o",
                str(so),
                "-lm",
            ],
            check=True,
        )
        plib = ctypes.CDLL(str(so))
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        plib.logits_bf16.argtypes = [p, i64, i32, i32, p, i64, p, i64]
        out = torch.empty(5, 70)
        assert plib.logits_bf16(x.data_ptr(), 96, 5, 96, w.data_ptr(), 70, out.data_ptr(), 70) == 0
        torch.testing.assert_close(out, _ref(x, w), rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fp32_residual_norm_kernel(rows: int) -> None:
    """res_norm_f32: h += delta in fp32 (in place), then (h * inv_rms) * w rounded once (bf16 out)
    or not at all (fp32 out, the final norm)."""
    n = 576 + 3  # a tail past the 16-lane vectors
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, n, generator=g) * 4
    delta = torch.randn(rows, n, generator=g).bfloat16()
    w = (torch.rand(n, generator=g) + 0.5).bfloat16()
    want_h = h + delta.float()
    want = torch.nn.functional.rms_norm(want_h.double(), (n,), w.double(), 1e-5)
    for out_f32 in (0, 1):
        hh = h.clone()
        out = torch.empty(rows, n, dtype=torch.float32 if out_f32 else torch.bfloat16)
        lib.res_norm_f32(
            hh.data_ptr(), delta.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, 1e-5, out_f32
        )
        assert torch.equal(hh, want_h)
        if out_f32:
            torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=1e-6)
        else:  # one rounding to bf16: within half a bf16 ulp of the exact value, plus fp32 noise
            assert ((out.double() - want).abs() <= want.abs() * (2.0**-8 + 1e-6) + 1e-6).all()
    out = torch.empty(rows, n, dtype=torch.float32)  # no delta: the norm alone, h untouched
    hh = h.clone()
    lib.res_norm_f32(hh.data_ptr(), None, w.data_ptr(), out.data_ptr(), rows, n, 1e-5, 1)
    assert torch.equal(hh, h)
    torch.testing.assert_close(
        out.double(),
        torch.nn.functional.rms_norm(h.double(), (n,), w.double(), 1e-5),
        rtol=2e-6,
        atol=1e-6,
    )


@needs_kernels
def test_fp32_input_meets_a_bf16_head_as_two_halves() -> None:
    """An fp32 activation against a bf16 head: hi + lo carry x to 2^-17, so the logits are the
    fp64 product's to fp32 accumulation error, not bf16's; one row alone equals its batched row."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(1000, 576, generator=g).bfloat16()
    x = torch.randn(5, 576, generator=g)
    head = LogitsHead(w)
    got = head(x)
    ref = x.double() @ w.double().T
    assert got.dtype == torch.float32
    assert ((got.double() - ref).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T)).all()
    assert not torch.allclose(head(x.bfloat16()), got, rtol=0, atol=1e-6)  # the lo half matters
    for r in range(5):
        assert torch.equal(head(x[r : r + 1]), got[r : r + 1])


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
    return sum(
        next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
        for r, o in zip(ref, got, strict=True)
    )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The comparison at a fixed intra-op thread count: an earlier test's engine may have left
    torch at another (EngineCore sets the process-wide count), and a bf16 sum's order — so
    which of two tied logits wins — follows the thread count (2 threads: 81 vs 85 in a full
    run, 89 vs 85 alone; 1 thread: 103 vs 85). One thread, because two on a core shared with
    the other xdist worker took 85 s instead of 30."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.smollm2
@pytest.mark.usefixtures("one_thread")
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
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            theirs.append(out[0, len(p) :].tolist())
    ours_agree, theirs_agree = _agreement(ref, ours), _agreement(ref, theirs)
    print(
        f"tokens before divergence from fp32 greedy: engine bf16 {ours_agree}, "
        f"transformers bf16 {theirs_agree} "
        f"of {n_new * len(prompts)}"
    )
    assert ours_agree >= theirs_agree


PARIS = "What is the capital of France?"


@pytest.mark.smollm2
def test_paris_in_bf16_at_every_thread_count_and_from_the_prefix_cache(smollm2: Path) -> None:
    """A bf16 residual stream put "L" 0.06 above "The" for this prompt whatever the thread count
    (fp32 and transformers' bf16 both start "The capital of France is Paris"); with the fp32
    stream the answer, and the logits bit for bit, are the same at 1, 2 and 4 threads, and when
    the prompt's KV comes from the prefix cache."""
    before = torch.get_num_threads()
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    seen = []
    try:
        for threads in (1, 2, 4):
            llm = LLM(str(smollm2), dtype="bfloat16", max_model_len=256, threads=threads)
            prompt = llm.tokenizer.encode_chat([{"role": "user", "content": PARIS}])
            first, cached = (llm.generate([prompt], params)[0] for _ in range(2))
            assert "Paris" in first.text, (threads, first.text)
            assert cached.text == first.text
            seen.append((first.text, first.logprobs[0].top))
            del llm
    finally:
        torch.set_num_threads(before)
    assert seen[0] == seen[1] == seen[2]


@pytest.mark.smollm2
def test_paris_through_a_bf16_node_chat_endpoint(smollm2: Path, tmp_path: Path) -> None:
    """What `duet up` serves: a bf16 node at its default thread count, the chat template applied
    by the node's /v1/chat/completions, greedy."""
    import json
    import urllib.request

    node = duet_node(
        "both",
        str(smollm2),
        tmp_path,
        "--dtype",
        "bfloat16",
        "--kv-blocks",
        "64",
        "--max-model-len",
        "512",
        threads=None,
    )
    with running(node):
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": PARIS}],
            "temperature": 0,
            "max_tokens": 12,
        }
        req = urllib.request.Request(
            node.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            text = json.loads(r.read())["choices"][0]["message"]["content"]
    assert "Paris" in text, text
