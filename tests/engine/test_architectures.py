"""Gemma 1/2/3, Phi-3 (plain and LongRoPE), Qwen3-MoE and Mixtral on the native engine, against
transformers with the same weights (tiny random models from transformers' own config classes,
tests/fixtures/tiny_archs.py): greedy output token-identical in fp32 for a batch that mixes
prompt lengths (longer than the sliding windows) under chunked prefill, then for a prompt that
hits the prefix cache; the torch path (no CPU kernels: CUDA's) alike; quantized weights and
speculative decoding on each; the settings the engine does not compute refused at load."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.model_config import UnsupportedModel
from tests.engine.oracle import hf_greedy
from tests.fixtures.tiny_archs import ARCHS, VOCAB, make_tiny_arch

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LENGTHS = (1, 5, 17, 40, 90)
#: one thread: these models are too small to gain from two, and a loaded machine's spinning
#: OpenMP threads cost more than they compute
ENGINE = dict(
    dtype="float32", num_kv_blocks=96, max_model_len=512, max_num_batched_tokens=32, threads=1
)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_arch(tmp_path_factory.mktemp(request.param), request.param)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


def test_greedy_matches_transformers_with_a_prefix_hit(arch: Path) -> None:
    llm = LLM(str(arch), **ENGINE)
    ps = _prompts()
    for p, o in zip(ps, llm.generate(ps, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(arch, p, 12), f"{arch.name}: prompt of {len(p)} tokens"
    shared = ps[-1][:64] + [7, 8, 9]  # four cached blocks of the 90-token prompt
    before = llm.engine.stats()
    out = llm.generate([shared], GREEDY)[0]
    assert out.num_cached_tokens == 64
    assert llm.engine.stats()["prompt_tokens_computed"] - before["prompt_tokens_computed"] == 3
    assert out.token_ids == hf_greedy(arch, shared, 12)


def test_torch_path_matches_transformers(arch: Path) -> None:
    """Without the CPU kernels (CUDA, or a machine without a compiler) attention, the rotary
    embedding and the KV writes are torch ops: the same tokens."""
    llm = LLM(str(arch), **ENGINE)
    llm.engine.runner.model.kernels = None
    ps = _prompts(seed=1)[2:]
    for p, o in zip(ps, llm.generate(ps, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(arch, p, 12), f"{arch.name}: prompt of {len(p)} tokens"


def test_quantized_and_speculative(arch: Path) -> None:
    """int8 weights keep fp32's top token at most positions of a teacher-forced prompt (a
    mixture of experts' routing flips on some); n-gram and self-draft (int4) speculation leave
    greedy output exactly as it was, and drafts were made."""
    prompt = _prompts(seed=2)[-1] + _prompts(seed=4)[-1]
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    tops = [
        [
            r.top[0][0]
            for r in LLM(str(arch), **ENGINE, quantization=q)
            .generate([prompt], scored)[0]
            .prompt_logprobs[1:]
        ]  # type: ignore[union-attr]
        for q in (None, "int8")
    ]
    same = sum(a == b for a, b in zip(*tops, strict=True))
    assert same >= 0.8 * len(tops[0]), f"int8 kept the top token at {same} of {len(tops[0])}"
    rep = [p[:8] * 4 for p in _prompts(seed=2)[2:]]  # repetitive prompts: n-gram finds matches
    plain = [o.token_ids for o in LLM(str(arch), **ENGINE).generate(rep, GREEDY)]
    for method in ("ngram", "draft-int4"):  # the draft: this architecture's own weights at int4
        spec = LLM(str(arch), **ENGINE, speculative=method, spec_max_batch=4)
        assert [o.token_ids for o in spec.generate(rep, GREEDY)] == plain, method
        assert spec.engine.stats()["spec_decode_num_drafts"] > 0, method


def test_bf16_agrees_with_fp32_on_first_tokens(arch: Path) -> None:
    ps = _prompts(seed=3)
    f32 = LLM(str(arch), **ENGINE).generate(ps, SamplingParams(max_tokens=1, temperature=0))
    bf16 = LLM(str(arch), **{**ENGINE, "dtype": "bfloat16"}).generate(
        ps, SamplingParams(max_tokens=1, temperature=0)
    )
    agree = sum(a.token_ids == b.token_ids for a, b in zip(f32, bf16, strict=True))
    assert agree >= len(ps) - 1


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_arch(tmp_path_factory.mktemp("g2"), "gemma2")


def _edited(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"model_type": "deepseek_v3"}, "multi-head latent attention"),
        ({"model_type": "gemma3"}, "vision-language"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "relu"}, "hidden activation 'relu'"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_at_load(
    gemma2: Path, tmp_path: Path, changes: dict, reason: str
) -> None:
    with pytest.raises(UnsupportedModel, match=reason):
        LLM(str(_edited(gemma2, tmp_path / "m", **changes)), dtype="float32", num_kv_blocks=64)


def test_w8a8_smoothing_refused_outside_the_llama_family(gemma2: Path) -> None:
    with pytest.raises(UnsupportedModel, match="Gemma 2 cannot take int8-w8a8"):
        LLM(str(gemma2), dtype="float32", num_kv_blocks=64, quantization="int8-w8a8")
