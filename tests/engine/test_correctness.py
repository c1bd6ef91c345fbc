"""Greedy output equals transformers token for token (fp32, same weights), whatever the batch,
chunking, prefix caching or preemption does."""

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.oracle import hf_greedy

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
BS = 16


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"max_num_batched_tokens": 512},
        {"max_num_batched_tokens": 7},  # chunked prefill: prompts span several steps
        {"num_kv_blocks": 12, "max_num_batched_tokens": 64, "max_model_len": 192},  # preemption
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_greedy_matches_transformers(tiny_model: Path, engine_kwargs: dict[str, int]) -> None:
    llm = LLM(str(tiny_model), dtype="float32", block_size=BS, **engine_kwargs)
    ps = prompts(380, [1, BS - 1, BS, BS + 1, 3 * BS + 5, 70])
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, 24), f"prompt length {len(p)}"
        assert o.finish_reason == "length"
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0, (
            "the small pool should have forced preemption"
        )


def test_same_tokens_alone_and_in_a_batch_of_32(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=256)
    ps = prompts(380, [random.Random(i).randrange(1, 200) for i in range(32)], seed=3)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    batch = llm.generate(ps, params)
    for i in (0, 7, 31):
        alone = llm.generate([ps[i]], params)[0]
        assert alone.token_ids == batch[i].token_ids


def test_shared_prefix_computes_only_the_tail(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=1024)
    prefix = prompts(380, [512], seed=5)[0]
    a, b = prefix + [7, 8, 9], prefix + [10, 11, 12, 13]
    first = llm.generate([a], GREEDY)[0]
    before = llm.engine.stats()
    second = llm.generate([b], GREEDY)[0]
    after = llm.engine.stats()
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == 4
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 512
    assert second.num_cached_tokens == 512
    assert first.token_ids == hf_greedy(tiny_llama, a, 24)
    assert second.token_ids == hf_greedy(tiny_llama, b, 24)


def test_eviction_under_pressure_stays_correct(tiny_llama: Path) -> None:
    # 40 blocks, prompts of ~6 blocks each: cached blocks keep getting evicted and reused.
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=40, max_model_len=256)
    ps = prompts(380, [90, 100, 95, 80, 99, 101, 85, 97], seed=9)
    ps += [p[:64] + [5, 6] for p in ps[:4]]  # partial prefix hits on possibly evicted blocks
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == hf_greedy(tiny_llama, p, 24)
    assert llm.engine.pool.num_used == 0


def test_errors_are_clear(tiny_llama: Path) -> None:
    from engine.core import RequestError

    llm = LLM(str(tiny_llama), dtype="float32")
    with pytest.raises(RequestError, match="context is 1024 tokens"):
        llm.generate([[5] * 1024], GREEDY)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[5, 100000]], GREEDY)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(str(tiny_llama), num_kv_blocks=8)
    from runtime.models import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="unknown model"):
        LLM("no-such-model")
    # The engine still works after refusing requests.
    assert llm.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "length"
