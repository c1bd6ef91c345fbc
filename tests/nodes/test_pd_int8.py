"""P → D with an 8-bit KV pool (`--kv-cache-dtype int8`): the disaggregated answer equals a
colocated int8 node's token for token, the blocks that moved over NIXL are the int8 rows with
their scales (a block's bytes per the layout), and a decode node whose pool keeps the model's
dtype refuses the int8 prefill node's layout instead of reading its bytes as floats.

The nodes run on the CPU kernels (under CI=true a fallback would stop them): rope_store writes the
int8 rows that move, the decode attention kernel reads the rows that arrived."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp

from bench.pd_client import completion, disaggregated
from tests.nodes.test_pd import GREEDY, prompts
from tests.nodes.transfer_checks import PullCheck, layout_of, metric_sum, metrics_text
from tests.procs import duet_node, running

COMMON = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")
INT8 = (*COMMON, "--kv-cache-dtype", "int8")


async def test_pd_int8_equals_colocated_and_a_float_decode_node_refuses_it(
    tiny_llama: Path, tmp_path: Path
) -> None:
    ps = prompts(6, 1, 200, seed=13) + [[5] * 16, [6] * 33]
    p = duet_node("prefill", tiny_llama, tmp_path, *INT8, "--lease-seconds", "30")
    d = duet_node("decode", tiny_llama, tmp_path, *INT8)
    both = duet_node("both", tiny_llama, tmp_path, *INT8)
    d32 = duet_node("decode", tiny_llama, tmp_path, *COMMON)
    with running(p, d, both, d32):
        check = PullCheck(p, d, "nixl")
        async with aiohttp.ClientSession() as s:
            pd = [await disaggregated(s, p.url, d.url, x, GREEDY) for x in ps]
            co = [await completion(s, both.url, x, GREEDY) for x in ps]
            moved = check.verify(pd, ps)
            layout = check.layout
            assert layout.dtype == "int8" and layout_of(d32).dtype == "float32"
            info = re.search(r"^vllm:cache_config_info\{([^}]*)\} 1\.0$", metrics_text(d), re.M)
            assert info and 'cache_dtype="int8"' in info[1], info
            # 2 layers x K,V x 16 tokens x 2 KV heads x (head dim 16 + a 4-byte scale)
            assert layout.block_bytes == 2 * 2 * 16 * 2 * (16 + 4)
            assert moved == sum(-(-len(x) // 16) for x in ps) * layout.block_bytes
            for x, r, c in zip(ps, pd, co, strict=True):
                assert r.error is None and c.error is None, (r.error, c.error)
                assert len(r.token_ids) == GREEDY["max_tokens"]
                assert r.token_ids == c.token_ids, f"int8 P→D differs for a {len(x)}-token prompt"
            # an fp32 decode node never reads the int8 blocks: the pull is refused by layout
            # (the default failure policy then recomputes the prompt on D)
            log0 = len(d32.log())
            r = await disaggregated(s, p.url, d32.url, ps[0], GREEDY)
        assert r.error is None and len(r.token_ids) == GREEDY["max_tokens"]
        assert metric_sum(d32, "duet:kv_transfer_bytes_total") == 0
        assert "dtype: float32 != int8" in d32.log()[log0:], d32.log()[log0:]
