"""Penalties, logit_bias and min_p: each exact against a plain-torch reference on the
same logits, their validation, and their effect through the engine (tiny random Llama).

The penalty values are binary fractions (0.75, 1.25, ...) so that both sides' float arithmetic is
exact and the comparison can be `torch.equal`, not a tolerance."""

from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core import RequestError
from engine.logits_process import penalize
from engine.request import Request
from engine.sampler import processed_probs
from protocol.openai import APIError, CompletionRequest
from protocol.resume import Resume

V = 64
PROMPT = [3, 5, 5, 9]
OUTPUT = [5, 7, 7, 7, 11]


def req(params: SamplingParams, prompt: list[int] = PROMPT, output: list[int] = OUTPUT) -> Request:
    r = Request("r", list(prompt), params)
    r.output_token_ids = list(output)
    return r


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_frequency_and_presence_are_openais_definition() -> None:
    x = logits()
    got = penalize(x, [req(SamplingParams(frequency_penalty=0.75, presence_penalty=-0.5))])
    ref = x[0].clone()
    for t, c in Counter(OUTPUT).items():  # OpenAI: mu[j] - c[j] * a_freq - [c[j] > 0] * a_pres
        ref[t] -= c * 0.75 + 1 * -0.5
    assert torch.equal(got[0], ref)
    assert torch.equal(x, logits())  # the step's logits are not written


def test_repetition_penalty_is_vllms_over_prompt_and_output() -> None:
    x = logits(1)
    got = penalize(x, [req(SamplingParams(repetition_penalty=1.25))])
    ref = x[0].clone()
    for t in set(PROMPT + OUTPUT):
        ref[t] = ref[t] / 1.25 if ref[t] > 0 else ref[t] * 1.25
    assert torch.equal(got[0], ref)


def test_logit_bias_adds_to_the_logit() -> None:
    x = logits(2)
    bias = {0: -100.0, 17: 2.5, 63: 100.0}
    got = penalize(x, [req(SamplingParams(logit_bias=bias))])
    ref = x[0].clone()
    for t, b in bias.items():
        ref[t] += b
    assert torch.equal(got[0], ref)


def test_all_together_in_vllms_order_and_only_on_their_rows() -> None:
    x = torch.cat([logits(3), logits(4)])
    p = SamplingParams(
        logit_bias={5: 1.5}, repetition_penalty=0.8, frequency_penalty=0.5, presence_penalty=0.25
    )
    got = penalize(x, [req(p), req(SamplingParams())])
    ref = x[0].clone()
    ref[5] += 1.5
    for t in set(PROMPT + OUTPUT):
        ref[t] = ref[t] / 0.8 if ref[t] > 0 else ref[t] * 0.8
    for t, c in Counter(OUTPUT).items():
        ref[t] -= c * 0.5 + 0.25
    assert torch.equal(got[0], ref)
    assert torch.equal(got[1], x[1])  # a row that asks for nothing is untouched


def test_a_migrated_legs_streamed_tokens_count_as_output() -> None:
    """D penalises the tokens the client already has (the resume tail of its prompt) as output."""
    x = logits(5)
    prompt = PROMPT + [7, 7]  # the last two prompt ids were streamed by the dead node
    p = SamplingParams(frequency_penalty=1.0, resume=Resume(output_tokens=2, text_chars=0))
    got = penalize(x, [req(p, prompt=prompt, output=[9])])
    ref = x[0].clone()
    ref[7] -= 2.0
    ref[9] -= 1.0
    assert torch.equal(got[0], ref)


def test_min_p_is_vllms_after_temperature() -> None:
    x = logits(6)
    got = processed_probs(x, [SamplingParams(temperature=0.7, min_p=0.1)])
    z = x[0] / 0.7
    p = torch.softmax(z, dim=-1)
    ref = torch.softmax(z.masked_fill(p < 0.1 * p.max(), float("-inf")), dim=-1)
    assert (
        torch.allclose(got[0], ref, atol=1e-7)
        and (got[0] == 0).sum() == (p < 0.1 * p.max()).sum() > 0
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e-38),  # made the logits infinite and the sample NaN
        ("repetition_penalty", 101.0),
        ("min_p", 1.5),
        ("logit_bias", {"12": 101.0}),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {str(i): 1.0 for i in range(301)}),
        ("frequency_penalty", float("nan")),
    ],
)
def test_out_of_range_fields_are_400s_naming_the_field(field: str, value: object) -> None:
    body = CompletionRequest(prompt="hi", **{field: value})  # type: ignore[arg-type]
    with pytest.raises(APIError) as e:
        body.validate()
    assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize(
    "kw",
    [
        {"frequency_penalty": 3.0},
        {"presence_penalty": -3.0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": 1e-38},
        {"min_p": -0.1},
        {"logit_bias": {1: 200.0}},
        {"logit_bias": {-1: 1.0}},
    ],
)
def test_sampling_params_refuse_out_of_range(kw: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


# -- through the engine --------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


GREEDY = {"max_tokens": 80, "temperature": 0, "ignore_eos": True}


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_penalties_reduce_a_greedy_repetition(llm: LLM) -> None:
    prompt = [11, 22, 33, 44, 55]
    plain, freq, pres, rep = llm.generate(
        [prompt] * 4,
        [
            SamplingParams(**GREEDY),
            SamplingParams(**GREEDY, frequency_penalty=2.0),
            SamplingParams(**GREEDY, presence_penalty=2.0),
            SamplingParams(**GREEDY, repetition_penalty=2.0),
        ],
    )
    assert repeats(plain.token_ids) > 10, (
        "the tiny model must repeat itself for this test to mean anything"
    )
    for o in (freq, pres, rep):  # measured: 18 repeats of 80 tokens plain, none with each penalty
        assert repeats(o.token_ids) < repeats(plain.token_ids) // 2


def test_logit_bias_bans_and_forces_a_token(llm: LLM) -> None:
    prompt = [11, 22, 33, 44, 55]
    plain = llm.generate([prompt], SamplingParams(**GREEDY))[0]
    top = Counter(plain.token_ids).most_common(1)[0][0]
    banned, forced, sampled = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(**GREEDY, logit_bias={top: -100.0}),
            SamplingParams(**GREEDY, logit_bias={42: 100.0}),
            SamplingParams(
                max_tokens=80, temperature=1.0, seed=3, ignore_eos=True, logit_bias={top: -100.0}
            ),
        ],
    )
    assert top not in banned.token_ids and top not in sampled.token_ids
    assert forced.token_ids == [42] * 80


def test_logit_bias_outside_the_vocabulary_is_refused(llm: LLM) -> None:
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.engine.add_request("bad-bias", [1, 2, 3], SamplingParams(logit_bias={10**6: 1.0}))
