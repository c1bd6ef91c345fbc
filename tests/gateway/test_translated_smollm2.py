"""`/v1/messages` and `/v1/responses` on the real default model: SmolLM2 on a real node, the
official `anthropic` and `openai` clients. Both APIs are translations onto the chat path, so
greedy answers equal the chat endpoint's, whole and streamed."""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest

from tests.gateway.helpers import gateway_proc, make_team, tiny_model
from tests.procs import duet_node, running

pytestmark = pytest.mark.smollm2
COMMON = ("--kv-blocks", "256", "--max-model-len", "2048")


def test_messages_and_responses_on_smollm2(smollm2: Path, tmp_path: Path) -> None:
    node = duet_node("both", smollm2, tmp_path, *COMMON, threads=None)
    gw = gateway_proc(tmp_path, {"smollm2": tiny_model(smollm2, both=[node.url])})
    system, question = "You are a concise assistant.", "What is the capital of France?"
    with running(node, gw):
        key = make_team(gw.url, "smol")
        oai = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120)
        chat = oai.chat.completions.create(model="smollm2", max_tokens=24, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])  # fmt: skip
        expected = chat.choices[0].message.content
        assert "Paris" in expected

        claude = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=120)
        # this SDK has no temperature argument any more (the API's older field): sent as extra_body
        kw = {"model": "smollm2", "max_tokens": 24, "extra_body": {"temperature": 0}, "system": system,
              "messages": [{"role": "user", "content": question}]}  # fmt: skip
        msg = claude.messages.create(**kw)
        assert msg.content[0].text == expected
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
        assert msg.usage.output_tokens == chat.usage.completion_tokens
        assert msg.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
        with claude.messages.stream(**kw) as stream:
            assert "".join(stream.text_stream) == expected

        r = oai.responses.create(model="smollm2", instructions=system, input=question, max_output_tokens=24,
                                 temperature=0)  # fmt: skip
        assert r.output_text == expected and r.usage.output_tokens == chat.usage.completion_tokens
        streamed = "".join(e.delta for e in oai.responses.create(model="smollm2", instructions=system, input=question,
                                                                 max_output_tokens=24, temperature=0, stream=True)
                           if e.type == "response.output_text.delta")  # fmt: skip
        assert streamed == expected
