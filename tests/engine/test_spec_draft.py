"""Draft-model speculative decoding: self-speculation with the target's own weights at
int4, and a separate draft model of the same tokenizer.

Greedy output is token for token the plain engine's (one-token steps, chunked prefill, a batch
of requests); the draft's own KV pool gets every block back, and so does the target's; a draft
that the draft pool cannot hold decodes plainly; requests with logprobs or short of min_tokens
draft too, with the plain engine's tokens and logprobs; sampled verification against a draft
distribution q is distributionally exact; a draft model of another tokenizer is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import processed_probs
from engine.spec_draft import DraftTokenizerMismatch
from engine.spec_verify import verify_sampled
from tests.fixtures.tiny_llama import make_tiny_llama

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    base = [(7 * i) % (vocab - 3) + 3 for i in range(12)]
    return [base * 2, list(range(3, 30)), [11, 12, 13] * 5]


def _check_against_plain(model: Path, prompts: list[list[int]], **spec_kwargs) -> dict[str, float]:
    """Generate with and without speculation (same settings); outputs must be equal, and every
    block of both pools must be back. Returns the speculative engine's stats."""
    common = {
        k: spec_kwargs.pop(k) for k in ("max_num_batched_tokens", "block_size") if k in spec_kwargs
    }
    spec_kwargs.setdefault(
        "spec_max_batch", 4
    )  # the batch drafts together (the draft methods' default is 1)
    ref = [
        o.token_ids for o in LLM(str(model), dtype="bfloat16", **common).generate(prompts, GREEDY)
    ]
    spec = LLM(str(model), dtype="bfloat16", num_speculative_tokens=4, **common, **spec_kwargs)
    eng = spec.engine
    draft_pool = eng.speculator.model.pool  # type: ignore[union-attr]
    free, draft_free = eng.pool.num_free, draft_pool.num_free
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == ref
    assert eng.pool.num_free == free and draft_pool.num_free == draft_free  # nothing leaked
    assert not eng.speculator.model.seqs  # type: ignore[union-attr]
    return eng.stats()


@pytest.mark.parametrize(
    "engine_kwargs", [{}, {"max_num_batched_tokens": 7}], ids=["plain", "chunked"]
)
def test_int4_self_draft_is_greedy_identical(tiny_llama: Path, engine_kwargs: dict) -> None:
    prompts = _prompts(384)
    st = _check_against_plain(tiny_llama, prompts, speculative="draft-int4", **engine_kwargs)
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_accepted_tokens"] > 0, st
    assert (
        st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    )  # rejections: rollback ran


def test_full_precision_self_draft_is_accepted_in_full(tiny_llama: Path) -> None:
    """The draft at the target's own weights proposes what the target would emit."""
    st = _check_against_plain(tiny_llama, _prompts(384)[:1], speculative="draft")
    assert st["spec_decode_acceptance_rate"] > 0.9, st


def test_separate_draft_model(tiny_llama: Path, tmp_path: Path) -> None:
    other = make_tiny_llama(tmp_path / "draft", seed=5, num_layers=1)
    st = _check_against_plain(
        tiny_llama, _prompts(384), speculative="draft", speculative_model=str(other)
    )
    assert st["spec_decode_num_drafts"] > 0


def test_a_draft_model_of_another_tokenizer_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    other = make_tiny_llama(tmp_path / "draft", vocab_size=320)
    with pytest.raises(DraftTokenizerMismatch, match="different tokenizer"):
        LLM(str(tiny_llama), speculative="draft", speculative_model=str(other))
    with pytest.raises(ValueError, match="speculative_model is for the draft-model methods"):
        LLM(str(tiny_llama), speculative="ngram", speculative_model=str(tiny_llama))


def test_a_full_draft_pool_decodes_plainly(tiny_llama: Path) -> None:
    """Two 4-token blocks of draft KV: the long prompts cannot be drafted for, the short one can."""
    prompts = [*_prompts(384)[:2], [5, 6]]
    st = _check_against_plain(
        tiny_llama, prompts, speculative="draft-int4", block_size=4, spec_draft_kv_blocks=2
    )
    assert st["spec_decode_num_drafts"] > 0


def test_sampled_verification_against_a_draft_distribution() -> None:
    """Draft token d ~ q: the emitted token must be ~ p whatever q is, and d must stand with
    probability sum(min(p, q)) (what the q-aware test gives; a point-mass test gives sum(p * q))."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(2, 6, generator=g) * 1.5
    params = SamplingParams(temperature=0.9, max_tokens=8)
    p = processed_probs(rows, [params] * 2)
    q = torch.softmax(
        rows[:1] + torch.randn(1, 6, generator=g), dim=-1
    )  # a draft near p, not equal
    n = 1500
    first = torch.zeros(6)
    stood = 0
    for seed in range(n):
        gen = torch.Generator().manual_seed(seed)
        d = int(torch.multinomial(q[0], 1, generator=gen))
        out = verify_sampled([d], rows, params, gen, q)
        first[out[0]] += 1
        stood += len(out) == 2
    tv = 0.5 * (first / n - p[0]).abs().sum().item()
    assert tv < 0.05, tv  # ~0.02 expected from n samples
    optimal, point_mass = torch.minimum(p[0], q[0]).sum().item(), (p[0] * q[0]).sum().item()
    assert optimal - point_mass > 0.1  # the two tests are told apart below
    assert abs(stood / n - optimal) < 0.04, (stood / n, optimal, point_mass)


def test_sampled_requests_with_a_draft_are_reproducible(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    spec = LLM(str(tiny_llama), dtype="bfloat16", speculative="draft-int4", spec_max_batch=4)
    a = [o.token_ids for o in spec.generate(_prompts(384), params)]
    b = [
        o.token_ids for o in spec.generate(_prompts(384), params)
    ]  # same engine: the draft's draws too
    assert a == b and all(len(x) == 16 for x in a)
    assert spec.engine.stats()["spec_decode_num_drafts"] > 0


def test_drafts_with_logprobs_and_before_min_tokens(tiny_llama: Path) -> None:
    """Requests with logprobs and min_tokens draft too: the tokens and their logprobs are the
    plain engine's, and EOS (which these prompts' greedy answers reach within a few tokens) does
    not end them before min_tokens."""
    prompts = [
        [293, 215, 19, 208, 362, 293, 217, 342, 366, 26, 87, 231],
        [277, 309, 216, 249, 201, 314, 303, 122, 13, 339, 3, 382, 96],
        [214, 255, 238, 228, 63],
    ]
    plain = LLM(str(tiny_llama), dtype="bfloat16")
    free = plain.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert any(
        len(o.token_ids) < 8 and o.finish_reason == "stop" for o in free
    )  # EOS would come early
    params = SamplingParams(max_tokens=16, temperature=0, min_tokens=8, logprobs=2)
    ref = plain.generate(prompts, params)
    spec = LLM(
        str(tiny_llama),
        dtype="bfloat16",
        speculative="draft-int4",
        num_speculative_tokens=4,
        spec_max_batch=4,
    )
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.logprobs for o in got] == [o.logprobs for o in ref]
    assert all(len(o.logprobs) == len(o.token_ids) >= 8 for o in got)
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_the_draft_methods_draft_for_a_request_alone_by_default(tiny_llama: Path) -> None:
    """A draft model speculates while one request runs or waits, not more (SPEC_MAX_BATCH): with 2
    to 4 requests together, draft-int4 cost SmolLM2 26-39 % of its throughput on a Zen 4 (a batch
    already shares each weight read; docs/benchmarks.md), while prompt lookup still paid 1.3-1.5x
    at 4. An operator's spec_max_batch wins; a negative one is refused."""
    spec = LLM(str(tiny_llama), dtype="bfloat16", speculative="draft-int4")
    assert spec.engine.scheduler.spec_max_batch == 1
    two = [_prompts(384)[0], _prompts(384)[0][::-1]]  # the same length: they run and end together
    spec.generate(two, GREEDY)
    assert spec.engine.stats()["spec_decode_num_drafts"] == 0
    spec.generate(two[:1], GREEDY)
    assert spec.engine.stats()["spec_decode_num_drafts"] > 0
    assert LLM(str(tiny_llama), speculative="ngram").engine.scheduler.spec_max_batch == 4
    assert (
        LLM(
            str(tiny_llama), speculative="draft-int4", spec_max_batch=3
        ).engine.scheduler.spec_max_batch
        == 3
    )
    with pytest.raises(ValueError, match="spec_max_batch must be 0"):
        LLM(str(tiny_llama), speculative="ngram", spec_max_batch=-1)


def test_the_draft_methods_draft_8_tokens_at_most_by_default(tiny_llama: Path) -> None:
    """num_speculative_tokens defaults by method (NUM_SPECULATIVE_TOKENS): 8 for a draft model
    (its int4 self-draft is accepted 94-100 % of the time on SmolLM2; docs/benchmarks.md), 5 for
    prompt lookup; a request's first draft is that long; an operator's value wins."""
    spec = LLM(str(tiny_llama), dtype="bfloat16", speculative="draft-int4")
    assert spec.engine.speculator.max_k == 8
    spec.generate(_prompts(64)[:1], GREEDY)
    stats = spec.engine.stats()
    assert "spec_decode_num_accepted_tokens_per_pos.7" in stats  # a draft of 8 tokens was verified
    assert "spec_decode_num_accepted_tokens_per_pos.8" not in stats
    assert LLM(str(tiny_llama), speculative="ngram").engine.speculator.max_k == 5
    assert (
        LLM(
            str(tiny_llama), speculative="draft-int4", num_speculative_tokens=3
        ).engine.speculator.max_k
        == 3
    )
