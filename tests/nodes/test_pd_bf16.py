"""P → D in bf16, the default dtype where the CPU has native bf16: the disaggregated answer
equals a colocated bf16 node's token for token, and the KV really moved over NIXL (bf16
blocks: half the fp32 bytes). D computes the last prompt token against pulled KV while the
colocated node prefills the whole prompt, so this also checks that both paths round alike."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from bench.pd_client import completion, disaggregated
from tests.nodes.test_pd import GREEDY, prompts
from tests.nodes.transfer_checks import PullCheck
from tests.procs import three_nodes

COMMON = ("--dtype", "bfloat16", "--kv-blocks", "256", "--max-model-len", "1024")


async def test_pd_bf16_equals_colocated_and_moves_bf16_blocks(
    tiny_llama: Path, tmp_path: Path
) -> None:
    ps = prompts(10, 1, 300, seed=11) + [[5] * 16, [6] * 33]
    with three_nodes(tiny_llama, tmp_path, *COMMON) as (p, d, both):
        check = PullCheck(p, d, "nixl")
        async with aiohttp.ClientSession() as s:
            pd = [await disaggregated(s, p.url, d.url, x, GREEDY) for x in ps]
            co = [await completion(s, both.url, x, GREEDY) for x in ps]
        moved = check.verify(pd, ps)
    layout = check.layout
    assert layout.dtype == "bfloat16"
    # 2 layers x K,V x 16 tokens x 2 KV heads x head dim 16 x 2 bytes
    assert layout.block_bytes == 2 * 2 * 16 * 2 * 16 * 2
    assert moved == sum(-(-len(x) // 16) for x in ps) * layout.block_bytes
    for x, r, c in zip(ps, pd, co, strict=True):
        assert r.error is None and c.error is None, (r.error, c.error)
        assert len(r.token_ids) == GREEDY["max_tokens"]
        assert r.token_ids == c.token_ids, (
            f"bf16 P→D differs from colocated for a {len(x)}-token prompt"
        )
