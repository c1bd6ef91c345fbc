"""Nodes running `--engine vllm`, driven exactly as the gateway drives native ones:
- the two legs (P: do_remote_decode → vLLM's kv_transfer_params → D: do_remote_prefill) give
  the same greedy tokens as one colocated vLLM node, and D really pulled (it computed only the
  prompt's tail);
- P's etcd registration says engine_kind vllm with a layout hash no native node has, and its
  KV events (re-served as duet's /kv/snapshot) carry duet's block hashes;
- bad kv_transfer_params are refused before vLLM may contact anything; the chat form works;
- guides are vLLM's structured outputs (a few corpus schemas give schema-valid JSON,
  json_object an object, regex a match, choice a choice), logit_bias and frequency_penalty change
  vLLM's greedy output, and bad fields are 400s before vLLM sees them;
- P killed before the pull: D follows the failure policy (recompute → the same tokens; fail →
  an error for that request only).
The kill test runs last: it kills the module's P.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

from bench.pd_client import completion, disaggregated, prefill_leg
from protocol.block_hash import block_hashes
from protocol.cluster import NodeInfo, nodes_prefix
from protocol.kv_layout import KVLayout
from tests.procs import Proc, free_port, running

pytestmark = pytest.mark.smollm2
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\n" * 6,
    "def fibonacci(n):\n    " + "# compute it\n    " * 10,
]


def metric(node: Proc, name: str) -> float:
    text = urllib.request.urlopen(node.url + "/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def tokenize(smollm2: Path, text: str) -> list[int]:
    from text.tokenizer import Tokenizer

    return Tokenizer(smollm2).encode(text)


async def test_two_legs_equal_colocated_and_d_pulls(
    vllm_pd: tuple[Proc, Proc], smollm2: Path
) -> None:
    p, d = vllm_pd
    async with aiohttp.ClientSession() as s:
        for text in PROMPTS:
            ids = tokenize(smollm2, text)
            computed_before = metric(d, "duet:prompt_tokens_total")
            pre = await prefill_leg(s, p.url, ids, GREEDY, f"pre-{uuid.uuid4().hex}")
            kv = pre["kv_transfer_params"]
            # vLLM's own names, unchanged: the gateway passes them on as it does a native P's.
            assert (
                kv["do_remote_prefill"] is True
                and kv["remote_engine_id"]
                and kv["remote_block_ids"]
            )
            assert {"remote_request_id", "remote_host", "remote_port"} <= set(kv)
            pd = await completion(s, d.url, ids, GREEDY, kv_transfer_params=kv)
            assert pd.error is None, pd.error
            pulled_computed = metric(d, "duet:prompt_tokens_total") - computed_before
            co = await completion(s, p.url, ids, GREEDY)  # the same vLLM engine, colocated
            assert co.error is None, co.error
            assert pd.token_ids == co.token_ids and len(pd.token_ids) == 12, text
            assert (
                pd.usage
                and pd.usage["prompt_tokens"] == len(ids)
                and pd.usage["completion_tokens"] == 12
            )
            # D computed at most the tail after P's last full block: the rest was pulled.
            assert pulled_computed <= 16, (pulled_computed, len(ids))
        # Both legs of a full disaggregated request through the bench client, like the gateway.
        r = await disaggregated(s, p.url, d.url, tokenize(smollm2, PROMPTS[1]), GREEDY)
        assert r.error is None and len(r.token_ids) == 12
    # vLLM's stats under duet's names.
    assert metric(d, "duet:generation_tokens_total") >= 12 * len(PROMPTS)
    assert metric(p, "duet:prefix_cache_queries_total") > 0


async def test_registration_and_kv_events(
    vllm_pd: tuple[Proc, Proc], etcd_module: str, smollm2: Path
) -> None:
    p, _ = vllm_pd
    from coordinator.etcd_store import EtcdStore

    store = EtcdStore(etcd_module)
    try:
        kvs, _ = await store.get_prefix(nodes_prefix("default"))
    finally:
        await store.close()
    infos = [msgspec.json.decode(kv.value, type=NodeInfo) for kv in kvs]
    info = next(i for i in infos if i.url == p.url)
    assert info.engine_kind == "vllm" and info.role == "prefill"
    hf = json.loads((smollm2 / "config.json").read_text())
    native = KVLayout(
        num_layers=hf["num_hidden_layers"],
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["hidden_size"] // hf["num_attention_heads"],
        block_size=16,
        dtype="float32",
        num_blocks=1,
    )
    assert info.kv_layout_hash != native.compat_hash  # never paired with a native node
    assert info.kv_capacity_blocks > 0 and info.block_size == 16  # counted in duet's hash blocks
    # A prompt prefilled on P shows up in its snapshot under duet's hashes (recomputed from
    # vLLM's events' token ids).
    ids = tokenize(smollm2, "KV events from vLLM, hashed the duet way. " * 8)
    # vLLM caches whole blocks of its own (32 tokens on CPUs): the prompt's full ones.
    want = block_hashes(ids[: len(ids) // 32 * 32], 16)
    assert len(want) >= 4
    async with aiohttp.ClientSession() as s:
        await completion(s, p.url, ids, {"max_tokens": 1, "temperature": 0})
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            async with s.get(p.url + "/kv/snapshot") as r:
                snap = await r.json()
            if set(want) <= set(snap["block_hashes"]):
                break
            assert asyncio.get_running_loop().time() < deadline, (
                f"{len(want)} hashes not in P's snapshot"
            )
            await asyncio.sleep(0.1)  # polling a condition, with a deadline


async def test_bad_kv_transfer_params_are_refused(
    vllm_pd: tuple[Proc, Proc], smollm2: Path
) -> None:
    p, d = vllm_pd
    ids = tokenize(smollm2, "hello there")
    good = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_block_ids": [1],
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 5,
    }
    async with aiohttp.ClientSession() as s:
        for bad, status in (
            ({**good, "remote_host": "8.8.8.8"}, 403),
            ({**good, "remote_host": "169.254.169.254"}, 403),
            ({**good, "remote_port": "x"}, 400),
            ({**good, "remote_port": 70000}, 400),
            ({**good, "remote_block_ids": [1, [2]]}, 400),
            ({**good, "remote_block_ids": [-1]}, 400),
            ({k: v for k, v in good.items() if k != "remote_engine_id"}, 400),
            ({**good, "do_remote_decode": True}, 400),
            # allowed network, but no registered prefill node there (a cache it could poison)
            ({**good, "remote_host": "127.0.0.2"}, 403),
        ):
            r = await completion(s, d.url, ids, GREEDY, kv_transfer_params=bad)
            assert r.error is not None and r.error["status"] == status, (bad, r.error)
        body = {"prompt": ids, "stream": True, "kv_transfer_params": {"do_remote_decode": True}}
        async with s.post(p.url + "/v1/completions", json=body) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "stream"
        # The node is fine afterwards.
        ok = await completion(s, d.url, ids, GREEDY)
        assert ok.error is None and len(ok.token_ids) == 12


async def test_openai_client_chat_on_a_vllm_node(vllm_pd: tuple[Proc, Proc]) -> None:
    """The node's chat form (templated by the node, generated by vLLM) through the official
    client."""
    import openai

    _, d = vllm_pd
    client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="unused")
    try:
        r = await client.chat.completions.create(
            model="smollm2-135m-instruct",
            max_tokens=8,
            temperature=0,
            messages=[{"role": "user", "content": "Say hello."}],
        )
    finally:
        await client.close()
    assert r.choices[0].message.content and r.usage and r.usage.completion_tokens <= 8


@pytest.fixture(scope="module")
def vllm_cluster(
    vllm_pd: tuple[Proc, Proc],
    etcd_module: str,
    smollm2: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Proc, Proc, str, str]]:
    """A coordinator and a gateway in front of the module's vLLM P and D, exactly as in front of
    native nodes: (coordinator, gateway, API key, model name)."""
    from tests.gateway.helpers import gateway_proc, make_team

    tmp = tmp_path_factory.mktemp("vllm-cluster")
    p, d = vllm_pd
    with urllib.request.urlopen(d.url + "/v1/models", timeout=10) as r:
        served = json.loads(r.read())["data"][0]["id"]
    port = free_port()
    coord = Proc(
        [
            sys.executable,
            "-m",
            "duet",
            "coordinator",
            "--etcd",
            etcd_module,
            "--port",
            str(port),
            "--local-prefill-tokens",
            "8",
        ],
        port,
        tmp / "coordinator.log",
    )
    model = {
        "kind": "cluster",
        "tokenizer": str(smollm2),
        "served_name": served,
        "input_usd_per_mtok": 1.0,
        "output_usd_per_mtok": 2.0,
    }
    # vLLM on a CPU compiles a request's grammar and warms its first structured step inside the
    # stream, and three such requests at once on two busy cores went 10 s (the default stall
    # bound) without a token once: what these tests check is the answers, not stall detection
    g = gateway_proc(
        tmp, {"smollm2": model}, routing={"coordinator": [coord.url], "stall_timeout_s": 60}
    )
    with running(coord, g):
        deadline = time.monotonic() + 120
        while True:
            with urllib.request.urlopen(coord.url + "/cluster", timeout=10) as r:
                ready = {n["url"] for n in json.loads(r.read())["nodes"] if n["ready"]}
            if {p.url, d.url} <= ready:
                break
            assert time.monotonic() < deadline, f"vLLM nodes not ready in the coordinator: {ready}"
            time.sleep(0.2)  # polling the coordinator's view
        yield coord, g, make_team(g.url, "vllm"), served


def test_gateway_and_coordinator_drive_a_vllm_pool_unchanged(
    vllm_cluster: tuple[Proc, Proc, str, str], vllm_pd: tuple[Proc, Proc], smollm2: Path
) -> None:
    """The gateway and coordinator of a native cluster, unchanged, in front of vLLM nodes: the
    request is disaggregated (vLLM's NixlConnector moves the KV), the answer equals the prefill
    node's own colocated answer, and P's KV events reached the coordinator's index (a second
    prompt sharing the prefix is routed to P with its cached tokens counted)."""
    import openai

    coord, g, key, _ = vllm_cluster
    p, _ = vllm_pd
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    text = "A vLLM pool behind duet's gateway and coordinator, unchanged. " * 6
    ids = tokenize(smollm2, text)
    before = metric_sum(coord.url, "duet:route_decisions_total", 'outcome="disaggregated"')
    r = client.completions.create(model="smollm2", prompt=text, max_tokens=12, temperature=0)
    assert (
        metric_sum(coord.url, "duet:route_decisions_total", 'outcome="disaggregated"') == before + 1
    )
    own = _complete(p, ids)
    assert r.choices[0].text == own and own
    # P's KV events (duet hashes recomputed from vLLM's) reach the coordinator: after a prompt
    # only P has seen, a route for it names P and counts its full vLLM blocks as cached there.
    only_p = tokenize(
        smollm2, "Seen by the prefill node alone, then routed by its cached blocks. " * 6
    )
    _complete(p, only_p)
    body = {
        "model": vllm_cluster[3],
        "block_hashes": block_hashes(only_p, 16),
        "num_prompt_tokens": len(only_p),
        "max_tokens": 12,
    }
    deadline = time.monotonic() + 30
    while True:
        req = urllib.request.Request(
            coord.url + "/route",
            method="POST",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            route = json.loads(resp.read())
        pre = route.get("prefill") or {}
        if pre.get("url") == p.url and pre.get("cached_tokens", 0) >= len(only_p) // 32 * 32 > 0:
            break
        assert time.monotonic() < deadline, f"the coordinator never indexed P's blocks: {route}"
        time.sleep(0.2)  # polling the coordinator's view


def _complete(node: Proc, ids: list[int]) -> str:
    req = urllib.request.Request(
        node.url + "/v1/completions",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": ids, "max_tokens": 12, "temperature": 0}).encode(),
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["text"]  # type: ignore[no-any-return]


def metric_sum(url: str, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    found = re.findall(
        rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M
    )
    return sum(float(v) for v in found)


def test_cache_salt_isolates_vllms_prefix_cache(vllm_pd: tuple[Proc, Proc], smollm2: Path) -> None:
    """The gateway's cache domain reaches vLLM as `cache_salt`: the same prompt in
    another domain finds nothing cached, the same domain does, and the node's snapshot holds
    the domain's salted duet hashes (read off vLLM's events' extra keys)."""
    from protocol.block_hash import domain_root

    p, _ = vllm_pd
    ids = tokenize(smollm2, "A salted prefix, cached for one team and no other. " * 8)

    def cached(salt: str) -> int:
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
        req = urllib.request.Request(
            p.url + "/v1/completions",
            method="POST",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            return int(json.loads(resp.read())["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("team:a") == 0
    assert cached("team:b") == 0
    assert cached("team:a") >= len(ids) // 32 * 32 - 32 > 0
    want = block_hashes(ids[: len(ids) // 32 * 32], 16, parent=domain_root("team:a"))
    deadline = time.monotonic() + 30
    while not set(want) <= set(
        json.loads(urllib.request.urlopen(p.url + "/kv/snapshot", timeout=10).read())[
            "block_hashes"
        ]
    ):
        assert time.monotonic() < deadline, "the salted hashes never reached P's snapshot"
        time.sleep(0.2)  # polling the node's snapshot


#: a handful of the structured-output corpus (bench/data/json_schemas.json): enum, pattern,
#: nested object, array of objects, $ref
GUIDED_SCHEMAS = (
    "status_enum_int",
    "zip_pattern",
    "person",
    "nested_address",
    "array_of_objects",
    "ref_defs",
)


def chat_ids(smollm2: Path, text: str) -> list[int]:
    from text.tokenizer import Tokenizer

    return Tokenizer(smollm2).encode_chat([{"role": "user", "content": text}])


async def test_guides_are_vllms_structured_outputs(
    vllm_pd: tuple[Proc, Proc], smollm2: Path
) -> None:
    """Structured outputs on the vLLM engine: a json_schema guide gives JSON valid against its
    schema (vLLM's guidance backend, compact JSON), json_object an object, regex a match, choice one
    of the choices; all in one concurrent batch on D (colocated)."""
    import jsonschema

    from protocol.structured import Guide, GuideKind
    from text.guide_check import canonical_schema

    _, d = vllm_pd
    corpus = json.loads(
        (Path(__file__).parents[2] / "bench" / "data" / "json_schemas.json").read_text()
    )
    schemas = {n: corpus[n] for n in GUIDED_SCHEMAS}

    def g(kind: GuideKind, spec: str = "") -> dict:
        return msgspec.to_builtins(Guide(kind=kind, spec=spec))

    params = {"max_tokens": 96, "temperature": 0}
    jobs = [
        (
            chat_ids(smollm2, f"Give me an example {n.replace('_', ' ')} as JSON."),
            g(GuideKind.JSON_SCHEMA, canonical_schema(sc)),
        )
        for n, sc in schemas.items()
    ]
    choices = ["red", "green", "blue"]
    jobs.append(
        (
            chat_ids(smollm2, 'Reply with the JSON object {"ok": true} and nothing else.'),
            g(GuideKind.JSON_OBJECT),
        )
    )
    jobs.append(
        (chat_ids(smollm2, "Give me a product code."), g(GuideKind.REGEX, "[0-9]{3}-[a-z]{2}"))
    )
    jobs.append(
        (chat_ids(smollm2, "Which colour is the sky?"), g(GuideKind.CHOICE, json.dumps(choices)))
    )
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(
            *[completion(s, d.url, ids, {**params, "guide": guide}) for ids, guide in jobs]
        )
    bad = []
    for (name, schema), r in zip(schemas.items(), results, strict=False):
        assert r.error is None, (name, r.error)
        try:
            jsonschema.validate(json.loads(r.text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            bad.append(f"{name}: {r.text!r} ({r.finish_reason}): {e}")
    assert not bad, "\n".join(bad)
    obj, rx, choice = results[-3:]
    assert (
        obj.error is None and obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    ), obj.text
    assert rx.error is None and re.fullmatch("[0-9]{3}-[a-z]{2}", rx.text), rx.text
    assert choice.error is None and choice.text in choices, choice.text


async def test_logit_bias_and_frequency_penalty_reach_vllm(
    vllm_pd: tuple[Proc, Proc], smollm2: Path
) -> None:
    """logit_bias -100 bans the token the plain greedy run starts with; frequency_penalty breaks
    a greedy repetition (the most repeated token of the plain run occurs less often)."""
    _, d = vllm_pd
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    hello = chat_ids(smollm2, "Say hello to the world in one sentence.")
    loop = tokenize(smollm2, "one two one two one two one two one two one two one two")
    async with aiohttp.ClientSession() as s:
        plain, plain_loop = await asyncio.gather(
            completion(s, d.url, hello, greedy), completion(s, d.url, loop, greedy)
        )
        assert plain.error is None and plain_loop.error is None
        first = plain.token_ids[0]
        banned, penalised = await asyncio.gather(
            completion(s, d.url, hello, {**greedy, "logit_bias": {str(first): -100}}),
            completion(s, d.url, loop, {**greedy, "frequency_penalty": 1.5}),
        )
    assert banned.error is None and banned.token_ids[0] != first and first not in banned.token_ids
    assert penalised.error is None

    def most(ids: list[int]) -> tuple[int, int]:
        top = max(set(ids), key=ids.count)
        return ids.count(top), top

    n, top = most(plain_loop.token_ids)
    assert n >= 8, f"the plain greedy run does not repeat: {plain_loop.text!r}"
    assert penalised.token_ids.count(top) < n, (plain_loop.text, penalised.text)
    assert penalised.token_ids != plain_loop.token_ids


async def test_invalid_sampling_fields_are_400s(vllm_pd: tuple[Proc, Proc]) -> None:
    """Bad penalties, biases and guides are refused with a 400 before vLLM sees them (a
    logit_bias id outside the vocabulary would otherwise fail vLLM's engine core); the node
    serves on."""
    _, d = vllm_pd
    bad = [
        {"frequency_penalty": 3},
        {"presence_penalty": -2.5},
        {"repetition_penalty": 0},
        {"min_p": 1.5},
        {"logit_bias": {"5": 101}},
        {"logit_bias": {"10000000": -100}},
        {"guide": {"kind": "json_schema", "spec": '{"type": "array", "uniqueItems": true}'}},
        {"guide": {"kind": "regex", "spec": "("}},
    ]
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(
            *[completion(s, d.url, [1, 2, 3], {"max_tokens": 4, **b}) for b in bad]
        )
        for b, r in zip(bad, results, strict=True):
            assert r.error is not None and r.error["status"] == 400, (b, r.error)
        assert "outside the vocabulary" in results[5].error["message"]
        assert results[6].error["param"] == "guide" and "uniqueItems" in results[6].error["message"]
        ok = await completion(s, d.url, [1, 2, 3], GREEDY)
        assert ok.error is None and len(ok.token_ids) == 12


async def test_tools_and_response_format_through_the_gateway(
    vllm_cluster: tuple[Proc, Proc, str, str],
) -> None:
    """The gateway renders tools and parses calls for any engine (gateway/tools/) and serves a
    vLLM cluster every feature (gateway/serving/features.py has no per-engine refusal): a named
    tool_choice gives one schema-valid call (the gateway's guide, enforced by vLLM on the legs),
    response_format json_schema valid JSON, and penalties are served, through the official client
    and the disaggregated vLLM P/D."""
    import jsonschema
    import openai

    _, g, key, _ = vllm_cluster
    client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather in a city",
            "parameters": params,
        },
    }
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    greedy = {"model": "smollm2", "temperature": 0, "max_tokens": 40}
    try:
        call, js, pen = await asyncio.gather(
            client.chat.completions.create(
                messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[weather],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                **greedy,
            ),
            client.chat.completions.create(
                messages=[{"role": "user", "content": "Invent a person."}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": schema, "strict": True},
                },
                **greedy,
            ),
            client.chat.completions.create(
                messages=[{"role": "user", "content": "Count to ten."}],
                frequency_penalty=1.0,
                presence_penalty=0.5,
                extra_body={"repetition_penalty": 1.1, "min_p": 0.05},
                **{**greedy, "max_tokens": 8},
            ),
        )
    finally:
        await client.close()
    ch = call.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
    assert ch.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), params)
    jsonschema.validate(json.loads(js.choices[0].message.content), schema)
    assert pen.choices[0].message.content and pen.usage and pen.usage.completion_tokens <= 8


async def test_p_killed_before_pull_follows_the_failure_policy(
    vllm_pd: tuple[Proc, Proc], vllm_d_fail: Proc, smollm2: Path
) -> None:
    """Runs last (kills the module's P). D's policy is recompute: the decode leg recomputes the
    prompt locally and answers the same greedy tokens; a D with the fail policy answers an
    error for that request (and serves the next one)."""
    p, d = vllm_pd
    ids = tokenize(smollm2, "Tell me a story about a lighthouse keeper. " * 4)  # in no cache yet
    async with aiohttp.ClientSession() as s:
        pre = await prefill_leg(s, p.url, ids, GREEDY, f"pre-{uuid.uuid4().hex}")
        pre_fail = await prefill_leg(s, p.url, ids, GREEDY, f"pre-{uuid.uuid4().hex}")
        p.kill()  # SIGKILL to the whole process group: vLLM's engine core and worker too
        r = await asyncio.wait_for(
            completion(s, d.url, ids, GREEDY, kv_transfer_params=pre["kv_transfer_params"]),
            timeout=300,
        )
        assert r.error is None, r.error
        assert (
            r.usage and r.usage["prompt_tokens_details"]["cached_tokens"] == 0
        )  # nothing was pulled
        f = await asyncio.wait_for(
            completion(
                s, vllm_d_fail.url, ids, GREEDY, kv_transfer_params=pre_fail["kv_transfer_params"]
            ),
            timeout=300,
        )
        assert f.error is not None and f.error["code"] == "request_failed", f.error
        # Both nodes serve on; the recomputed answer is the colocated one.
        want = await completion(s, vllm_d_fail.url, ids, GREEDY)
        assert want.error is None and len(want.token_ids) == 12
        assert r.token_ids == want.token_ids
        again = await completion(s, d.url, ids, GREEDY)
        assert again.error is None and again.token_ids == want.token_ids
