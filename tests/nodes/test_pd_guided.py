"""Structured output and penalties through real P and D processes on SmolLM2.

The guide and the sampling fields ride on both legs (NodeCompletionRequest): P masks (and
penalises) the one token it samples, which is the output's first (D emits it: the tiny-model
tests of that are tests/nodes/test_pd_first_token.py), D resumes the matcher from the tokens
so far and masks the rest. Checked: every fifth schema of the corpus, concurrently P → D over NIXL,
gives JSON valid against it (the whole corpus runs P/D and colocated through the gateway in
tests/gateway/test_tools_structured.py, and in one engine batch in tests/engine/test_guided.py:
this file's share is the bare legs, at a fifth of the CI time); P's token is masked (an object
schema's token opens the object where the unguided one does not) and biased (logit_bias -100 bans
the unguided token); an invalid guide is a 400 with the engine's words at either node, before any
engine work.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import aiohttp
import jsonschema
import msgspec
import pytest

from bench.pd_client import completion, disaggregated, prefill_leg
from bench.procs import duet_node, running
from protocol.structured import Guide, GuideKind
from tests.nodes.transfer_checks import PullCheck
from tests.text.test_guide_check import CORPUS
from text.guide_check import canonical_schema

pytestmark = pytest.mark.smollm2
COMMON = ("--dtype", "float32", "--kv-memory", "256MiB", "--max-model-len", "1024")
SCHEMAS: dict[str, dict] = dict(list(json.loads(CORPUS.read_text()).items())[::5])


def guide(schema: dict) -> dict:
    return msgspec.to_builtins(Guide(kind=GuideKind.JSON_SCHEMA, spec=canonical_schema(schema)))


def chat(tok, text: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def pd(smollm2: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("pd-guided")
    p = duet_node("prefill", smollm2, tmp, *COMMON)
    d = duet_node("decode", smollm2, tmp, *COMMON)
    with running(p, d):
        yield p, d


@pytest.fixture(scope="module")
def tok(smollm2: Path):
    from text.tokenizer import Tokenizer

    return Tokenizer(smollm2)


async def test_corpus_schemas_p_to_d_give_valid_json(pd, tok) -> None:
    p, d = pd
    check = PullCheck(p, d, "nixl")
    prompts = [chat(tok, f"Give me an example {n.replace('_', ' ')} as JSON.") for n in SCHEMAS]
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(
            *[
                disaggregated(
                    s,
                    p.url,
                    d.url,
                    x,
                    {"max_tokens": 128, "temperature": 0, "guide": guide(schema)},
                )
                for x, schema in zip(prompts, SCHEMAS.values(), strict=True)
            ]
        )
    check.verify(
        list(results), prompts
    )  # every prompt's KV came over NIXL: no recompute hid a fault
    bad = []
    for (name, schema), r in zip(SCHEMAS.items(), results, strict=True):
        assert r.error is None, (name, r.error)
        try:
            jsonschema.validate(json.loads(r.text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            bad.append(f"{name}: {r.text!r} ({r.finish_reason}): {e}")
    assert not bad, "\n".join(bad)


async def test_the_first_token_is_masked_and_biased_on_p(pd, tok) -> None:
    p, _ = pd
    prompt = chat(tok, "Say hello to the world in one sentence.")
    obj = {
        "type": "object",
        "properties": {"greeting": {"type": "string", "maxLength": 20}},
        "required": ["greeting"],
    }
    async with aiohttp.ClientSession() as s:
        plain = await prefill_leg(s, p.url, prompt, {"temperature": 0}, f"p-{uuid.uuid4().hex}")
        masked = await prefill_leg(
            s, p.url, prompt, {"temperature": 0, "guide": guide(obj)}, f"p-{uuid.uuid4().hex}"
        )
        first = plain["choices"][0]["token_ids"][0]
        banned = await prefill_leg(
            s,
            p.url,
            prompt,
            {"temperature": 0, "logit_bias": {str(first): -100}},
            f"p-{uuid.uuid4().hex}",
        )
    assert not plain["choices"][0]["text"].startswith("{")
    assert masked["choices"][0]["text"].startswith("{")  # the only way the object can begin
    assert banned["choices"][0]["token_ids"][0] != first


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_an_invalid_guide_is_a_400_with_the_engines_words(pd, role: str) -> None:
    node = pd[0] if role == "prefill" else pd[1]
    bad = {"kind": "json_schema", "spec": '{"type": "array", "uniqueItems": true}'}
    async with aiohttp.ClientSession() as s:
        r = await completion(s, node.url, [1, 2, 3], {"max_tokens": 4, "guide": bad})
    assert r.error is not None and r.error["status"] == 400
    assert r.error["param"] == "guide" and "uniqueItems" in r.error["message"]
