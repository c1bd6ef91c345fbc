"""decode_layers (engine/kernels/decode_layers.c, engine/decode_plan.py): a decode step of any
engine (bf16 or fp32) runs its layers in one C call, whatever its weights: quantized, bf16 on
linear_bf16.c (where this CPU has that path), fp32 on linear_f32.c. It must be bitwise the Python
loop it replaces: every step's final hidden states are compared exactly, plan on against plan off,
for each dtype and scheme, one sequence and several at once (and qkv biases: the Qwen2 shape). The
plan must also have run (a counter), so this cannot pass on the Python loop alone."""

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

#: "none": the engine dtype's own weights (bf16 take the plan where their linears run linear_bf16.c)
SCHEMES = ["none", "int8", "int4", "int8-w8a8", "int4-w4a8"]
DTYPES = ["bfloat16", "float32"]
PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 12, 13], [200, 201, 202, 203, 204, 205, 206, 207, 208]]


def _llm(model: Path, dtype: str, scheme: str, **kw) -> LLM:
    llm = LLM(
        str(model), dtype=dtype, quantization=None if scheme == "none" else scheme, threads=1, **kw
    )
    if llm.engine.runner.model.decode_plan is None and (dtype, scheme) == ("bfloat16", "none"):
        pytest.skip("bf16 weights run oneDNN / F.linear here, not linear_bf16.c: no decode plan")
    return llm


def _hidden_per_step(
    llm: LLM, prompts: list[list[int]], max_tokens: int = 8
) -> tuple[list[torch.Tensor], list[list[int]]]:
    model = llm.engine.runner.model
    seen: list[torch.Tensor] = []
    real = model.hidden_states

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(out.clone())
        return out

    model.hidden_states = spy
    try:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
    finally:
        model.hidden_states = real
    return seen, [o.token_ids for o in outs]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
def test_plan_is_bitwise_the_python_loop(
    tiny_llama: Path, dtype: str, scheme: str, batch: int
) -> None:
    llm = _llm(tiny_llama, dtype, scheme)
    model = llm.engine.runner.model
    plan = model.decode_plan
    assert plan is not None, "every dtype and scheme gets a decode plan on the kernels"
    runs = {"n": 0}
    real_run = plan.run

    def counted(*a):
        runs["n"] += 1
        return real_run(*a)

    plan.run = counted
    with_plan, tokens = _hidden_per_step(llm, PROMPTS[:batch])
    assert runs["n"] >= 7  # every decode step after the prefill took the plan
    model.decode_plan = None
    without, tokens_py = _hidden_per_step(llm, PROMPTS[:batch])
    assert tokens == tokens_py
    assert len(with_plan) == len(without)
    for a, b in zip(with_plan, without, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("dtype", "scheme"), [("bfloat16", "int8"), ("float32", "none")])
def test_qkv_bias_models_take_the_plan_bitwise(tiny_model: Path, dtype: str, scheme: str) -> None:
    llm = _llm(tiny_model, dtype, scheme)
    model = llm.engine.runner.model
    assert model.decode_plan is not None
    with_plan, tokens = _hidden_per_step(llm, PROMPTS)
    model.decode_plan = None
    without, tokens_py = _hidden_per_step(llm, PROMPTS)
    assert tokens == tokens_py
    assert all(torch.equal(a, b) for a, b in zip(with_plan, without, strict=True))


def test_no_plan_where_it_does_not_apply(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 weights on oneDNN's linears keep the Python loop; so do fp32 weights without the
    kernels' fp32 linear (here: a model built before the layers had one)."""
    monkeypatch.setenv("DUET_BF16_LINEAR", "onednn")
    assert LLM(str(tiny_llama), dtype="bfloat16", threads=1).engine.runner.model.decode_plan is None
    import engine.linear as linear

    monkeypatch.setattr(linear, "f32_kernel_lib", lambda w: None)
    assert LLM(str(tiny_llama), dtype="float32", threads=1).engine.runner.model.decode_plan is None


@pytest.mark.parametrize(
    ("dtype", "scheme"), [("bfloat16", "int8"), ("bfloat16", "none"), ("float32", "none")]
)
def test_steps_with_prefill_tokens_take_the_plan_bitwise(
    tiny_llama: Path, dtype: str, scheme: str
) -> None:
    """Steps of fewer than 16 tokens that hold prefill tokens (on the prefill attention kernel)
    take the C loop too: prompts chunked 7 tokens a step, beside the other prompt's decode tokens
    and against their own earlier chunks' KV (a draft model's catch-up feed is such a step).
    Bitwise the Python loop; the plan must have run steps whose tokens were not all decode ones."""
    llm = _llm(tiny_llama, dtype, scheme, max_num_batched_tokens=7, enable_prefix_caching=False)
    model = llm.engine.runner.model
    if not model.kernel_prefill:
        pytest.skip(
            "prefill attention is not on the kernels on this CPU (model.prefill_on_kernels)"
        )
    plan = model.decode_plan
    mixed = {"n": 0}
    real_run = plan.run

    def counted(step_ptr, h, x, num_decode):
        mixed["n"] += 0 < num_decode < h.shape[0]  # decode and prefill tokens in one step
        return real_run(step_ptr, h, x, num_decode)

    plan.run = counted
    with_plan, tokens = _hidden_per_step(llm, PROMPTS[1:] + [list(range(20, 41))], 12)
    assert mixed["n"] >= 2
    model.decode_plan = None
    without, tokens_py = _hidden_per_step(llm, PROMPTS[1:] + [list(range(20, 41))], 12)
    assert tokens == tokens_py
    assert len(with_plan) == len(without)
    assert all(torch.equal(a, b) for a, b in zip(with_plan, without, strict=True))
