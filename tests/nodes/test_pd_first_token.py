"""P's first token is the output's first on a guided P/D request: real prefill,
decode and colocated node processes on the tiny random Llama (fp32, so greedy output is exact).

- greedy guided output through P → D equals the colocated node's, token for token, for a
  json_object, a json_schema, a regex and a choice guide;
- D emits the token P sent (`kv_transfer_params.first_token_id`), not a draw of its own: a
  sampled leg pair whose D leg has another seed still starts with P's token, and a first token
  changed on the way (one the grammar allows) is what the answer starts with and continues from;
- a seeded sampled guided request through P → D equals the colocated one (D still makes the
  first draw, so its generator continues where P's was);
- a first token the grammar does not allow is a 400 naming it, and P's blocks are released;
  one outside the vocabulary, or on an unguided leg, is a 400 too;
- a choice that P's token already completes ends on D with that one token and "stop";
- an unguided prefill leg sends no first token (D samples its own, as before).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
import msgspec
import pytest

from bench.pd_client import completion, disaggregated, prefill_leg
from protocol.structured import Guide, GuideKind
from tests.gateway.helpers import metric
from tests.wait import until
from text.tokenizer import Tokenizer

PROMPT = "the answer to the question, in a structured form: " + "lorem ipsum " * 6


def guide(kind: GuideKind, spec: str = "") -> dict[str, Any]:
    return msgspec.to_builtins(Guide(kind=kind, spec=spec))


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
GUIDES = {
    "json_object": guide(GuideKind.JSON_OBJECT),
    "json_schema": guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA, separators=(",", ":"))),
    "regex": guide(GuideKind.REGEX, "[a-z]{3,6}( [a-z]{2,8}){2,5}"),
    "choice": guide(GuideKind.CHOICE, json.dumps(["alpha", "beta gamma", "delta epsilon zeta"])),
}
#: choices whose first tokens differ from one another (checked in the test)
CHOICES = ["cat", "dog", "owl", "yak"]


@pytest.fixture(scope="module")
def ids(tiny_llama) -> list[int]:
    return Tokenizer(tiny_llama).encode(PROMPT)


def _rid() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


@pytest.mark.parametrize("kind", sorted(GUIDES))
async def test_guided_greedy_p_to_d_equals_colocated(pd_nodes, ids: list[int], kind: str) -> None:
    p, d, both = pd_nodes
    params = {"max_tokens": 40, "temperature": 0, "guide": GUIDES[kind]}
    async with aiohttp.ClientSession() as s:
        want = await completion(s, both.url, ids, params)
        got = await disaggregated(s, p.url, d.url, ids, params)
        pre = await prefill_leg(s, p.url, ids, params, _rid())
        await _release(s, p.url, pre)
    assert want.error is None and got.error is None, (want.error, got.error)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.finish_reason == want.finish_reason
    assert pre["kv_transfer_params"]["first_token_id"] == want.token_ids[0]


async def test_d_starts_with_ps_token_not_its_own_draw(pd_nodes, ids: list[int]) -> None:
    """The legs of one sampled request with different seeds: D's first token is P's."""
    p, d, _ = pd_nodes
    g = guide(GuideKind.REGEX, "[a-z]{4}( [a-z]{3,7}){3}")
    firsts: list[tuple[int, int]] = []
    async with aiohttp.ClientSession() as s:
        for seed in range(1, 9):
            params = {"max_tokens": 24, "temperature": 1.5, "guide": g}
            pre = await prefill_leg(s, p.url, ids, {**params, "seed": seed}, rid := _rid())
            r = await completion(
                s, d.url, ids, {**params, "seed": 1000 + seed}, rid, pre["kv_transfer_params"]
            )
            assert r.error is None, r.error
            firsts.append((pre["choices"][0]["token_ids"][0], r.token_ids[0]))
    assert all(a == b for a, b in firsts), firsts
    assert len({a for a, _ in firsts}) > 1  # the seeds draw different first tokens: P's were used


async def test_a_first_token_changed_on_the_way_is_the_one_emitted(
    pd_nodes, tiny_llama, ids: list[int]
) -> None:
    p, d, _ = pd_nodes
    tok = Tokenizer(tiny_llama)
    firsts = [tok.encode(c)[0] for c in CHOICES]
    assert len(set(firsts)) == len(CHOICES)
    params = {
        "max_tokens": 8,
        "temperature": 0,
        "guide": guide(GuideKind.CHOICE, json.dumps(CHOICES)),
    }
    async with aiohttp.ClientSession() as s:
        pre = await prefill_leg(s, p.url, ids, params, rid := _rid())
        kv = pre["kv_transfer_params"]
        other = next(i for i, t in enumerate(firsts) if t != kv["first_token_id"])
        r = await completion(s, d.url, ids, params, rid, {**kv, "first_token_id": firsts[other]})
    assert r.error is None, r.error
    assert r.token_ids[0] == firsts[other]
    assert r.text == CHOICES[other] and r.finish_reason == "stop"  # the grammar went on from it


async def test_seeded_sampled_p_to_d_equals_colocated(pd_nodes, ids: list[int]) -> None:
    p, d, both = pd_nodes
    params = {"max_tokens": 30, "temperature": 1.0, "seed": 7, "guide": GUIDES["json_schema"]}
    async with aiohttp.ClientSession() as s:
        want = await completion(s, both.url, ids, params)
        got = await disaggregated(s, p.url, d.url, ids, params)
    assert want.error is None and got.error is None
    assert got.token_ids == want.token_ids


async def test_a_first_token_the_grammar_refuses_is_a_400(
    pd_nodes, tiny_llama, ids: list[int]
) -> None:
    p, d, _ = pd_nodes
    bad = Tokenizer(tiny_llama).encode("zebra")[0]
    params = {
        "max_tokens": 8,
        "temperature": 0,
        "guide": guide(GuideKind.CHOICE, json.dumps(CHOICES)),
    }
    async with aiohttp.ClientSession() as s:
        pre = await prefill_leg(s, p.url, ids, params, rid := _rid())
        r = await completion(
            s, d.url, ids, params, rid, {**pre["kv_transfer_params"], "first_token_id": bad}
        )
        assert r.error is not None and r.error["status"] == 400, r.error
        assert f"first token {bad} is not allowed by the choice guide" in r.error["message"]
        await until(
            lambda: metric(p.url, "duet:num_requests_held") == 0,
            what="P to release the refused leg's blocks",
        )
        pre = await prefill_leg(s, p.url, ids, params, rid := _rid())
        r = await completion(
            s, d.url, ids, params, rid, {**pre["kv_transfer_params"], "first_token_id": 10**6}
        )
        assert (
            r.error is not None
            and r.error["status"] == 400
            and "outside the vocabulary" in r.error["message"]
        )
        unguided = {"max_tokens": 4, "temperature": 0}
        pre = await prefill_leg(s, p.url, ids, unguided, rid := _rid())
        assert "first_token_id" not in pre["kv_transfer_params"]  # an unguided D samples its own
        r = await completion(
            s, d.url, ids, unguided, rid, {**pre["kv_transfer_params"], "first_token_id": 5}
        )
        assert (
            r.error is not None
            and r.error["status"] == 400
            and "only with a guide" in r.error["message"]
        )
    await until(
        lambda: metric(p.url, "duet:num_requests_held") == 0,
        what="P to release every refused leg's blocks",
    )


async def test_a_choice_ps_token_completes_ends_on_d(pd_nodes, ids: list[int]) -> None:
    p, d, both = pd_nodes
    params = {
        "max_tokens": 8,
        "temperature": 0,
        "guide": guide(GuideKind.CHOICE, json.dumps(["x", "y"])),
    }
    async with aiohttp.ClientSession() as s:
        want = await completion(s, both.url, ids, params)
        got = await disaggregated(s, p.url, d.url, ids, params)
    assert got.error is None and want.error is None
    assert len(got.token_ids) == 1 and got.token_ids == want.token_ids
    assert got.text in ("x", "y") and got.finish_reason == want.finish_reason == "stop"


async def _release(s: aiohttp.ClientSession, url: str, pre: dict[str, Any]) -> None:
    kv = pre["kv_transfer_params"]
    async with s.post(f"{url}/kv/release", json={"request_id": kv["remote_request_id"]}) as r:
        assert r.status == 200
