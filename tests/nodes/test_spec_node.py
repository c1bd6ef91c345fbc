"""Speculative decoding on the decode node of a P/D pair, real node processes on the
tiny model: a decode node with `--speculative draft-int4` (the model's own weights at int4 draft,
with its own KV; the prompt's KV comes from the prefill node over NIXL, the draft catches up on
the prompt itself) answers token for token what plain decoding does, and its /metrics carry
vLLM's spec-decode counters under duet's prefix (duet:spec_decode_*)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import aiohttp

from bench.pd_client import disaggregated
from engine import LLM, SamplingParams
from tests.nodes.test_hardening import metric
from tests.procs import duet_node, running

GREEDY = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
ARGS = ("--dtype", "bfloat16", "--kv-blocks", "128", "--max-model-len", "512")


async def test_decode_node_speculates_greedy_identical_with_metrics(
    tiny_llama: Path, tmp_path: Path
) -> None:
    prompts = [[(7 * i) % 380 + 3 for i in range(12)] * 2, list(range(3, 40))]
    llm = LLM(str(tiny_llama), dtype="bfloat16", max_model_len=512)
    expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY))]
    p = duet_node("prefill", tiny_llama, tmp_path, *ARGS)
    d = duet_node(
        "decode",
        tiny_llama,
        tmp_path,
        *ARGS,
        "--speculative",
        "draft-int4",
        "--num-speculative-tokens",
        "3",
    )
    with running(p, d):
        async with aiohttp.ClientSession() as s:
            got = [await disaggregated(s, p.url, d.url, x, GREEDY) for x in prompts]
        assert [r.error for r in got] == [None, None]
        assert [r.token_ids for r in got] == expected
        drafts = metric(d, "duet:spec_decode_num_drafts_total")
        proposed = metric(d, "duet:spec_decode_num_draft_tokens_total")
        accepted = metric(d, "duet:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 < accepted <= proposed <= 3 * drafts
        text = urllib.request.urlopen(d.url + "/metrics", timeout=5).read().decode()
        per_pos = {
            int(m[1]): float(m[2])
            for m in re.finditer(
                r"^duet:spec_decode_num_accepted_tokens_per_pos_total"
                r'\{[^}]*position="(\d+)"[^}]*\} (\S+)$',
                text,
                re.M,
            )
        }
        assert per_pos.get(0, 0) > 0 and sum(per_pos.values()) == accepted, per_pos
        assert all(
            per_pos[i] >= per_pos[i + 1] for i in range(len(per_pos) - 1)
        )  # reaching i + 1 passes i
        assert metric(p, "duet:spec_decode_num_drafts_total") == 0  # off there: zero, not missing
