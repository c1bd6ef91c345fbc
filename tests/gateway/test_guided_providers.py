"""vLLM's structured-output extras and external models, with the official openai client against
a real gateway process: `guided_json` / `guided_regex` / `guided_choice` / `structured_outputs` are
no OpenAI fields, so an external model serves them only when its config lists the feature
`vllm_structured_outputs` (an OpenAI-compatible vLLM server), which is then sent vLLM's
`structured_outputs`; any other external model named outright is a 400 naming the field, and
fallback chains and `model: "auto"` skip it (gateway/serving/features.py). `/v1/messages` and
`/v1/responses` take the same extras (the official `anthropic` client, and `responses.create`) and
hand them to the chat path: the same provider gets the same `structured_outputs`, and the others
refuse them the same way. An Anthropic model serves none of vLLM's structured outputs and no
penalties (min_p, repetition_penalty: a 400 naming the field), while `top_k` is Anthropic's own and
is sent on.

Fakes only for the providers' APIs (tests/providers/fakes.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest

from gateway.config_features import ALL
from tests.gateway.helpers import gateway_proc, make_team
from tests.gateway.test_providers_e2e import CLAUDE, GPT, FakeServers, external
from tests.procs import Proc, running
from tests.providers.fakes import API_KEY, FakeProvider, Fault

ASK = [{"role": "user", "content": "Is the sky blue?"}]
VLLM = sorted(ALL)  # a vLLM server behind the OpenAI wire: every feature, its extras included


@dataclass
class Env:
    gw: Proc
    fakes: dict[str, FakeProvider]
    key: str

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.gw.url + "/v1", api_key=key or self.key, max_retries=0, timeout=60
        )

    def claude(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.gw.url, api_key=self.key, max_retries=0, timeout=60
        )


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """`vllm` (features: all) falls back to `gpt` (OpenAI's defaults), `claude`, then `vllm2`
    (features: all); `auto` picks between `gpt` and `vllm2`, team `pinned` pins simple prompts
    to `gpt`."""
    tmp = tmp_path_factory.mktemp("guided-providers")
    servers = FakeServers(
        {"vllm": "openai", "gpt": "openai", "claude": "anthropic", "vllm2": "openai"}
    )
    f = servers.fakes
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FAKE_PROVIDER_KEY", API_KEY)
            models = {
                "vllm": external(
                    f["vllm"], GPT, 2, features=VLLM, fallback=["gpt", "claude", "vllm2"]
                ),
                "gpt": external(f["gpt"], GPT, 2),
                "claude": external(f["claude"], CLAUDE, 3),
                "vllm2": external(f["vllm2"], GPT, 1, features=VLLM),
            }
            gw = gateway_proc(
                tmp,
                models,
                auto={"models": ["gpt", "vllm2"]},
                **{"teams.pinned": {"auto_pin": {"simple": "gpt"}}},
            )
            with running(gw):
                yield Env(gw, f, make_team(gw.url, "main"))
    finally:
        servers.close()


@pytest.mark.parametrize(
    ("extra", "sent"),
    [
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        (
            {"structured_outputs": {"json": '{"type": "integer"}', "disable_any_whitespace": True}},
            {"json": {"type": "integer"}},
        ),
        # vLLM's older guided_json, rewritten; guided_decoding_backend is inert, so not sent on
        (
            {"guided_json": {"type": "integer"}, "guided_decoding_backend": "xgrammar"},
            {"json": {"type": "integer"}},
        ),
    ],
)
def test_a_vllm_provider_gets_structured_outputs(
    env: Env, extra: dict[str, Any], sent: dict[str, Any]
) -> None:
    r = env.client().chat.completions.create(
        model="vllm", messages=ASK, max_tokens=8, extra_body=extra
    )
    assert r.choices[0].message.content == "echo: Is the sky blue?"
    body = env.fakes["vllm"].requests[-1]
    assert body["structured_outputs"] == sent  # vLLM's newest form, one field set
    assert not {"guided_choice", "guided_regex", "guided_json", "guided_decoding_backend"} & set(
        body
    )


@pytest.mark.parametrize(
    ("model", "extra", "param"),
    [
        ("gpt", {"guided_choice": ["yes", "no"]}, "guided_choice"),
        ("gpt", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ("claude", {"guided_regex": "a+"}, "guided_regex"),
        ("gpt", {"guided_json": {"type": "integer"}}, "guided_json"),
    ],
)
def test_other_external_models_refuse_them_by_name(
    env: Env, model: str, extra: dict[str, Any], param: str
) -> None:
    before = len(env.fakes[model].requests)
    with pytest.raises(openai.BadRequestError) as e:
        env.client().chat.completions.create(
            model=model, messages=ASK, max_tokens=8, extra_body=extra
        )
    assert e.value.code == "unsupported_feature" and e.value.param == param, e.value.body
    assert "vllm_structured_outputs" in e.value.message and repr(model) in e.value.message
    assert len(env.fakes[model].requests) == before  # refused before any provider call


def test_fallback_skips_models_without_them(env: Env) -> None:
    """vllm fails (500): its chain is gpt, claude, vllm2; a guided request goes to vllm2, a
    plain one to gpt."""
    c = env.client()
    env.fakes["vllm"].faults.append(Fault.http(500))
    raw = c.chat.completions.with_raw_response.create(
        model="vllm", messages=ASK, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert raw.headers["x-duet-model-used"] == "vllm2"
    assert env.fakes["vllm2"].requests[-1]["structured_outputs"] == {"choice": ["yes", "no"]}
    env.fakes["vllm"].faults.append(Fault.http(500))
    raw = c.chat.completions.with_raw_response.create(model="vllm", messages=ASK, max_tokens=8)
    assert raw.headers["x-duet-model-used"] == "gpt"


def test_auto_only_picks_a_model_that_serves_them(env: Env) -> None:
    c = env.client(make_team(env.gw.url, "pinned"))
    hi = [{"role": "user", "content": "hi"}]
    raw = c.chat.completions.with_raw_response.create(model="auto", messages=hi, max_tokens=8)
    assert raw.headers["x-duet-model-used"] == "gpt"  # the team's pin
    raw = c.chat.completions.with_raw_response.create(
        model="auto",
        messages=hi,
        max_tokens=8,
        extra_body={"structured_outputs": {"json_object": True}},
    )
    assert raw.headers["x-duet-model-used"] == "vllm2"
    assert env.fakes["vllm2"].requests[-1]["structured_outputs"] == {"json_object": True}


def _message(env: Env, model: str, extra: dict[str, Any]) -> anthropic.types.Message:
    return env.claude().messages.create(model=model, max_tokens=8, messages=ASK, extra_body=extra)


def _response(env: Env, model: str, extra: dict[str, Any]) -> Any:
    return env.client().responses.create(
        model=model, input=ASK[0]["content"], max_output_tokens=8, extra_body=extra
    )


def test_messages_and_responses_send_a_vllm_provider_structured_outputs(env: Env) -> None:
    extra = {
        "guided_json": {"type": "integer"},
        "guided_decoding_backend": "xgrammar",
        "min_p": 0.1,
    }
    for _ in (
        _message(env, "vllm", extra),
        _response(env, "vllm", {**extra, "structured_outputs": None}),
    ):
        body = env.fakes["vllm"].requests[-1]
        assert body["structured_outputs"] == {"json": {"type": "integer"}}, body
        assert body["min_p"] == 0.1, body
        assert not {"guided_json", "guided_decoding_backend"} & set(body)
    r = _response(env, "vllm", {"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.output_text == "echo: Is the sky blue?"
    assert env.fakes["vllm"].requests[-1]["structured_outputs"] == {"choice": ["yes", "no"]}


@pytest.mark.parametrize(
    ("model", "extra", "param", "lacks"),
    [
        ("gpt", {"guided_choice": ["yes", "no"]}, "guided_choice", "vllm_structured_outputs"),
        (
            "claude",
            {"structured_outputs": {"regex": "a+"}},
            "structured_outputs",
            "vllm_structured_outputs",
        ),
        ("claude", {"guided_json": {"type": "integer"}}, "guided_json", "vllm_structured_outputs"),
        ("claude", {"min_p": 0.1}, "min_p", "penalties"),
        ("claude", {"repetition_penalty": 1.2}, "repetition_penalty", "penalties"),
    ],
)
def test_messages_and_responses_refuse_them_where_chat_does(
    env: Env, model: str, extra: dict[str, Any], param: str, lacks: str
) -> None:
    before = len(env.fakes[model].requests)
    with pytest.raises(anthropic.BadRequestError) as a:
        _message(env, model, extra)
    assert a.value.body["error"]["message"].startswith(
        f"{param}: the model {model!r} does not support {lacks}"
    )
    with pytest.raises(openai.BadRequestError) as o:
        _response(env, model, extra)
    assert (
        o.value.code == "unsupported_feature"
        and o.value.param == param
        and lacks in o.value.message
    )
    assert len(env.fakes[model].requests) == before  # refused before any provider call


def test_an_anthropic_model_gets_top_k(env: Env) -> None:
    """top_k is Anthropic's own: sent on, from either API (ignore_eos and min_tokens are
    node-only sampling fields, dropped for every provider as on chat)."""
    for _ in (
        _message(env, "claude", {"top_k": 3, "ignore_eos": True}),
        _response(env, "claude", {"top_k": 3}),
    ):
        body = env.fakes["claude"].requests[-1]
        assert body["top_k"] == 3 and "ignore_eos" not in body, body
