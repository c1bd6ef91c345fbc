"""Logprobs (sampled token + top-k) and prompt logprobs equal transformers' log-softmax.

The oracle scores the same prompt + generated tokens in one fp32 forward pass; the engine's
values must match within 1e-4, whatever the sampling settings (logprobs are of the raw model
distribution), the batch, chunked prefill, the prefix cache or preemption.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core import RequestError
from protocol.logprobs import TokenLogprob
from tests.engine.oracle import hf_log_softmax

TOL = 1e-4


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def _check(record: TokenLogprob, row: torch.Tensor, token: int, k: int) -> None:
    assert record.token_id == token
    assert abs(record.logprob - row[token].item()) < TOL
    top_v, top_i = row.topk(k)
    assert [t for t, _ in record.top] == top_i.tolist()
    assert all(abs(v - w) < TOL for (_, v), w in zip(record.top, top_v.tolist(), strict=True))
    assert [v for _, v in record.top] == sorted((v for _, v in record.top), reverse=True)
    # vLLM's rank: the tokens at least as likely, itself included (the oracle's fp32 differs
    # by ~1e-7: a token within TOL of the chosen one may fall on either side)
    v = row[token].item()
    assert record.rank is not None
    assert int((row > v + TOL).sum()) + 1 <= record.rank <= int((row >= v - TOL).sum())


def _check_sampled(
    model: Path, prompt: list[int], tokens: list[int], lps: list[TokenLogprob] | None, k: int
) -> None:
    assert lps is not None and len(lps) == len(tokens)
    ref = hf_log_softmax(model, prompt + tokens)
    for i, (tok, rec) in enumerate(zip(tokens, lps, strict=True)):
        _check(rec, ref[len(prompt) + i - 1], tok, k)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, temperature=0, logprobs=3, ignore_eos=True),
        SamplingParams(
            max_tokens=10, temperature=0.7, top_k=20, top_p=0.9, seed=7, logprobs=2, ignore_eos=True
        ),
        SamplingParams(max_tokens=10, temperature=1.3, seed=8, logprobs=0, ignore_eos=True),
    ],
    ids=["greedy", "seeded-topk-topp", "seeded-no-top"],
)
def test_sampled_token_logprobs_match_transformers(
    llm: LLM, tiny_llama: Path, params: SamplingParams
) -> None:
    prompt = _prompt(13)
    out = llm.generate([prompt], params)[0]
    _check_sampled(tiny_llama, prompt, out.token_ids, out.logprobs, params.logprobs or 0)
    assert out.prompt_logprobs is None


def test_logprobs_do_not_depend_on_the_batch(llm: LLM, tiny_llama: Path) -> None:
    prompt = _prompt(21, seed=1)
    p = SamplingParams(max_tokens=8, temperature=0.9, seed=3, logprobs=4, ignore_eos=True)
    alone = llm.generate([prompt], p)[0]
    others = [_prompt(n, seed=n) for n in (5, 40, 17)]
    plain = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)  # no logprobs asked
    batch = llm.generate([*others, prompt], [plain, plain, plain, p])
    assert batch[-1].token_ids == alone.token_ids
    assert all(o.logprobs is None for o in batch[:-1])
    for a, b in zip(alone.logprobs or [], batch[-1].logprobs or [], strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOL
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    _check_sampled(tiny_llama, prompt, batch[-1].token_ids, batch[-1].logprobs, 4)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"max_num_batched_tokens": 512},
        {"max_num_batched_tokens": 7},  # chunked prefill: each chunk scores its own positions
        {
            "num_kv_blocks": 12,
            "block_size": 4,
            "max_num_batched_tokens": 64,
            "max_model_len": 48,
        },  # preemption
    ],
    ids=["whole", "chunked", "preempting"],
)
def test_prompt_logprobs_match_transformers(
    tiny_llama: Path, engine_kwargs: dict[str, int]
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", **engine_kwargs)
    prompts = [_prompt(n, seed=n) for n in (1, 2, 9, 18, 19, 30)]
    params = SamplingParams(
        max_tokens=16, temperature=0, prompt_logprobs=2, logprobs=1, ignore_eos=True
    )
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None  # nothing predicts the first token
        ref = hf_log_softmax(tiny_llama, prompt + out.token_ids)
        for p in range(1, len(prompt)):
            rec = out.prompt_logprobs[p]
            assert rec is not None
            _check(rec, ref[p - 1], prompt[p], 2)
        _check_sampled(tiny_llama, prompt, out.token_ids, out.logprobs, 1)
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0, (
            "the small pool should have forced preemption"
        )


def test_prompt_logprobs_skip_the_prefix_cache(tiny_llama: Path) -> None:
    """A cached block has no logits: a request asking for prompt logprobs computes its prompt."""
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4)
    prompt = _prompt(25, seed=2)
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # fills the cache
    before = llm.engine.stats()
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0]
    after = llm.engine.stats()
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(prompt)
    ref = hf_log_softmax(tiny_llama, prompt)
    got = [r.logprob for r in out.prompt_logprobs[1:]]  # type: ignore[index]
    assert torch.allclose(
        torch.tensor(got), ref[torch.arange(24), torch.tensor(prompt[1:])], atol=TOL
    )
    assert all(r.top == [] for r in out.prompt_logprobs[1:])  # type: ignore[index,union-attr]


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_out_of_range_counts_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_prompt_logprobs_refused_with_remote_kv(llm: LLM) -> None:
    with pytest.raises(RequestError, match="prompt_logprobs"):
        llm.engine.add_request(
            "r-remote", _prompt(20), SamplingParams(prompt_logprobs=1), remote_num_tokens=16
        )
