"""Speculative decoding: n-gram drafting, exact verification, KV rollback.

Greedy output with `speculative="ngram"` is token-for-token the output without it (tiny models
whose greedy output repeats, so drafts are proposed and accepted); sampled verification emits
tokens distributed exactly as the target's (a statistical check over many seeds); the slots of
rejected draft tokens go back to the pool; no drafts above spec_max_batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import processed_probs
from engine.spec_ngram import SpecState, propose
from engine.spec_verify import verify_greedy, verify_sampled


def test_propose_copies_what_followed_the_latest_match() -> None:
    toks = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3]
    assert propose(toks, 3) == [4, 7, 8]  # "2 3" last followed by 4 7 8 (most recent match)
    assert propose(toks, 1) == [4]
    assert propose([1, 2, 3, 4], 3) == []  # nothing recurs
    assert propose([5, 6, 5, 6], 5) == [5, 6]  # a 2-gram, up to the end
    assert propose(toks, 0) == []


def test_k_adapts_to_acceptance() -> None:
    st = SpecState(max_k=5)
    assert st.k == 5
    st.update(5, 1)
    assert st.k == 1
    st.update(1, 1)
    st.update(2, 2)
    assert st.k == 3
    st.update(3, 0)
    assert st.k == 1


def test_verify_greedy() -> None:
    assert verify_greedy([4, 5, 6], [4, 5, 7, 9]) == [4, 5, 7]
    assert verify_greedy([4, 5], [4, 5, 8]) == [4, 5, 8]
    assert verify_greedy([4], [3, 1]) == [3]


def test_rejection_sampling_is_distributionally_exact() -> None:
    """First emitted token ~ p0; given the first draft token stood, the second ~ p1."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 6, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=8)
    p = processed_probs(rows, [params] * 3)
    draft = [int(p[0].argsort()[-2]), int(p[1].argmax())]  # a plausible but not certain draft
    n = 6000
    first = torch.zeros(6)
    second = torch.zeros(6)
    for seed in range(n):
        out = verify_sampled(draft, rows, params, torch.Generator().manual_seed(seed))
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    tv1 = 0.5 * (first / n - p[0]).abs().sum().item()
    tv2 = 0.5 * (second / second.sum() - p[1]).abs().sum().item()
    # ~0.01-0.02 expected from n samples; a wrong residual (e.g. resampling from p) gives > 0.1
    assert tv1 < 0.04 and tv2 < 0.05, (tv1, tv2)
    assert first[p[0] == 0].sum() == 0  # top-k's excluded tokens never appear


def _repetitive_prompts(vocab: int) -> list[list[int]]:
    base = [(7 * i) % (vocab - 3) + 3 for i in range(12)]
    return [base * 3, base[:5] * 4 + [9, 10], [11, 12, 13] * 6, list(range(3, 40))]


@pytest.mark.parametrize(
    "engine_kwargs", [{}, {"max_num_batched_tokens": 7}], ids=["plain", "chunked"]
)
def test_greedy_identical_and_kv_rolled_back(tiny_llama: Path, engine_kwargs: dict) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    base = LLM(str(tiny_llama), **engine_kwargs)
    prompts = _repetitive_prompts(base.engine.model_config.vocab_size)
    ref = [o.token_ids for o in base.generate(prompts, params)]
    spec = LLM(str(tiny_llama), speculative="ngram", num_speculative_tokens=4, **engine_kwargs)
    eng = spec.engine
    free0 = eng.pool.num_free
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got == ref
    st = eng.stats()
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_accepted_tokens"] > 0, st
    assert (
        st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    )  # some rejected: rollback ran
    assert eng.pool.num_free == free0  # every slot, drafted or not, went back


def test_blocks_never_exceed_what_accepted_tokens_need(tiny_llama: Path) -> None:
    spec = LLM(str(tiny_llama), speculative="ngram", num_speculative_tokens=6, block_size=4)
    eng = spec.engine
    prompt = _repetitive_prompts(eng.model_config.vocab_size)[0]
    eng.add_request("r", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
        req = eng.request("r")
        if req is not None and req.output_token_ids:
            assert len(req.block_ids) <= -(-req.num_tokens // 4)  # no slot of a rejected draft kept
            assert req.num_computed_tokens == req.num_tokens - 1


def test_no_drafts_above_spec_max_batch(tiny_llama: Path) -> None:
    spec = LLM(str(tiny_llama), speculative="ngram", spec_max_batch=2)
    prompts = _repetitive_prompts(spec.engine.model_config.vocab_size)
    spec.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert spec.engine.stats()["spec_decode_num_drafts"] == 0


def test_sampled_requests_run_with_seeds(tiny_llama: Path) -> None:
    spec = LLM(str(tiny_llama), speculative="ngram")
    prompts = _repetitive_prompts(spec.engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=3, ignore_eos=True)
    a = [o.token_ids for o in spec.generate(prompts, params)]
    b = [o.token_ids for o in spec.generate(prompts, params)]
    assert a == b and all(len(x) == 20 for x in a)  # reproducible per seed, lengths honoured


def test_unknown_method_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="unknown speculative method"):
        LLM(str(tiny_llama), speculative="medusa")
