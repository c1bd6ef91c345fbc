"""Qwen3 on the native engine (per-head q/k RMSNorm before the rotary embedding), against
transformers: a tiny random Qwen3ForCausalLM is greedy-identical, and the same weights saved as
a base Qwen3Model (names without "model.", no lm_head: how Qwen3-Embedding ships) embed to
transformers' last hidden state — the path `duet node --task embed` serves Qwen3-Embedding on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from tests.fixtures.tiny_llama import _write_tokenizer


def _tiny_qwen3(out: Path, base: bool) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out, 384)
    cfg = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=384,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():  # wide logit gaps (no argmax ties), norms away from 1
        for p in model.parameters():
            p.normal_(0.0, 0.15 if p.dim() > 1 else 0.02).add_(1.0 if p.dim() == 1 else 0.0)
    (model.model if base else model).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_qwen3(tmp_path_factory.mktemp("qwen3"), base=False)


@pytest.fixture(scope="module")
def qwen3_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_qwen3(tmp_path_factory.mktemp("qwen3-base"), base=True)


PROMPTS = [[5, 17, 200, 33, 90, 12], [7] * 3, list(range(40, 140))]


def test_greedy_matches_transformers(qwen3: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    llm = LLM(str(qwen3), dtype="float32", num_kv_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(PROMPTS, outs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([p]),
                max_new_tokens=12,
                do_sample=False,
                min_new_tokens=12,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert o.token_ids == ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_base_checkpoint_embeds_like_transformers(qwen3_base: Path, dtype: str) -> None:
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(qwen3_base, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3Model"
    llm = LLM(str(qwen3_base), dtype=dtype, num_kv_blocks=64)
    got = torch.tensor(llm.embed(PROMPTS, pooling="last"))
    for i, p in enumerate(PROMPTS):
        with torch.inference_mode():
            ref = F.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1].float(), dim=0)
        if dtype == "float32":
            assert torch.allclose(got[i], ref, atol=1e-5), (
                f"prompt {i}: {(got[i] - ref).abs().max()}"
            )
        else:
            assert float(got[i] @ ref) > 0.99
