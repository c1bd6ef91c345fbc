"""Pulling a prompt's prefix from a peer (node/kv_pull.py, node/kv_share.py) between real node
processes: a colocated node pulls what a decode node computed, checks every block against the
source's digests and computes only the rest; another domain's prefix is never shared; a frozen
or dead source costs at most the pull's deadline, and the answer never changes."""

from __future__ import annotations

import os
import random
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from bench.pd_client import completion
from engine import LLM, SamplingParams
from tests.procs import TINY_NODE_ARGS, Proc, duet_node, running

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
PULL_TIMEOUT_S = 1.5


def counter(node: Proc, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(node.url + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    """A decode node (the source: it computed the first turn) and a colocated node that pulls."""
    tmp = tmp_path_factory.mktemp("peer-pull")
    src = duet_node("decode", tiny_llama, tmp, *TINY_NODE_ARGS)
    puller = duet_node(
        "both", tiny_llama, tmp, *TINY_NODE_ARGS, "--kv-pull-timeout-s", str(PULL_TIMEOUT_S)
    )
    with running(src, puller):
        yield src, puller


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def expected(model: Path, p: list[int]) -> list[int]:
    return LLM(str(model), dtype="float32").generate([p], SamplingParams(**GREEDY))[0].token_ids


def source_of(src: Proc, blocks: int) -> dict[str, object]:
    return {"kv_source": {"node_id": "src", "url": src.url, "num_blocks": blocks}}


async def test_a_node_pulls_a_decode_nodes_prefix_and_computes_the_rest(
    pair: tuple[Proc, Proc], tiny_llama: Path
) -> None:
    src, puller = pair
    first = prompt(1, 100)  # 6 full blocks cached on the source
    nxt = first + prompt(2, 50)
    want = expected(tiny_llama, nxt)
    computed = counter(puller, "duet:prompt_tokens_total")
    async with aiohttp.ClientSession() as s:
        assert (await completion(s, src.url, first, GREEDY)).error is None
        r = await completion(s, puller.url, nxt, {**GREEDY, **source_of(src, 6)})
    assert r.error is None and r.token_ids == want
    assert counter(puller, "duet:kv_peer_pulls_total", outcome="ok") == 1
    assert counter(puller, "duet:kv_peer_pulled_blocks_total") == 6
    assert counter(puller, "duet:kv_digest_checks_total", source="peer") == 6
    assert counter(puller, "duet:kv_digest_mismatches_total") == 0
    assert counter(puller, "duet:prompt_tokens_total") - computed == len(nxt) - 96
    assert "kv_pull_s" in r.timing


async def test_another_domains_prefix_is_never_shared(
    pair: tuple[Proc, Proc], tiny_llama: Path
) -> None:
    src, puller = pair
    first = prompt(3, 100)
    nxt = first + prompt(4, 40)
    async with aiohttp.ClientSession() as s:
        seeded = await completion(s, src.url, first, {**GREEDY, "cache_salt": "team:a"})
        assert seeded.error is None
        before = counter(puller, "duet:kv_peer_pulls_total", outcome="no_share")
        computed = counter(puller, "duet:prompt_tokens_total")
        # team b names team a's node as its source: the hashes it sends are team b's
        r = await completion(
            s, puller.url, nxt, {**GREEDY, "cache_salt": "team:b", **source_of(src, 6)}
        )
    assert r.error is None and r.token_ids == expected(tiny_llama, nxt)
    assert counter(puller, "duet:kv_peer_pulls_total", outcome="no_share") == before + 1
    assert counter(puller, "duet:prompt_tokens_total") - computed == len(nxt)


async def test_a_frozen_source_costs_at_most_the_deadline(
    pair: tuple[Proc, Proc], tiny_llama: Path
) -> None:
    src, puller = pair
    first = prompt(5, 100)
    nxt = first + prompt(6, 30)
    async with aiohttp.ClientSession() as s:
        assert (await completion(s, src.url, first, GREEDY)).error is None
        os.kill(src.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = await completion(s, puller.url, nxt, {**GREEDY, **source_of(src, 6)})
            took = time.monotonic() - t0
        finally:
            os.kill(src.proc.pid, signal.SIGCONT)
    assert r.error is None and r.token_ids == expected(tiny_llama, nxt)
    assert took < PULL_TIMEOUT_S + 10  # the pull gave up at its deadline, then computed
    assert counter(puller, "duet:kv_peer_pulls_total", outcome="no_share") >= 1


async def test_a_dead_source_falls_back_to_computing(
    pair: tuple[Proc, Proc], tiny_llama: Path
) -> None:
    src, puller = pair
    nxt = prompt(7, 120)
    src.kill()
    async with aiohttp.ClientSession() as s:
        r = await completion(s, puller.url, nxt, {**GREEDY, **source_of(src, 6)})
    assert r.error is None and r.token_ids == expected(tiny_llama, nxt)
