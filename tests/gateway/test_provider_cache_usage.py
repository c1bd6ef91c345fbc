"""An external provider's prompt-cache figures are billed as it reports them, through a real
`duet gateway` process and the official `openai` and `anthropic` clients, whole and streamed.

An Anthropic provider reports the tokens it wrote to its prompt cache
(`cache_creation_input_tokens`) and those it read from it (`cache_read_input_tokens`) beside
`input_tokens`; before, the gateway folded the writes into the prompt: the usage record showed
0 cache writes and billed them at the input price instead of the model's cache-write price.
Now the record keeps the writes (`cache_write_tokens`) and the reads (`cached_tokens`), its
prompt is input + reads + writes (nothing counted twice), its cost prices each part at its
own price, and both APIs' answers say the same split. An OpenAI-shaped provider's
`prompt_tokens_details.cached_tokens` are cache reads the same way (it reports no writes).

Real parts: the gateway process and its SQLite store, the usage report CLI, the official
clients; the providers are the local fakes (tests/providers/fakes.py), told to report cache
figures.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.gateway.helpers import gateway_proc, make_team
from tests.gateway.test_providers_e2e import FakeServers, external, record
from tests.procs import Proc, running
from tests.providers.fakes import API_KEY

#: $ per million tokens: the cache write dearer than the input, the read cheaper, all distinct
PRICES = {"in": 10.0, "out": 20.0}
CACHE_PRICES = {"cached_input_usd_per_mtok": 1.0, "cache_write_usd_per_mtok": 12.5}
#: what the fakes report: Anthropic's reads and writes beside `input_tokens`; OpenAI's reads
#: within `prompt_tokens`
READ, WRITTEN, OPENAI_READ = 40, 100, 30
#: three words: the fakes' prompt tokens; the answer "echo: one two three" is four tokens
QUESTION, ANSWER_TOKENS = "one two three", 4


@dataclass
class Env:
    gw: Proc
    db: Path
    key: str

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.gw.url + "/v1", api_key=self.key, max_retries=0, timeout=60
        )

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.gw.url, api_key=self.key, max_retries=0, timeout=60
        )


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("provider-cache")
    servers = FakeServers({"claude": "anthropic", "gpt": "openai"})
    f = servers.fakes
    f["claude"].cache_read, f["claude"].cache_write = READ, WRITTEN
    f["gpt"].cache_read = OPENAI_READ
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FAKE_PROVIDER_KEY", API_KEY)
            models = {
                "claude": external(f["claude"], PRICES, 3, **CACHE_PRICES),
                "gpt": external(f["gpt"], PRICES, 2, **CACHE_PRICES),
            }
            gw = gateway_proc(tmp, models)
            with running(gw):
                yield Env(gw, tmp / "gateway.db", make_team(gw.url, "cachers"))
    finally:
        servers.close()


def priced(fresh: int, read: int, written: int, completion: int) -> float:
    """What the model's prices make of a prompt split so, and its completion."""
    return (
        fresh * PRICES["in"]
        + read * CACHE_PRICES["cached_input_usd_per_mtok"]
        + written * CACHE_PRICES["cache_write_usd_per_mtok"]
        + completion * PRICES["out"]
    ) / 1e6


def chat(env: Env, model: str, stream: bool) -> tuple[str, Any]:
    """A chat call with the openai client: (its request id, the usage it was told)."""
    raw = env.openai().chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    rid, answer = raw.headers["x-request-id"], raw.parse()
    if not stream:
        assert answer.choices[0].message.content == "echo: " + QUESTION
        return rid, answer.usage
    usage, text = None, []
    for c in answer:
        text += [ch.delta.content or "" for ch in c.choices]
        usage = c.usage or usage
    assert "".join(text) == "echo: " + QUESTION
    return rid, usage


def message(env: Env, stream: bool) -> tuple[str, Any]:
    """A Messages call with the anthropic client: (its request id, the usage it was told)."""
    args: dict[str, Any] = {
        "model": "claude",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    if not stream:
        raw = env.anthropic().messages.with_raw_response.create(**args)
        return raw.headers["request-id"], raw.parse().usage
    with env.anthropic().messages.stream(**args) as s:
        final = s.get_final_message()
        return s.response.headers["request-id"], final.usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_anthropic_providers_cache_writes_are_recorded_at_the_write_price(
    env: Env, stream: bool
) -> None:
    rid, u = chat(env, "claude", stream)
    prompt = len(QUESTION.split()) + READ + WRITTEN  # input + reads + writes, each once
    assert (u.prompt_tokens, u.completion_tokens) == (prompt, ANSWER_TOKENS), u
    details = u.prompt_tokens_details
    assert details.cached_tokens == READ, details
    assert details.cache_write_tokens == WRITTEN, details
    r = record(env, rid)
    assert (r["prompt_tokens"], r["cached_tokens"], r["cache_write_tokens"]) == (
        prompt,
        READ,
        WRITTEN,
    ), r
    want = priced(len(QUESTION.split()), READ, WRITTEN, ANSWER_TOKENS)
    assert r["cost_usd"] == pytest.approx(want, rel=1e-9), r


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_messages_api_says_the_providers_split(env: Env, stream: bool) -> None:
    rid, u = message(env, stream)
    fresh = len(QUESTION.split())
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (
        fresh,
        READ,
        WRITTEN,
    ), u
    assert u.output_tokens == ANSWER_TOKENS, u
    r = record(env, rid)
    assert (r["prompt_tokens"], r["cached_tokens"], r["cache_write_tokens"]) == (
        fresh + READ + WRITTEN,
        READ,
        WRITTEN,
    ), r
    assert r["cost_usd"] == pytest.approx(priced(fresh, READ, WRITTEN, ANSWER_TOKENS), rel=1e-9)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_openai_providers_cached_tokens_are_cache_reads(env: Env, stream: bool) -> None:
    rid, u = chat(env, "gpt", stream)
    fresh = len(QUESTION.split())
    said = (u.prompt_tokens, u.prompt_tokens_details.cached_tokens)
    assert said == (fresh + OPENAI_READ, OPENAI_READ), u
    r = record(env, rid)
    assert (r["prompt_tokens"], r["cached_tokens"], r["cache_write_tokens"]) == (
        fresh + OPENAI_READ,
        OPENAI_READ,
        0,
    ), r
    assert r["cost_usd"] == pytest.approx(priced(fresh, OPENAI_READ, 0, ANSWER_TOKENS), rel=1e-9)
