"""Logprobs on the node API: a real node process on the tiny model answers
completions `logprobs=N` (+ vLLM's `prompt_logprobs`) and chat `logprobs: true, top_logprobs: N`
in OpenAI's shapes, streamed and not; the official openai client parses them, and the values
equal the in-process engine's for the same tokens (the engine itself is checked against
transformers in tests/engine/test_logprobs.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from engine import LLM, SamplingParams
from protocol.logprobs import TokenLogprob
from tests.nodes.conftest import COMMON
from tests.procs import Proc, duet_node, running
from text.tokenizer import Tokenizer

PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 130]
MESSAGES = [{"role": "user", "content": "Name three colours."}]
TOL = 1e-5  # same engine in fp32; only the prefix cache's reuse changes the arithmetic (~1e-7)


@pytest.fixture(scope="module")
def node(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    n = duet_node("both", tiny_llama, tmp_path_factory.mktemp("lp-node"), *COMMON)
    with running(n):
        yield n


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


def _tok(tokenizer: Tokenizer, t: int) -> str:
    return tokenizer.decode([t], skip_special_tokens=False)


def _expected_top(tokenizer: Tokenizer, rec: TokenLogprob) -> dict[str, float]:
    out: dict[str, float] = {}
    for t, lp in rec.top:
        out.setdefault(_tok(tokenizer, t), lp)
    return out


def _close(a: float | None, b: float) -> bool:
    return a is not None and abs(a - b) < TOL


def test_completions_logprobs_through_the_openai_client(node: Proc, llm: LLM) -> None:
    tk = llm.tokenizer
    ref = llm.generate(
        [PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    )[0]
    assert ref.logprobs is not None
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert (
        lp is not None
        and lp.tokens is not None
        and lp.token_logprobs
        and lp.top_logprobs
        and lp.text_offset
    )
    assert lp.tokens == [_tok(tk, r.token_id) for r in ref.logprobs]
    assert all(_close(a, r.logprob) for a, r in zip(lp.token_logprobs, ref.logprobs, strict=True))
    for got, r in zip(lp.top_logprobs, ref.logprobs, strict=True):
        want = _expected_top(tk, r)
        assert got is not None and got.keys() == want.keys() and 1 <= len(got) <= 2
        assert all(_close(got[k], want[k]) for k in want)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # Streamed: the chunks' parts add up to the same object, offsets continuing across chunks.
    tokens, values, offsets = [], [], []
    for c in client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        part = c.choices[0].logprobs
        assert part is not None
        tokens += part.tokens or []
        values += part.token_logprobs or []
        offsets += part.text_offset or []
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert all(_close(a, b) for a, b in zip(values, lp.token_logprobs, strict=True))
    # Without logprobs the field stays null.
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


async def test_prompt_logprobs_on_the_node(node: Proc, llm: LLM) -> None:
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
    assert ref.prompt_logprobs is not None
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    async with aiohttp.ClientSession() as s:
        async with s.post(node.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            got = (await r.json())["choices"][0]["prompt_logprobs"]
        streamed = []
        async with s.post(node.url + "/v1/completions", json={**body, "stream": True}) as r:
            async for raw in r.content:
                line = raw.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    pl = json.loads(line[6:])["choices"][0].get("prompt_logprobs")
                    if pl is not None:
                        streamed.append(pl)
    assert len(got) == len(PROMPT) and got[0] is None
    for entry, rec, tok in zip(got[1:], ref.prompt_logprobs[1:], PROMPT[1:], strict=True):
        assert rec is not None
        assert _close(entry[str(tok)]["logprob"], rec.logprob)
        assert entry[str(tok)]["decoded_token"] == _tok(llm.tokenizer, tok)
        top_id, top_lp = rec.top[0]
        assert _close(entry[str(top_id)]["logprob"], top_lp)
    assert streamed == [got]  # once, on the first token's chunk


def test_chat_logprobs_through_the_openai_client(node: Proc, llm: LLM) -> None:
    tk = llm.tokenizer
    ids = tk.encode_chat(MESSAGES)
    ref = llm.generate(
        [ids], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    )[0]
    assert ref.logprobs is not None
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    kw = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    out = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    content = out.choices[0].logprobs.content
    assert content is not None and len(content) == len(ref.logprobs)
    for e, r in zip(content, ref.logprobs, strict=True):
        assert e.token == _tok(tk, r.token_id) and e.bytes == list(e.token.encode())
        assert _close(e.logprob, r.logprob)
        want = _expected_top(tk, r)
        assert [t.token for t in e.top_logprobs] == list(want)
        assert all(_close(t.logprob, want[t.token]) for t in e.top_logprobs)
    streamed = [
        e
        for c in client.chat.completions.create(**kw, stream=True)  # type: ignore[call-overload]
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(_close(a.logprob, b.logprob) for a, b in zip(streamed, content, strict=True))
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": True}),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 99}),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}),
    ],
)
async def test_bad_logprob_counts_get_400(node: Proc, path: str, body: dict) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(node.url + path, json={**body, "max_tokens": 2}) as r,
    ):
        assert r.status == 400, await r.text()
        err = (await r.json())["error"]
        assert "logprobs" in err["message"] or "logprobs" in (err["param"] or "")
