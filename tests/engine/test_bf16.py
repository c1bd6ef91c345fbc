"""bf16 (the default dtype on CPUs with native bf16 GEMM): the engine's fast path (prepacked
GEMMs, fused norm/SiLU kernels, kernel attention for every token) stays close to transformers
run in bf16. Exact equality is not expected: both round differently at different places, and
a near-tie in bf16 logits can flip a greedy token, after which the sequences diverge."""

from pathlib import Path

import torch

from engine import LLM, SamplingParams
from tests.engine.test_correctness import prompts


def _hf_bf16_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_bf16_greedy_tracks_transformers_bf16(tiny_llama: Path) -> None:
    n = 16
    ps = prompts(380, [1, 15, 16, 17, 53, 70, 120, 200], seed=11)
    llm = LLM(str(tiny_llama), dtype="bfloat16", max_num_batched_tokens=64)  # chunked prefill too
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    outs = llm.generate(ps, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    first = agreed = 0
    for p, o in zip(ps, outs, strict=True):
        ref = _hf_bf16_greedy(tiny_llama, p, n)
        first += o.token_ids[0] == ref[0]
        agreed += next(
            (i for i, (a, b) in enumerate(zip(o.token_ids, ref, strict=True)) if a != b), n
        )
    assert first >= len(ps) - 1, f"first tokens agree for only {first}/{len(ps)} prompts"
    assert agreed >= 0.6 * n * len(ps), f"only {agreed}/{n * len(ps)} tokens before divergence"
