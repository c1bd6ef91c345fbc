"""No CPU-heavy step runs for a team the team gate refuses, and every request the gate passes
counts in its window.

The attacks: `model: "auto"`'s classifier read the whole last user message (a 4 MiB one cost
about 1.5 s of the event loop) and a response_format's grammar compiled, both before the team
gate, so a team at its limit still made the gateway spend CPU on every refused request; and a
request that failed after the gate (a prompt past the context, a bad logit_bias) was never
counted in the team's requests per minute, so a team could loop free tokenizations of huge
prompts forever. Now the gate comes first, what passes it counts, and a prompt whose characters
alone cannot fit the context is refused before the tokenizer runs.

Real parts: a `duet gateway` process (its self-hosted model's tokenizer is real; its node is
never reached: every answer here comes before one), the official openai client.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway.backends.base import ServedModel
from gateway.backends.providers.auto.features import FEATURE_NAMES, SCAN_CHARS, features
from gateway.config_tables import ModelConfig
from gateway.serving.chat import parse_chat
from gateway.serving.measure import prompt_ids, tool_plan
from protocol.structured import Guide, GuideKind
from tests.gateway.helpers import MODEL, gateway_proc, make_team, tiny_model
from tests.procs import Proc, running
from tests.wait import until
from text import guide_compile
from text.guide_check import canonical_schema
from text.guide_compile import GuideChecker
from text.tokenizer import Tokenizer

CONTEXT = 1024


@pytest.fixture(scope="module")
def gw(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("gw")
    models = {MODEL: tiny_model(tiny_llama, both=["http://127.0.0.1:9"], max_model_len=CONTEXT)}
    proc = gateway_proc(tmp, models, auto={"models": [MODEL]})
    with running(proc):
        yield proc


def _client(gw: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _chat(gw: Proc, key: str, content: str, model: str = MODEL, **kw: object) -> None:
    _client(gw, key).chat.completions.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": content}], **kw
    )


def test_requests_that_fail_after_the_gate_count_in_the_team_window(gw: Proc) -> None:
    """A team with rpm=3 loops prompts past the context: three 400s, then the 429 (before: a
    400 every time, never counted, the tokenizer busy for free)."""
    key = make_team(gw.url, "looper", rpm=3)
    for _ in range(3):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(gw, key, "word " * 1500)  # 7,500 tokens on a 1,024-token context
        assert e.value.body["code"] == "context_length_exceeded", e.value.body
    with pytest.raises(openai.RateLimitError) as e2:
        _chat(gw, key, "word " * 1500)
    assert e2.value.body["param"] == "requests", e2.value.body


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(
    gw: Proc, tiny_llama: Path
) -> None:
    """Its characters alone cannot fit the context: the same 400 `context_length_exceeded`,
    named in characters (the tokenizer never counted it); one just under the bound is counted
    in tokens as before."""
    most = CONTEXT * Tokenizer(tiny_llama).max_token_chars
    key = make_team(gw.url, "huge")
    with pytest.raises(openai.BadRequestError) as e:
        _chat(gw, key, "x" * (most + 1))
    body = e.value.body
    assert (body["code"], body["param"]) == ("context_length_exceeded", "messages"), body
    assert f"at most {most} characters" in body["message"], body
    with pytest.raises(openai.BadRequestError) as e2:
        _client(gw, key).completions.create(model=MODEL, max_tokens=4, prompt="x" * (most + 1))
    assert (e2.value.body["code"], e2.value.body["param"]) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as e3:
        _chat(gw, key, "word " * 1500)  # under the bound: tokenized, refused in tokens
    assert "characters" not in e3.value.body["message"], e3.value.body


def test_auto_and_the_grammar_check_come_after_the_gate(gw: Proc) -> None:
    """A team at its rpm sends what `auto` or the grammar engine would refuse: the 429 comes
    first (before: `auto`'s 400 and the compile's 400, the CPU spent on a refused team)."""
    key = make_team(gw.url, "limited", rpm=1)
    with pytest.raises(openai.BadRequestError):  # passes the gate: counts, then the context
        _chat(gw, key, "word " * 1500)
    with pytest.raises(openai.RateLimitError) as e:  # `auto` refuses token ids, after the gate
        _client(gw, key).completions.create(model="auto", max_tokens=4, prompt=[1, 2, 3])
    assert e.value.body["param"] == "requests", e.value.body
    with pytest.raises(openai.RateLimitError) as e2:  # 2 MiB for the classifier
        _chat(gw, key, "prove that " * 200_000, model="auto")
    assert e2.value.body["param"] == "requests", e2.value.body
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}
    with pytest.raises(openai.RateLimitError) as e3:
        _chat(gw, key, "hi", response_format=bad_schema)
    assert e3.value.body["param"] == "requests", e3.value.body
    # a team under its limit gets the refusals themselves
    other = make_team(gw.url, "other")
    with pytest.raises(openai.BadRequestError) as e4:
        _client(gw, other).completions.create(model="auto", max_tokens=4, prompt=[1, 2, 3])
    assert "auto" in e4.value.body["message"], e4.value.body
    with pytest.raises(openai.BadRequestError) as e5:
        _chat(gw, other, "hi", response_format=bad_schema)
    assert e5.value.body["param"] == "response_format", e5.value.body


def test_auto_features_read_a_bounded_suffix() -> None:
    """The classifier's cues read the last user message's last SCAN_CHARS characters only (a
    4 MiB message cost ~1.5 s of the event loop); its length still counts whole, and a message
    that fits is read whole, as the weights were fit."""
    proof = FEATURE_NAMES.index("proof")
    long = "prove the theorem. " * 1000 + "ok " * (SCAN_CHARS // 3 + 1)
    f = features([{"role": "user", "content": long}])
    assert f[proof] == 0.0  # the proofs asked for lie before the suffix
    length = FEATURE_NAMES.index("log_chars_last")  # the whole message's, not the suffix's
    assert f[length] > features([{"role": "user", "content": long[-SCAN_CHARS:]}])[length]
    short = "prove the theorem. " * 10
    assert features([{"role": "user", "content": short}])[proof] > 0.0


async def test_tool_definitions_count_toward_tokenizing_off_the_loop(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-character message beside 100 KB of tool schemas renders a big prompt: it is
    tokenized off the event loop like a big message (before: only the messages' text counted,
    so it was rendered and tokenized on the loop)."""
    tok = Tokenizer(tiny_llama)
    config = ModelConfig(name=MODEL, tokenizer=str(tiny_llama))
    served = ServedModel(config, None, tok, 1 << 20)  # type: ignore[arg-type]  # no backend: not sent
    props = {f"p{i}": {"type": "string", "description": "d" * 90} for i in range(1000)}
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": props}},
    }
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    req = parse_chat(json.dumps(body).encode())
    off_loop: list[object] = []
    real = asyncio.to_thread

    async def spy(fn, /, *args, **kw):  # type: ignore[no-untyped-def]
        off_loop.append(fn)
        return await real(fn, *args, **kw)

    monkeypatch.setattr(asyncio, "to_thread", spy)
    ids = await prompt_ids(served, req, tool_plan(served, req))
    assert len(ids) > 10_000 and len(off_loop) == 1


async def test_one_team_holds_only_its_share_of_the_compile_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Team A's distinct schemas take at most `domain_threads` of the compile pool: its second
    waits for its first (not refused) while team B's compiles on the thread left (before: team A
    filled both threads and team B waited for them, then 503)."""

    def schema(field: str) -> Guide:
        spec = canonical_schema({"type": "object", "properties": {field: {"type": "integer"}}})
        return Guide(kind=GuideKind.JSON_SCHEMA, spec=spec)

    held = threading.Event()
    compiling: list[str] = []
    real = guide_compile._verdict

    def gated(guide: Guide) -> guide_compile.Outcome:
        compiling.append(guide.spec)
        if '"a1"' in guide.spec:  # team A's first holds its thread until the test lets it go
            held.wait(60)
        return real(guide)

    monkeypatch.setattr(guide_compile, "_verdict", gated)
    checker = GuideChecker(threads=2, domain_threads=1)
    try:
        first = asyncio.ensure_future(checker.check(schema("a1"), "response_format", "team-a"))
        await until(lambda: len(compiling) == 1, timeout=30)
        second = asyncio.ensure_future(checker.check(schema("a2"), "response_format", "team-a"))
        await until(lambda: checker._waiting == 1, timeout=30)  # waiting for team A's share
        await asyncio.wait_for(checker.check(schema("b1"), "response_format", "team-b"), timeout=30)
        assert not second.done() and len(compiling) == 2  # a1 and b1 only: a2 still waits
        held.set()
        await asyncio.wait_for(asyncio.gather(first, second), timeout=30)
        assert len(compiling) == 3
    finally:
        held.set()
        checker.close()
