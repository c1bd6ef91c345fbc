"""The real default model through real P and D processes: 8 greedy prompts of 16-900 tokens
give the same tokens P → D, colocated, and offline, and P → D really pulled every prompt's KV
over NIXL (tests/nodes/transfer_checks.py)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest

from bench.pd_client import completion, disaggregated
from engine import LLM, SamplingParams
from tests.nodes.transfer_checks import PullCheck
from tests.procs import three_nodes

pytestmark = pytest.mark.smollm2
GREEDY = {"max_tokens": 16, "temperature": 0}
COMMON = ("--dtype", "float32", "--kv-memory", "256MiB", "--max-model-len", "1024")


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    rng = random.Random(7)
    words = "the of and to in is was for on that with as by at from his an were are which".split()
    out = []
    # one length per octave up to the context's end (16 would double the wall time: 126 s in CI)
    for i, n in enumerate([16, 47, 90, 150, 256, 400, 640, 900]):
        if i % 2 == 0:  # chat prompts: the model answers sensibly
            text = " ".join(rng.choice(words) for _ in range(n))
            ids = tok.encode_chat([{"role": "user", "content": "Rewrite clearly: " + text}])
        else:  # raw text
            ids = tok.encode(" ".join(rng.choice(words) for _ in range(n * 2)))
        out.append(ids[:n] if len(ids) > n else ids)
    return out


async def test_8_prompts_pd_equals_offline_and_colocated(smollm2: Path, tmp_path: Path) -> None:
    llm = LLM(str(smollm2), dtype="float32", max_model_len=1024, kv_memory="256MiB")
    ps = _prompts(llm)
    assert len(ps) == 8 and min(map(len, ps)) >= 16 and max(map(len, ps)) >= 890
    expected = [o.token_ids for o in llm.generate(ps, SamplingParams(**GREEDY))]
    del llm
    with three_nodes(smollm2, tmp_path, *COMMON) as (p, d, both):
        check = PullCheck(p, d, "nixl")
        async with aiohttp.ClientSession() as s:
            # Concurrent: continuous batching must not change greedy tokens (fp32).
            pd, co = await asyncio.gather(
                asyncio.gather(*[disaggregated(s, p.url, d.url, x, GREEDY) for x in ps]),
                asyncio.gather(*[completion(s, both.url, x, GREEDY) for x in ps]),
            )
        # Every prompt's KV came over NIXL, less the chat template's shared system-prompt
        # blocks D may already hold: 30 layers x K,V x 16 tokens x 3 KV heads x 64 x 4 bytes.
        moved = check.verify(list(pd), ps)
    assert check.layout.block_bytes == 30 * 2 * 16 * 3 * 64 * 4
    assert (
        moved
        >= sum(-(-len(x) // 16) - check.shared_blocks(x, ps) for x in ps) * check.layout.block_bytes
    )
    for x, r, c, e in zip(ps, pd, co, expected, strict=True):
        assert r.error is None and c.error is None
        assert r.token_ids == e, f"P→D differs from LLM.generate for a {len(x)}-token prompt"
        assert c.token_ids == e, f"colocated differs from LLM.generate for a {len(x)}-token prompt"
