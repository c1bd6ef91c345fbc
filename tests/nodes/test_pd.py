"""The disaggregated flow with real node processes and the default transport: P → D output is
token-identical to the offline engine and to a colocated node; failures have defined answers."""

from __future__ import annotations

import asyncio
import random
import re
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from bench.pd_client import completion, disaggregated, prefill_leg
from engine import LLM, SamplingParams
from tests.nodes.transfer_checks import PullCheck, layout_of
from tests.procs import Proc, duet_node, running
from tests.wait import until

GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def metrics(node: Proc, *names: str) -> list[float]:
    """The values of `names` from one scrape (two scrapes of a decoding node can differ)."""
    text = urllib.request.urlopen(node.url + "/metrics", timeout=5).read().decode()
    values = []
    for name in names:
        m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        values.append(float(m.group(1)))
    return values


def metric(node: Proc, name: str) -> float:
    return metrics(node, name)[0]


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


async def test_pd_equals_offline_and_colocated(
    pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path
) -> None:
    p, d, both = pd_nodes
    ps = prompts(8, 1, 200, seed=1) + [[5] * 16, [6] * 17]
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=1024)
    expected = [o.token_ids for o in llm.generate(ps, SamplingParams(**GREEDY))]
    check = PullCheck(p, d, "nixl")
    async with aiohttp.ClientSession() as s:
        pd = [await disaggregated(s, p.url, d.url, x, GREEDY) for x in ps]
        co = [await completion(s, both.url, x, GREEDY) for x in ps]
    # The tokens came from P's KV over NIXL, not from a silent recompute on D.
    moved = check.verify(pd, ps)
    assert moved == sum(-(-len(x) // 16) for x in ps) * check.layout.block_bytes
    assert check.layout.dtype == "float32"
    for x, r, c, e in zip(ps, pd, co, expected, strict=True):
        assert r.error is None, r.error
        assert r.token_ids == e, f"P→D differs for a {len(x)}-token prompt"
        assert c.token_ids == e
        assert r.usage and r.usage["prompt_tokens"] == len(x) and r.usage["completion_tokens"] == 12
        assert "transfer_s" in r.timing
    # Every pull released P's blocks: P holds nothing. D counted what it moved.
    assert metric(p, "duet:num_requests_held") == 0
    assert metric(d, "duet:kv_transfer_seconds_count") >= len(ps)
    assert metric(d, "duet:prefix_cache_queries_total") > 0
    # D checked every block it read against P's digests, and none failed
    assert (
        labelled(d, "duet:kv_digest_checks_total", "transfer") * check.layout.block_bytes == moved
    )
    assert labelled(d, "duet:kv_digest_mismatches_total", "transfer") == 0


def labelled(node: Proc, name: str, source: str) -> float:
    """A counter's value for one `source` label (0 when the node never counted that source)."""
    text = urllib.request.urlopen(node.url + "/metrics", timeout=5).read().decode()
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*source="{source}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_32_concurrent_disaggregated(
    pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path
) -> None:
    p, d, _ = pd_nodes
    ps = prompts(32, 10, 120, seed=2)
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=1024)
    expected = [o.token_ids for o in llm.generate(ps, SamplingParams(**GREEDY))]
    check = PullCheck(p, d, "nixl")
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*[disaggregated(s, p.url, d.url, x, GREEDY) for x in ps])
    assert [r.error for r in results] == [None] * 32
    assert [r.token_ids for r in results] == expected
    check.verify(list(results), ps)


async def test_min_tokens_request_does_not_kill_the_engine(
    pd_nodes: tuple[Proc, Proc, Proc],
) -> None:
    """min_tokens masks EOS in the sampler; that once wrote into the forward pass's read-only
    logits, so one such request killed the engine and every later request got a 500."""
    _, _, both = pd_nodes
    async with aiohttp.ClientSession() as s:
        r = await completion(
            s, both.url, [5, 6, 7], {"max_tokens": 6, "min_tokens": 4, "temperature": 0}
        )
        after = await completion(s, both.url, [5, 6, 7], {"max_tokens": 3, "temperature": 0})
    assert r.error is None and len(r.token_ids) >= 4, r.error
    assert after.error is None and len(after.token_ids) >= 1, after.error


async def test_a_pull_hidden_by_recompute_fails_the_transfer_check(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Why the P/D tests check more than tokens: a pull that cannot finish (a timeout no read
    meets) is recomputed on D, and the tokens are still right."""
    common = ("--dtype", "float32", "--kv-blocks", "64")
    p = duet_node("prefill", tiny_llama, tmp_path, *common)
    d = duet_node("decode", tiny_llama, tmp_path, *common, "--transfer-timeout", "1e-9")
    prompt = prompts(1, 60, 61, seed=5)[0]
    expected = (
        LLM(str(tiny_llama), dtype="float32")
        .generate([prompt], SamplingParams(**GREEDY))[0]
        .token_ids
    )
    with running(p, d):
        check = PullCheck(p, d, "nixl")
        async with aiohttp.ClientSession() as s:
            r = await disaggregated(s, p.url, d.url, prompt, GREEDY)
        assert r.error is None and r.token_ids == expected  # recompute: the tokens cannot tell
        with pytest.raises(AssertionError, match="KV pull failed"):
            check.verify([r], [prompt])


async def test_bad_input_gets_4xx_and_nodes_keep_serving(pd_nodes: tuple[Proc, Proc, Proc]) -> None:
    p, d, _ = pd_nodes
    async with aiohttp.ClientSession() as s:
        for node in (p, d):
            async with s.post(node.url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400 and "malformed" in (await r.json())["error"]["message"]
            async with s.post(node.url + "/v1/completions", json={"prompt": [5] * 1100}) as r:
                assert (
                    r.status == 400
                    and "maximum context length" in (await r.json())["error"]["message"]
                )
        pre = await prefill_leg(s, p.url, [7] * 40, GREEDY, "bad-input-1")
        ktp = pre["kv_transfer_params"]
        wrong_engine = {**ktp, "remote_engine_id": "no-such-engine"}
        async with s.post(
            d.url + "/v1/completions",
            json={"prompt": [7] * 40, **GREEDY, "kv_transfer_params": wrong_engine},
        ) as r:
            body = await r.json()
            assert r.status == 400 and "unknown remote_engine_id" in body["error"]["message"]
        wrong_count = {**ktp, "remote_block_ids": ktp["remote_block_ids"][:1]}
        async with s.post(
            d.url + "/v1/completions",
            json={"prompt": [7] * 40, **GREEDY, "kv_transfer_params": wrong_count},
        ) as r:
            assert r.status == 400 and "needs 3" in (await r.json())["error"]["message"]
        # A digest list that does not name every block: refused, and P's hold released
        third = (await prefill_leg(s, p.url, [8] * 40, GREEDY, "bad-input-3"))["kv_transfer_params"]
        short_digests = {**third, "remote_block_digests": third["remote_block_digests"][:2]}
        async with s.post(
            d.url + "/v1/completions",
            json={"prompt": [8] * 40, **GREEDY, "kv_transfer_params": short_digests},
        ) as r:
            msg = (await r.json())["error"]["message"]
            assert r.status == 400 and "one unsigned 64-bit digest per remote block" in msg
        async with s.post(p.url + "/kv/release", json={"request_id": "bad-input-3"}) as r:
            assert r.status == 404
        # Block ids of another request: D refuses (P's release check says they are not its).
        other = await prefill_leg(s, p.url, [3] * 40, GREEDY, "bad-input-2")
        swapped = {**ktp, "remote_block_ids": other["kv_transfer_params"]["remote_block_ids"]}
        async with s.post(
            d.url + "/v1/completions",
            json={"prompt": [7] * 40, **GREEDY, "kv_transfer_params": swapped},
        ) as r:
            assert r.status == 400 and "do not belong" in (await r.json())["error"]["message"]
        async with s.post(p.url + "/kv/release", json={"request_id": "bad-input-2"}) as r:
            assert r.status == 200
        # Block ids that do not belong to the request, on P's release endpoint.
        async with s.post(
            p.url + "/kv/release", json={"request_id": "bad-input-1", "block_ids": [0, 1, 999]}
        ) as r:
            assert r.status == 400 and "do not belong" in (await r.json())["error"]["message"]
        async with s.post(p.url + "/kv/release", json={"request_id": "never-seen"}) as r:
            assert r.status == 404
        # The real owner still releases fine, and both nodes still serve.
        async with s.post(p.url + "/kv/release", json={"request_id": "bad-input-1"}) as r:
            assert r.status == 200
        ok = await disaggregated(s, p.url, d.url, [9] * 20, GREEDY)
        assert ok.error is None and len(ok.token_ids) == 12


async def test_lease_expiry_frees_prefill_blocks_and_decode_recomputes(
    tiny_llama: Path, tmp_path: Path
) -> None:
    common = ("--dtype", "float32", "--kv-blocks", "64")
    p = duet_node("prefill", tiny_llama, tmp_path, *common, "--lease-seconds", "1")
    d = duet_node("decode", tiny_llama, tmp_path, *common)
    prompt = [8] * 100
    expected = (
        LLM(str(tiny_llama), dtype="float32")
        .generate([prompt], SamplingParams(**GREEDY))[0]
        .token_ids
    )
    with running(p, d):
        idle = metric(p, "duet:kv_cache_usage_perc")
        async with aiohttp.ClientSession() as s:
            pre = await prefill_leg(s, p.url, prompt, GREEDY, "lease-1")
            assert metric(p, "duet:kv_cache_usage_perc") > idle
            assert metric(p, "duet:num_requests_held") == 1
            await until(lambda: metric(p, "duet:kv_cache_usage_perc") == idle, 20, "lease expiry")
            assert metric(p, "duet:num_requests_held") == 0
            # Too late to pull: D notices (P no longer holds the blocks) and recomputes.
            r = await completion(s, d.url, prompt, GREEDY, "lease-1", pre["kv_transfer_params"])
    assert r.error is None and r.token_ids == expected
    assert "lease ran out" in d.log()


async def test_abort_mid_stream_frees_decode_blocks(pd_nodes: tuple[Proc, Proc, Proc]) -> None:
    p, d, _ = pd_nodes
    idle = metric(d, "duet:kv_cache_usage_perc")
    async with aiohttp.ClientSession() as s:
        pre = await prefill_leg(s, p.url, [11] * 60, GREEDY, "abort-1")
        body = {
            "prompt": [11] * 60,
            "max_tokens": 900,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "kv_transfer_params": pre["kv_transfer_params"],
        }
        r = await s.post(d.url + "/v1/completions", json=body, headers={"X-Request-Id": "abort-1"})
        chunks = 0
        async for line in r.content:
            if line.startswith(b"data: "):
                chunks += 1
            if chunks == 3:
                break
        assert metric(d, "duet:num_requests_running") == 1
        # the endpoint pickers' name for it (node/model_server_metrics.py) says the same
        assert metric(d, "vllm:num_requests_running") == 1
        # one scrape: the node is still decoding, so its use grows between two
        picker, own = metrics(d, "vllm:kv_cache_usage_perc", "duet:kv_cache_usage_perc")
        assert picker == own > idle
        r.close()  # the client goes away mid-stream
    await until(lambda: metric(d, "duet:num_requests_running") == 0, 20, "abort")
    await until(lambda: metric(d, "duet:kv_cache_usage_perc") == idle, 20, "blocks freed")
    assert "abort-1" in d.log()  # the X-Request-Id is in the node's log lines


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_prefill_node_killed_before_pull(
    tiny_llama: Path, tmp_path: Path, policy: str
) -> None:
    common = ("--dtype", "float32", "--kv-blocks", "128")
    p = duet_node("prefill", tiny_llama, tmp_path, *common)
    d = duet_node(
        "decode",
        tiny_llama,
        tmp_path,
        *common,
        "--failure-policy",
        policy,
        "--transfer-timeout",
        "5",
    )
    prompt = prompts(1, 50, 51, seed=4)[0]
    expected = (
        LLM(str(tiny_llama), dtype="float32")
        .generate([prompt], SamplingParams(**GREEDY))[0]
        .token_ids
    )
    with running(p, d):
        async with aiohttp.ClientSession() as s:
            pre = await prefill_leg(s, p.url, prompt, GREEDY, "killed-1")
            p.kill()
            r = await completion(s, d.url, prompt, GREEDY, "killed-1", pre["kv_transfer_params"])
    if policy == "recompute":
        assert r.error is None and r.token_ids == expected
    else:
        assert r.error is not None and "KV transfer" in r.error["message"] and r.token_ids == []


async def test_sigterm_drains_and_exits_zero(tiny_llama: Path, tmp_path: Path) -> None:
    node = duet_node("both", tiny_llama, tmp_path, "--dtype", "float32", "--grace-period", "20")
    with running(node):
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(
                completion(s, node.url, [5, 6, 7], {**GREEDY, "max_tokens": 900})
            )
            await until(lambda: metric(node, "duet:num_requests_running") == 1, 20, "request start")
            import signal

            node.proc.send_signal(signal.SIGTERM)

            async def refused() -> bool:
                async with s.post(node.url + "/v1/completions", json={"prompt": [5]}) as r:
                    return (
                        r.status == 503 and "shutting down" in (await r.json())["error"]["message"]
                    )

            assert await refused()
            result = await task
        assert result.error is None and len(result.token_ids) == 900  # the in-flight one finished
        assert node.proc.wait(30) == 0


def test_a_scrape_holds_the_model_server_protocols_metrics(
    pd_nodes: tuple[Proc, Proc, Proc],
) -> None:
    """Every metric the inference gateway's model-server protocol names is on every node's
    /metrics, under vLLM's name and labels, with its duet:* twin's value."""
    for node in pd_nodes:
        text = urllib.request.urlopen(node.url + "/metrics", timeout=5).read().decode()
        for name, twin in (
            ("vllm:num_requests_waiting", "duet:num_requests_waiting"),
            ("vllm:num_requests_running", "duet:num_requests_running"),
            ("vllm:kv_cache_usage_perc", "duet:kv_cache_usage_perc"),
            ("vllm:gpu_cache_usage_perc", "duet:kv_cache_usage_perc"),
        ):
            picker, own = metrics(node, name, twin)
            assert picker == own, name
            assert re.search(rf'^{re.escape(name)}\{{model_name="[^"]+"\}} ', text, re.M), name
        layout = layout_of(node)
        info = re.search(r"^vllm:cache_config_info\{([^}]*)\} 1\.0$", text, re.M)
        assert info, text
        labels = dict(re.findall(r'(\w+)="([^"]*)"', info[1]))
        assert labels["block_size"] == str(layout.block_size)
        assert labels["num_gpu_blocks"] == str(layout.num_blocks) == "256"  # --kv-blocks 256
        lora = re.search(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", text, re.M)
        assert lora, text
        labels = dict(re.findall(r'(\w+)="([^"]*)"', lora[1]))
        assert labels["max_lora"] == "0" and labels["running_lora_adapters"] == ""
        assert labels["waiting_lora_adapters"] == "" and float(lora[2]) > 1.7e9  # a Unix time
