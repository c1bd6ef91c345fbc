"""Bytes corrupted between a block's digest and its reader, between real node processes: a
prefill node's held block (what a decode node reads over the transport) and a block a peer
shares. Every corrupt block is caught by the reader's digest check, its tokens recomputed, and
the answer is the one a cold run gives."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import aiohttp
import pytest

from bench.pd_client import completion, disaggregated
from engine import LLM, SamplingParams
from kvtransfer.hashed_read import OVERLAP_ENV
from tests.nodes.test_peer_pull import counter
from tests.procs import TINY_NODE_ARGS, Proc, duet_node, free_port, running

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def corrupting(model: Path, tmp: Path) -> Proc:
    """A colocated node that corrupts both what it holds for a decode node and what it shares."""
    port = free_port()
    args = [sys.executable, "-m", "tests.nodes.corrupting_node", "held,share", "node"]
    args += ["--role", "both", "--model", str(model), "--port", str(port), "--threads", "1"]
    return Proc([*args, *TINY_NODE_ARGS], port, tmp / f"corrupting-{port}.log")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def cold(model: Path, *prompts: list[int]) -> list[list[int]]:
    """Each prompt's tokens alone on one in-process engine (the answers a node must give)."""
    llm = LLM(str(model), dtype="float32")
    return [llm.generate([p], SamplingParams(**GREEDY))[0].token_ids for p in prompts]


@pytest.mark.parametrize("overlap", ["1", "0"], ids=["hashed-while-read", "hashed-after-read"])
async def test_corrupt_bytes_in_transit_and_in_a_share_are_caught(
    tiny_llama: Path, tmp_path: Path, overlap: str
) -> None:
    """Every corrupt block is caught whether the reading node hashes the blocks beside the copy
    or once it is over."""
    x, first = prompt(1, 70), prompt(2, 100)
    nxt = first + prompt(3, 40)
    want_x, want_nxt = cold(tiny_llama, x, nxt)
    src = corrupting(tiny_llama, tmp_path)
    d = duet_node("both", tiny_llama, tmp_path, *TINY_NODE_ARGS, env={OVERLAP_ENV: overlap})
    with running(src, d):
        async with aiohttp.ClientSession() as s:
            # P → D: P's second block is corrupt by the time D reads it
            r = await disaggregated(s, src.url, d.url, x, GREEDY)
            assert r.error is None and r.token_ids == want_x
            assert counter(d, "duet:kv_digest_mismatches_total", source="transfer") == 1
            assert counter(d, "duet:kv_digest_checks_total", source="transfer") == 2  # 0 ok, 1 bad
            # peer → node: the source's first shared block is corrupt when it is read
            assert (await completion(s, src.url, first, GREEDY)).error is None
            source = {"kv_source": {"node_id": "src", "url": src.url, "num_blocks": 6}}
            computed = counter(d, "duet:prompt_tokens_total")
            r = await completion(s, d.url, nxt, {**GREEDY, **source})
            assert r.error is None and r.token_ids == want_nxt
            assert counter(d, "duet:kv_digest_mismatches_total", source="peer") == 1
            assert counter(d, "duet:kv_peer_pulls_total", outcome="mismatch") == 1
            # the first block failed: nothing pulled was used, the whole prompt was computed
            assert counter(d, "duet:prompt_tokens_total") - computed == len(nxt)
