"""P → D for an architecture past the Llama family: a tiny Gemma 3 (sliding-window and global
layers, each kind with its own rotary table, q/k norms) prefills on one node, a decode node
pulls its KV over NIXL and decodes: the answer is transformers' token for token, the blocks
really moved, and both nodes' KV layout says which layers slide (KVLayout.attention)."""

from __future__ import annotations

import uuid
from pathlib import Path

import aiohttp
import pytest

from bench.pd_client import disaggregated
from tests.engine.oracle import hf_greedy
from tests.fixtures.tiny_archs import make_tiny_arch
from tests.nodes.transfer_checks import layout_of, pulled_blocks, transport_of
from tests.procs import TINY_NODE_ARGS, duet_node, running

GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_arch(tmp_path_factory.mktemp("pd-gemma3"), "gemma3")


async def test_gemma3_prefill_to_decode_matches_transformers(gemma3: Path, tmp_path: Path) -> None:
    p = duet_node("prefill", str(gemma3), tmp_path, *TINY_NODE_ARGS, "--max-model-len", "512")
    d = duet_node("decode", str(gemma3), tmp_path, *TINY_NODE_ARGS, "--max-model-len", "512")
    # past the 12-token window; no two share a first block (each pulls all of its blocks)
    prompts = [[i + 3, *range(100, 99 + n)] for i, n in enumerate((20, 47, 90))]
    with running(p, d):
        assert transport_of(p) == transport_of(d) == "nixl"
        layout = layout_of(p)
        assert layout.attention == "gemma3_text;window=12;layers=sfsf"
        assert layout.compat_hash == layout_of(d).compat_hash
        async with aiohttp.ClientSession() as s:
            for prompt in prompts:
                rid = f"cmpl-{uuid.uuid4().hex}"
                got = await disaggregated(s, p.url, d.url, prompt, GREEDY, rid)
                assert got.error is None, got.error
                assert pulled_blocks(d.log(), rid) == -(-len(prompt) // 16)
                assert got.token_ids == hf_greedy(gemma3, prompt, 10), f"{len(prompt)} tokens"
