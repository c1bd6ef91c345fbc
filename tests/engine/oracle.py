"""Hugging Face transformers as the correctness oracle (same weights, fp32, greedy)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(
    model_dir: Path, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = False
) -> list[int]:
    model = hf_model(model_dir)
    kwargs = {} if stop_at_eos else {"min_new_tokens": max_new_tokens, "eos_token_id": None}
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def hf_log_softmax(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32 log-softmax of transformers' logits: row p scores token p + 1."""
    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
