"""LoRA adapters on real nodes behind the cluster secret, with a real etcd and coordinator:
vLLM's load/unload endpoints and their refusals; a request names its adapter as its model and
gets transformers + PEFT's tokens, colocated and disaggregated (P and D both run it; D pulls P's
KV over NIXL); loading adapters on a node that is serving costs no request an error; the
coordinator routes an adapter's request, loads the adapter on the node it picked, and its
prefix index matches the node's blocks under the adapter's hash root."""

from __future__ import annotations

import asyncio
import re
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from bench.pd_client import completion, disaggregated
from protocol.block_hash import DEFAULT_BLOCK_SIZE, block_hashes, domain_root
from tests.fixtures.tiny_lora import make_adapter, peft_greedy
from tests.nodes.transfer_checks import pulled_blocks
from tests.procs import TINY_NODE_ARGS, Proc, running, secured_plane
from tests.wait import until

SECRET = secrets.token_urlsafe(24)
LORA = ("--max-loras", "2", "--max-lora-rank", "8")
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("node-loras")
    return [
        make_adapter(tiny_llama, root / f"a{i}", 10 + i, r=4, lora_alpha=8, target_modules=ALL)
        for i in range(3)
    ]


@pytest.fixture(scope="module")
def cluster(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, Proc, Proc, Proc]]:
    """(coordinator, prefill, decode, colocated), all with the secret and LoRA slots."""
    with secured_plane(tmp_path_factory.mktemp("lora-plane"), SECRET) as plane:
        nodes = [
            plane.node(role, tiny_llama, *TINY_NODE_ARGS, *LORA, node_id=f"{role}-0")
            for role in ("prefill", "decode", "both")
        ]
        with running(plane.coordinator, *nodes):
            yield plane.coordinator, *nodes  # type: ignore[misc]


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {SECRET}"})


async def _load(s: aiohttp.ClientSession, node: Proc, name: str, path: Path) -> tuple[int, str]:
    body = {"lora_name": name, "lora_path": str(path)}
    async with s.post(node.url + "/v1/load_lora_adapter", json=body) as r:
        return r.status, await r.text()


def _prompt(seed: int, n: int = 40) -> list[int]:
    rng = __import__("random").Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


async def test_load_unload_endpoints_and_adapter_requests(
    cluster: tuple[Proc, ...], adapters: list[Path], tiny_llama: Path
) -> None:
    both = cluster[3]
    async with (
        aiohttp.ClientSession() as anon,
        anon.post(both.url + "/v1/load_lora_adapter", json={}) as r,
    ):
        assert r.status == 401, "the endpoints are behind the cluster secret"
    async with (
        aiohttp.ClientSession() as anon,
        anon.post(both.url + "/inference/v1/generate", json={}) as r,
    ):
        assert r.status == 401, "so is vLLM's token-in/token-out endpoint"
    async with _session() as s:
        assert await _load(s, both, "a0", adapters[0]) == (
            200,
            "Success: LoRA adapter 'a0' added successfully.",
        )
        status, text = await _load(s, both, "a0", adapters[0])
        assert status == 400 and "already been loaded" in text
        status, text = await _load(s, both, "bad", adapters[0].parent / "missing")
        assert status == 400 and "not a directory" in text
        async with s.get(both.url + "/v1/models") as r:
            models = (await r.json())["data"]
        assert models[1]["id"] == "a0" and models[1]["root"] == str(adapters[0])
        # the endpoint pickers' LoRA metric names it resident (node/model_server_metrics.py)
        async with s.get(both.url + "/metrics") as r:
            text = await r.text()
        info = re.search(r"^vllm:lora_requests_info\{([^}]*)\} ", text, re.M)
        assert info, text
        labels = dict(re.findall(r'(\w+)="([^"]*)"', info[1]))
        assert labels["max_lora"] == "2" and labels["running_lora_adapters"] == "a0", labels
        base_name = models[0]["id"]
        prompt = _prompt(1)
        got = await completion(s, both.url, prompt, {**GREEDY, "model": "a0"})
        assert got.error is None and got.token_ids == peft_greedy(
            tiny_llama, adapters[0], prompt, 8
        )
        plain = await completion(s, both.url, prompt, {**GREEDY, "model": base_name})
        assert plain.token_ids != got.token_ids
        missing = await completion(s, both.url, prompt, {**GREEDY, "model": "nope"})
        assert missing.error is not None and missing.error["status"] == 404
        async with s.post(both.url + "/v1/unload_lora_adapter", json={"lora_name": "a0"}) as r:
            assert r.status == 200
        async with s.post(both.url + "/v1/unload_lora_adapter", json={"lora_name": "a0"}) as r:
            assert r.status == 404


async def test_loading_adapters_on_a_serving_node_costs_no_request_an_error(
    cluster: tuple[Proc, ...], adapters: list[Path], tiny_llama: Path
) -> None:
    both = cluster[3]
    results: list = []
    prompts = [_prompt(20 + i, 24) for i in range(4)]
    async with _session() as s:
        status, _ = await _load(s, both, "a0", adapters[0])
        assert status == 200
        stop = asyncio.Event()

        async def client(i: int) -> None:
            while not stop.is_set():
                model = {"model": "a0"} if i % 2 else {}
                r = await completion(s, both.url, prompts[i], {**GREEDY, **model})
                results.append((i, r))

        workers = [asyncio.create_task(client(i)) for i in range(4)]
        await until(lambda: len(results) >= 4, 60, "the node to serve")
        during = len(results)
        for name, path in (("a1", adapters[1]), ("a2", adapters[2])):  # a2 evicts the idle a1
            assert (await _load(s, both, name, path))[0] == 200
        await until(lambda: len(results) >= during + 8, 60, "requests after the loads")
        stop.set()
        await asyncio.gather(*workers)
        async with s.get(both.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"][1:]] == ["a0", "a2"]
    errors = [r.error for _, r in results if r.error is not None]
    assert not errors, errors
    want = {i: peft_greedy(tiny_llama, adapters[0], prompts[i], 8) for i in (1, 3)}
    for i, r in results:
        if i % 2:
            assert r.token_ids == want[i]


async def test_a_disaggregated_request_runs_its_adapter_on_both_legs(
    cluster: tuple[Proc, ...], adapters: list[Path], tiny_llama: Path
) -> None:
    _, p, d, _ = cluster
    prompt = _prompt(3, 70)
    async with _session() as s:
        for node in (p, d):
            assert (await _load(s, node, "a1", adapters[1]))[0] == 200
        rid = f"cmpl-{uuid.uuid4().hex}"
        got = await disaggregated(s, p.url, d.url, prompt, {**GREEDY, "model": "a1"}, rid)
    assert got.error is None, got.error
    assert pulled_blocks(d.log(), rid) == 5  # 70 tokens: 5 blocks of 16 moved over NIXL
    assert got.token_ids == peft_greedy(tiny_llama, adapters[1], prompt, 8)


async def test_the_coordinator_routes_and_places_an_adapter(
    cluster: tuple[Proc, ...], adapters: list[Path], tiny_llama: Path
) -> None:
    coord = cluster[0]
    prompt = _prompt(4, 64)
    async with _session() as s:
        async with s.get(cluster[3].url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        seed_root = domain_root(None, adapter="a2")
        hashes = block_hashes(prompt, DEFAULT_BLOCK_SIZE, parent=seed_root)
        route = {
            "model": model,
            "block_hashes": hashes,
            "num_prompt_tokens": len(prompt),
            "max_tokens": 8,
            "lora_name": "a2",
            "lora_path": str(adapters[2]),
        }
        async with s.post(coord.url + "/route", json=route) as r:
            assert r.status == 200, await r.text()
            target = (await r.json())["decode"]
        async with s.get(target["url"] + "/v1/models") as r:
            assert "a2" in [m["id"] for m in (await r.json())["data"]], "the route loaded it"
        got = await completion(s, target["url"], prompt, {**GREEDY, "model": "a2"})
        assert got.token_ids == peft_greedy(tiny_llama, adapters[2], prompt, 8)

        # the node's blocks reach the index under the adapter's root: the same hashes match
        async def cached() -> dict | None:
            async with s.post(coord.url + "/route", json=route) as r:
                d = (await r.json())["decode"]
            return d if d["cached_tokens"] else None

        again = await until(cached, 30, "the index to hold the adapter's blocks")
        assert again["node_id"] == target["node_id"] and again["cached_tokens"] == 63
        base = {**route, "block_hashes": block_hashes(prompt, DEFAULT_BLOCK_SIZE)}
        del base["lora_name"], base["lora_path"]
        async with s.post(coord.url + "/route", json=base) as r:
            assert (await r.json())["decode"]["cached_tokens"] == 0, "no match across adapters"
