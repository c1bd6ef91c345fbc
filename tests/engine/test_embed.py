"""Embeddings (engine/embed.py) against transformers, the oracle: the same pooled vector of the
last hidden state (after the final norm) as `AutoModel(...).last_hidden_state`, for `last` and
`mean` pooling, batched prompts of different lengths, `dimensions`, and the pool left as found."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.core import RequestError
from engine.embed import Pooling
from tests.engine.oracle import hf_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
    "A",
    " ".join(
        f"Sentence {i} about retrieval augmented generation." for i in range(40)
    ),  # ~400 tokens
]


def _hf_pooled(model_dir: Path, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' final hidden states (the base model's output: after the final norm), pooled."""
    with torch.inference_mode():
        out = hf_model(model_dir)(torch.tensor([ids]), output_hidden_states=True)
    h = out.hidden_states[-1][0].float()  # Llama applies the final norm to the last hidden state
    v = h[-1] if pooling == "last" else h.mean(0)
    return F.normalize(v, dim=0)


@pytest.mark.smollm2
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_smollm2_matches_transformers(smollm2: Path, pooling: str) -> None:
    # a small token budget: the four prompts run in several forwards (~400 tokens alone)
    llm = LLM(
        str(smollm2),
        dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=128,
        num_kv_blocks=160,
    )
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    assert max(map(len, ids)) > 128 and min(map(len, ids)) <= 2
    free = llm.engine.pool.num_free
    vecs = torch.tensor(llm.embed(ids, pooling=pooling))
    assert vecs.shape == (len(TEXTS), llm.engine.model_config.hidden_size)
    for i, p in enumerate(ids):
        ref = _hf_pooled(smollm2, p, pooling)
        assert torch.allclose(vecs[i], ref, atol=2e-4), (
            f"{pooling} input {i}: max diff {(vecs[i] - ref).abs().max()}"
        )
    assert torch.allclose(vecs.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    assert llm.engine.pool.num_free == free and not llm.engine.pool.cached_hashes()  # nothing kept
    # one prompt alone gives what it gave in the batch (no leak between packed prompts)
    alone = torch.tensor(llm.embed([ids[1]], pooling=pooling))[0]
    assert torch.allclose(alone, vecs[1], atol=1e-5)
    # dimensions: the first d components, normalized again
    d = 64
    cut = torch.tensor(llm.embed(ids[:2], pooling=pooling, dimensions=d))
    assert cut.shape == (2, d)
    assert torch.allclose(cut, F.normalize(vecs[:2, :d], dim=1), atol=1e-5)


@pytest.mark.smollm2
def test_smollm2_bf16_close_to_transformers(smollm2: Path) -> None:
    """bf16 (the CPU kernels where available) stays close to the fp32 oracle: cosine > 0.99."""
    llm = LLM(str(smollm2), dtype="bfloat16", max_model_len=1024, num_kv_blocks=96)
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    vecs = torch.tensor(llm.embed(ids, pooling="last"))
    for i, p in enumerate(ids):
        cos = float(vecs[i] @ _hf_pooled(smollm2, p, "last"))
        assert cos > 0.99, f"input {i}: cosine {cos}"


def test_refusals(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, num_kv_blocks=16)
    core = llm.engine
    size = core.model_config.hidden_size
    with pytest.raises(RequestError, match="dimensions must be between 1 and"):
        core.embed([[1, 2]], Pooling.LAST, size + 1)
    with pytest.raises(RequestError, match="dimensions"):
        core.embed([[1, 2]], Pooling.LAST, 0)
    with pytest.raises(RequestError, match="input 1 is empty"):
        core.embed([[1], []], Pooling.LAST)
    with pytest.raises(RequestError, match="input 0 is 65 tokens"):
        core.embed([[1] * 65], Pooling.MEAN)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        core.embed([[core.model_config.vocab_size]], Pooling.MEAN)
    # a prompt of the whole context is fine (no generated token needs room)
    assert core.embed([[1] * 64], Pooling.MEAN).shape == (1, size)
