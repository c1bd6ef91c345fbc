"""Hardening the node path with real node processes on the tiny model: hostile input
to every endpoint gets a 4xx and leaves the node serving with its KV back at idle; a tiny
temperature does not kill a node; decode never trusts the client's address; a release that
is not a 200 is a failed pull; a full node answers 503 + Retry-After; a 400 on the decode leg
frees the prefill node's blocks."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.pd_client import completion, disaggregated, prefill_leg
from engine import LLM, SamplingParams
from tests.procs import Proc, duet_node, free_port, running
from tests.wait import until

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def metric(node: Proc, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(node.url + "/metrics", timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name}{{{labels}}} not in /metrics"
    return float(m.group(1))


def expected(tiny_llama: Path, prompt: list[int], **params: Any) -> list[int]:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=1024)
    return llm.generate([prompt], SamplingParams(**{**GREEDY, **params}))[0].token_ids


# -- the table ---------------------------------------------------------------------------------


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"prompt": [5, 6, 7], "max_tokens": 2, **fields}


def ktp(**fields: Any) -> dict[str, Any]:
    base = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_block_ids": [0],
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
    }
    return cmpl(kv_transfer_params={**base, **fields})


# (node, path, body: JSON object or raw bytes, expected status)
HOSTILE: list[tuple[str, str, Any, int]] = [
    ("both", "/v1/completions", b"{not json", 400),
    ("both", "/v1/completions", b'{"prompt": "\xff\xfe caf\xc3"}', 400),  # bad UTF-8
    ("both", "/v1/completions", b'{"prompt": [5], "temperature": NaN}', 400),
    ("both", "/v1/completions", b'{"prompt": [5], "temperature": Infinity}', 400),
    ("both", "/v1/completions", b'{"prompt": [5], "temperature": 1e400}', 400),
    ("both", "/v1/completions", b'{"prompt": [1e400]}', 400),
    ("both", "/v1/completions", b"[1, 2, 3]", 400),
    ("both", "/v1/completions", b"", 400),
    ("both", "/v1/completions", cmpl(temperature=-1), 400),
    ("both", "/v1/completions", cmpl(temperature=3), 400),
    ("both", "/v1/completions", cmpl(temperature="hot"), 400),
    ("both", "/v1/completions", cmpl(temperature=True), 400),
    ("both", "/v1/completions", cmpl(top_p=0), 400),
    ("both", "/v1/completions", cmpl(top_p=-0.5), 400),
    ("both", "/v1/completions", cmpl(top_k=-5), 400),
    ("both", "/v1/completions", cmpl(top_k=2**70), 400),
    ("both", "/v1/completions", cmpl(seed=2**64), 400),
    ("both", "/v1/completions", cmpl(max_tokens=0), 400),
    ("both", "/v1/completions", cmpl(max_tokens=-3), 400),
    ("both", "/v1/completions", cmpl(max_tokens=10**12), 400),
    ("both", "/v1/completions", cmpl(max_tokens=True), 400),
    ("both", "/v1/completions", cmpl(max_tokens=1.5), 400),
    ("both", "/v1/completions", cmpl(max_tokens="5"), 400),
    ("both", "/v1/completions", cmpl(min_tokens=-1), 400),
    ("both", "/v1/completions", cmpl(n=2), 400),
    ("both", "/v1/completions", cmpl(echo=True), 400),
    ("both", "/v1/completions", cmpl(logprobs=21), 400),
    ("both", "/v1/completions", cmpl(stop=[""]), 400),
    ("both", "/v1/completions", cmpl(stop=5), 400),
    ("both", "/v1/completions", cmpl(stop=["x" * 1025]), 400),  # the engine's step scans it
    (
        "both",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stop": "x" * 1025, "max_tokens": 2},
        400,
    ),
    ("both", "/v1/completions", cmpl(stop_token_ids=["a"]), 400),
    ("both", "/v1/completions", cmpl(priority="urgent"), 400),
    ("both", "/v1/completions", cmpl(stream="yes"), 400),
    ("both", "/v1/completions", cmpl(model="gpt-9"), 404),
    ("both", "/v1/completions", cmpl(prompt=[]), 400),
    ("both", "/v1/completions", cmpl(prompt=""), 400),
    ("both", "/v1/completions", cmpl(prompt=5), 400),
    ("both", "/v1/completions", cmpl(prompt={"a": 1}), 400),
    ("both", "/v1/completions", cmpl(prompt=[-1]), 400),
    ("both", "/v1/completions", cmpl(prompt=[10**9]), 400),
    ("both", "/v1/completions", cmpl(prompt=[2**70]), 400),
    ("both", "/v1/completions", cmpl(prompt=[True, 5]), 400),
    ("both", "/v1/completions", cmpl(prompt=[[1, 2], [3]]), 400),
    ("both", "/v1/completions", cmpl(prompt=[5] * 1100), 400),
    ("both", "/v1/completions", cmpl(kv_transfer_params=[1, 2]), 400),
    ("both", "/v1/completions", cmpl(kv_transfer_params={"do_remote_prefill": "yes"}), 400),
    (
        "both",
        "/v1/completions",
        cmpl(kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": True}),
        400,
    ),
    (
        "both",
        "/v1/completions",
        cmpl(kv_transfer_params={"do_remote_decode": True}, stream=True),
        400,
    ),
    # a migrated leg's continuation point (protocol/resume.py) must lie inside its prompt
    (
        "both",
        "/v1/completions",
        cmpl(resume={"output_tokens": 3, "text_chars": 0}),
        400,
    ),  # the whole prompt
    ("both", "/v1/completions", cmpl(resume={"output_tokens": 0, "text_chars": 0}), 400),
    ("both", "/v1/completions", cmpl(resume={"output_tokens": 1, "text_chars": -1}), 400),
    (
        "both",
        "/v1/completions",
        cmpl(resume={"output_tokens": 2, "text_chars": 0}, max_tokens=2),
        400,
    ),
    (
        "both",
        "/v1/completions",
        cmpl(resume={"output_tokens": 1, "text_chars": 0, "migration": 0}),
        400,
    ),
    ("both", "/v1/completions", cmpl(resume={"output_tokens": "1", "text_chars": 0}), 400),
    ("both", "/v1/completions", cmpl(resume={"output_tokens": 1}), 400),
    (
        "both",
        "/v1/completions",
        cmpl(resume={"output_tokens": 1, "text_chars": 0}, prompt_logprobs=1),
        400,
    ),
    ("prefill", "/v1/completions", ktp(), 400),  # a prefill node runs no decode legs
    ("decode", "/v1/completions", cmpl(kv_transfer_params={"do_remote_decode": True}), 400),
    ("decode", "/v1/completions", cmpl(kv_transfer_params={"do_remote_prefill": True}), 400),
    ("decode", "/v1/completions", ktp(remote_port=70000), 400),
    ("decode", "/v1/completions", ktp(remote_port=-1), 400),
    ("decode", "/v1/completions", ktp(remote_port=True), 400),
    ("decode", "/v1/completions", ktp(remote_port="80"), 400),
    ("decode", "/v1/completions", ktp(remote_block_ids=[[1]]), 400),
    ("decode", "/v1/completions", ktp(remote_block_ids=[10**30]), 400),
    ("decode", "/v1/completions", ktp(remote_block_ids=[-1]), 400),
    ("decode", "/v1/completions", ktp(remote_block_ids={"a": [1]}), 400),
    ("decode", "/v1/completions", ktp(remote_engine_id={"nested": ["junk"]}), 400),
    ("decode", "/v1/completions", ktp(remote_engine_id=""), 400),
    ("decode", "/v1/completions", ktp(remote_host=""), 400),
    ("decode", "/v1/completions", ktp(remote_host="no-such-host.invalid"), 400),
    ("decode", "/v1/completions", ktp(remote_host="x" * 1000), 400),
    ("decode", "/v1/completions", ktp(remote_host="169.254.169.254"), 403),  # cloud metadata
    ("decode", "/v1/completions", ktp(remote_host="8.8.8.8"), 403),  # public
    ("decode", "/v1/completions", ktp(remote_num_tokens="3"), 400),
    ("decode", "/v1/completions", ktp(lease_seconds="long"), 400),
    ("prefill", "/kv/release", b"{oops", 400),
    ("prefill", "/kv/release", b'{"request_id": "\xff"}', 400),
    ("prefill", "/kv/release", {}, 400),
    ("prefill", "/kv/release", {"request_id": 5}, 400),
    ("prefill", "/kv/release", {"request_id": "x", "block_ids": [1.5]}, 400),
    ("prefill", "/kv/release", {"request_id": "x", "block_ids": [True]}, 400),
    ("prefill", "/kv/release", {"request_id": "x", "block_ids": [{"a": 1}]}, 400),
    ("prefill", "/kv/release", {"request_id": "x", "extra": 1}, 400),  # unknown field
    ("prefill", "/kv/release", {"request_id": "never-prefilled"}, 404),  # unknown id
    ("prefill", "/abort", {"request_id": ["x"]}, 400),
    ("prefill", "/abort", {"request_id": "x", "extra": {"nested": 1}}, 400),
    ("decode", "/abort", b"\xff\xff", 400),
    ("decode", "/kv/release", {"request_id": "x"}, 404),  # a decode node holds nothing for others
    ("both", "/no/such/endpoint", {}, 404),
    ("both", "/v1/completions", {"prompt": "a" * (3 << 20)}, 413),  # more than any prompt needs
    ("prefill", "/kv/release", b"[" + b"1," * (2 << 20) + b"1]", 413),
    ("prefill", "/health", {}, 405),
]


async def test_hostile_input_gets_4xx_and_the_nodes_keep_serving(
    pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path
) -> None:
    p, d, both = pd_nodes
    nodes = {"prefill": p, "decode": d, "both": both}
    idle = {k: metric(n, "duet:kv_cache_usage_perc") for k, n in nodes.items()}
    failures = []
    async with aiohttp.ClientSession() as s:
        for i, (name, path, body, want) in enumerate(HOSTILE):
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with s.post(
                nodes[name].url + path,
                data=raw,
                headers={"Content-Type": "application/json", "X-Request-Id": f"hostile-{i}"},
            ) as r:
                text = await r.text()
                if r.status != want:
                    failures.append(
                        f"#{i} {name} {path} {raw[:80]!r}: {r.status} (want {want}) {text[:200]}"
                    )
                else:
                    err = json.loads(text)["error"]  # OpenAI's error body
                    assert set(err) == {"message", "type", "param", "code"} and err["message"], text
        assert not failures, "\n".join(failures)
        for name, node in nodes.items():
            async with s.get(node.url + "/health") as r:
                assert r.status == 200, name
        # Every node still serves correctly, and nothing leaked.
        prompt = [9, 8, 7, 6, 5]
        want = expected(tiny_llama, prompt)
        assert (await completion(s, both.url, prompt, GREEDY)).token_ids == want
        assert (await completion(s, p.url, prompt, GREEDY)).token_ids == want
        r = await disaggregated(s, p.url, d.url, [4] * 40, GREEDY)
        assert r.error is None and r.token_ids == expected(tiny_llama, [4] * 40)
    for name, node in nodes.items():
        await until(
            lambda n=node, k=name: metric(n, "duet:kv_cache_usage_perc") == idle[k],
            10,
            f"{name} idle",
        )


async def test_tiny_temperature_does_not_kill_the_node(
    pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path
) -> None:
    _, _, both = pd_nodes
    prompt = [5, 6, 7, 8]
    async with aiohttp.ClientSession() as s:
        want = expected(tiny_llama, prompt)
        r = await completion(s, both.url, prompt, {**GREEDY, "temperature": 1e-45})  # streamed
        assert r.error is None and r.token_ids == want
        async with s.post(
            both.url + "/v1/completions", json={"prompt": prompt, **GREEDY, "temperature": 1e-45}
        ) as j:
            assert j.status == 200 and (await j.json())["choices"][0]["token_ids"] == want
        async with s.get(both.url + "/health") as h:
            assert h.status == 200
        r = await completion(s, both.url, prompt, {**GREEDY, "temperature": 0.8, "seed": 1})
        assert r.error is None and len(r.token_ids) == 6


async def test_decode_400_releases_the_prefill_blocks(pd_nodes: tuple[Proc, Proc, Proc]) -> None:
    p, d, _ = pd_nodes
    held = metric(p, "duet:num_requests_held")
    async with aiohttp.ClientSession() as s:
        pre = await prefill_leg(s, p.url, [12] * 40, GREEDY, "bad-tail-1")
        assert metric(p, "duet:num_requests_held") == held + 1
        # The client says the KV covers 41 tokens of a 40-token prompt: its error, a 400...
        bad = {**pre["kv_transfer_params"], "remote_num_tokens": 41}
        r = await completion(s, d.url, [12] * 40, GREEDY, "bad-tail-1", bad)
        assert r.error is not None and "covers 41 tokens" in r.error["message"]
    # ...and P's blocks are not pinned until the lease ends.
    await until(lambda: metric(p, "duet:num_requests_held") == held, 10, "release on P")


async def test_abort_frees_a_held_prefill(pd_nodes: tuple[Proc, Proc, Proc]) -> None:
    p, _, _ = pd_nodes
    idle = metric(p, "duet:kv_cache_usage_perc")
    async with aiohttp.ClientSession() as s:
        await prefill_leg(s, p.url, [13] * 60, GREEDY, "abort-held-1")
        assert metric(p, "duet:kv_cache_usage_perc") > idle
        async with s.post(p.url + "/abort", json={"request_id": "abort-held-1"}) as r:
            assert r.status == 200 and (await r.json())["aborted"] is True
        async with s.post(p.url + "/kv/release", json={"request_id": "abort-held-1"}) as r:
            assert r.status == 404  # nothing held any more: the release says so
    await until(lambda: metric(p, "duet:kv_cache_usage_perc") == idle, 10, "blocks freed")


# -- trusted addresses ---------------------------------------------------------------------------


@pytest.fixture
async def release_proxy(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[str, int, list[str]]]:
    """A proxy in front of a prefill node: forwards GET /kv/metadata, answers /kv/release with
    the status given (the fault under test) and records what reached it."""
    target: dict[str, Any] = {}
    seen: list[str] = []

    async def metadata(req: web.Request) -> web.Response:
        seen.append("metadata")
        async with aiohttp.ClientSession() as s, s.get(target["url"] + "/kv/metadata") as r:
            return web.Response(body=await r.read(), content_type=r.content_type)

    async def release(req: web.Request) -> web.Response:
        seen.append("release")
        return web.json_response({"error": {"message": "injected"}}, status=target["status"])

    app = web.Application()
    app.router.add_get("/kv/metadata", metadata)
    app.router.add_post("/kv/release", release)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    target["status"] = 503
    try:
        yield "127.0.0.1", port, seen, target  # type: ignore[misc]
    finally:
        await runner.cleanup()


async def test_release_not_200_is_a_failed_pull_and_addresses_are_pinned(
    tiny_llama: Path, tmp_path: Path, release_proxy
) -> None:
    host, port, seen, target = release_proxy
    common = ("--dtype", "float32", "--kv-blocks", "128", "--max-model-len", "1024")
    # short holds: P's SIGTERM grace waits for its unpulled holds (two, by design of this test),
    # at the default 30 s lease that wait was half a minute of the suite; 15 s still outlasts the
    # asserts on the holds below, with room for a loaded machine
    p = duet_node("prefill", tiny_llama, tmp_path, *common, "--lease-seconds", "15")
    d = duet_node("decode", tiny_llama, tmp_path, *common, "--allowed-peers", "127.0.0.1/32")
    target["url"] = p.url
    prompt = [14] * 50
    want = expected(tiny_llama, prompt)
    with running(p, d):
        async with aiohttp.ClientSession() as s:
            pre = await prefill_leg(s, p.url, prompt, GREEDY, "stale-1")
            via_proxy = {**pre["kv_transfer_params"], "remote_host": host, "remote_port": port}
            r = await completion(s, d.url, prompt, GREEDY, "stale-1", via_proxy)
            # The bytes arrived but P did not confirm they were still its: recomputed, not trusted.
            assert r.error is None and r.token_ids == want
            assert seen == ["metadata", "release"]
            assert "answered 503 to the release" in d.log()
            # The engine id is now pinned to the proxy's address: the same id elsewhere is a 400,
            # and nothing is sent there.
            pre2 = await prefill_leg(s, p.url, prompt, GREEDY, "stale-2")
            r = await completion(s, d.url, prompt, GREEDY, "stale-2", pre2["kv_transfer_params"])
            assert (
                r.error is not None
                and r.error["status"] == 400
                and "is at 127.0.0.1:" in r.error["message"]
            )
            # Both prefills still hold their blocks on P: the only release went to the proxy.
            assert metric(p, "duet:num_requests_held") == 2
            # An address outside --allowed-peers (loopback, but not 127.0.0.1): 403, no contact.
            other = {
                **pre2["kv_transfer_params"],
                "remote_host": "127.0.0.2",
                "remote_engine_id": "x",
            }
            r = await completion(s, d.url, prompt, GREEDY, "stale-2", other)
            assert r.error is not None and r.error["status"] == 403
            assert "allowed peer networks" in r.error["message"]
            assert metric(p, "duet:num_requests_held") == 2


# -- backpressure ------------------------------------------------------------------------------


async def test_full_node_answers_503_with_retry_after(tiny_llama: Path, tmp_path: Path) -> None:
    node = duet_node(
        "prefill",
        tiny_llama,
        tmp_path,
        "--dtype",
        "float32",
        "--kv-blocks",
        "64",
        "--max-model-len",
        "512",
        "--lease-seconds",
        "120",
        "--max-waiting-requests",
        "1",
    )
    with running(node):
        idle = metric(node, "duet:kv_cache_usage_perc")
        async with aiohttp.ClientSession() as s:
            for i in range(2):  # two held prefills pin the whole pool (2 x 32 blocks)
                await prefill_leg(s, node.url, [20 + i] * 500, GREEDY, f"pin-{i}")
            waiting = asyncio.ensure_future(completion(s, node.url, [5] * 300, GREEDY))
            await until(
                lambda: metric(node, "duet:num_requests_waiting") == 1, 20, "a waiting request"
            )
            async with s.post(
                node.url + "/v1/completions", json={"prompt": [6] * 10, **GREEDY}
            ) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["code"] == "overloaded"
            assert metric(node, "duet:engine_queue_full") == 1
            assert metric(node, "duet:num_requests_rejected_total", 'reason="queue_full"') == 1
            for i in range(2):
                async with s.post(node.url + "/abort", json={"request_id": f"pin-{i}"}) as r:
                    assert (await r.json())["aborted"] is True
            result = await waiting
            assert result.error is None and len(result.token_ids) == 6
            async with s.post(node.url + "/v1/completions", json={"prompt": "x" * (2 << 20)}) as r:
                assert r.status == 413 and "context" in (await r.json())["error"]["message"]
        await until(lambda: metric(node, "duet:kv_cache_usage_perc") == idle, 10, "idle")


async def test_reservation_timeout_is_503_not_a_hang(tiny_llama: Path, tmp_path: Path) -> None:
    node = duet_node(
        "both",
        tiny_llama,
        tmp_path,
        "--dtype",
        "float32",
        "--kv-blocks",
        "65",
        "--max-model-len",
        "512",
        "--lease-seconds",
        "120",
        "--reserve-timeout",
        "1",
    )
    with running(node):
        idle = metric(node, "duet:kv_cache_usage_perc")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            small = await prefill_leg(s, node.url, [30] * 16, GREEDY, "small")  # 1 block
            for i in range(2):  # then 2 x 32 blocks: the pool is pinned
                await prefill_leg(s, node.url, [20 + i] * 500, GREEDY, f"pin-{i}")
            body = {
                "prompt": [30] * 16,
                **GREEDY,
                "kv_transfer_params": small["kv_transfer_params"],
            }
            async with s.post(
                node.url + "/v1/completions", json=body, headers={"X-Request-Id": "d-1"}
            ) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert "reserve KV blocks" in (await r.json())["error"]["message"]
            # The waiting request was dropped (stats are a snapshot of the engine's next step).
            await until(
                lambda: metric(node, "duet:num_requests_waiting") == 0, 10, "no waiting request"
            )
            for rid in ("small", "pin-0", "pin-1"):
                async with s.post(node.url + "/abort", json={"request_id": rid}) as a:
                    assert a.status == 200
        await until(lambda: metric(node, "duet:kv_cache_usage_perc") == idle, 10, "idle")


def test_nodes_listen_with_a_backlog_for_a_gateways_burst(
    pd_nodes: tuple[Proc, Proc, Proc],
) -> None:
    """A cold gateway pool opens up to 1024 connections to a node at once: the accept queue
    must hold them (`ss` shows a listener's backlog as Send-Q), or SYNs wait out a retransmit."""
    import shutil
    import subprocess

    from node.server import LISTEN_BACKLOG

    if shutil.which("ss") is None:
        pytest.skip("no `ss` on this machine")
    cap = int(Path("/proc/sys/net/core/somaxconn").read_text())
    for node in pd_nodes:
        out = subprocess.run(
            ["ss", "-ltnH", f"sport = :{node.port}"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert int(out[2]) == min(LISTEN_BACKLOG, cap), out
