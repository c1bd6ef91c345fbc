"""The real default model through the gateway: SmolLM2's chat template, P → D over the real
transport, the official client; greedy output equals the decode node's own output."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import openai
import pytest

from bench.pd_client import completion
from tests.gateway.helpers import gateway_proc, make_team, tiny_model
from tests.procs import duet_node, running
from text.tokenizer import Tokenizer

pytestmark = pytest.mark.smollm2
# float32: this prompt's first token is a near-tie in bf16 ("The" vs "L", 0.08 apart in fp32 logits;
# tests/engine/test_logits_fp32.py), and the P/D path computes the prompt's last positions in other
# shapes than the decode node's own full prefill does (prefix-cache hits on P, D's recomputed tail),
# so in bf16 either answer is the engine working as designed. This test is about the plumbing.
COMMON = ("--kv-blocks", "256", "--max-model-len", "2048", "--dtype", "float32")


async def test_smollm2_chat_through_gateway(smollm2: Path, tmp_path: Path) -> None:
    p = duet_node("prefill", smollm2, tmp_path, *COMMON, threads=None)
    d = duet_node("decode", smollm2, tmp_path, *COMMON, threads=None)
    g = gateway_proc(tmp_path, {"smollm2": tiny_model(smollm2, prefill=[p.url], decode=[d.url])})
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    with running(p, d, g):
        key = make_team(g.url, "smol")
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
        r = await client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0
        )
        ids = Tokenizer(smollm2).encode_chat(messages)
        async with aiohttp.ClientSession() as s:
            direct = await completion(s, d.url, ids, {"max_tokens": 24, "temperature": 0})
        assert direct.error is None
        assert r.choices[0].message.content == direct.text
        assert "Paris" in r.choices[0].message.content
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(
            direct.token_ids
        )
        stream = await client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True
        )
        assert (
            "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            == direct.text
        )
