"""The real default model: token-identical to transformers on varied prompts up to ~1,000
tokens, and a sensible answer through the chat template."""

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.oracle import hf_greedy

pytestmark = pytest.mark.smollm2

TOPICS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain how a hash table works, step by step.",
    "Translate to French: The weather is lovely today and we are going to the beach.",
    "List five prime numbers and explain why each is prime.",
    "def fibonacci(n):\n    # complete this Python function\n",
]


@pytest.fixture(scope="module")
def llm(smollm2: Path) -> LLM:
    return LLM(str(smollm2), dtype="float32", max_model_len=2048, max_num_batched_tokens=512)


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    ps = [tok.encode_chat([{"role": "user", "content": t}]) for t in TOPICS]
    essay = " ".join(
        f"Paragraph {i}: the history of computing includes many inventions." for i in range(60)
    )
    ps.append(tok.encode_chat([{"role": "user", "content": "Summarize: " + essay}]))  # ~750 tokens
    long_doc = " ".join(
        f"Item {i} costs {i * 3} dollars and weighs {i % 7} kilograms." for i in range(70)
    )
    ps.append(tok.encode(long_doc)[:1000])  # a raw 1,000-token prompt
    return ps


def test_greedy_matches_transformers_on_8_prompts(llm: LLM, smollm2: Path) -> None:
    ps = _prompts(llm)
    assert len(ps) == 8 and max(map(len, ps)) == 1000 and min(map(len, ps)) < 60
    outs = llm.generate(ps, SamplingParams(max_tokens=32, temperature=0))
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == hf_greedy(smollm2, p, 32, stop_at_eos=True), (
            f"prompt of {len(p)} tokens"
        )


def test_paris(llm: LLM) -> None:
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([ids], SamplingParams(max_tokens=30, temperature=0))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
