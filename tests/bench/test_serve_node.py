"""`duet bench serve` against a real duet node process (tiny random model): token-id prompts
and text prompts on /v1/completions, exact output lengths (ignore_eos) counted from the
node's usage chunk, shared prefixes that the node's prefix cache hits, and scrapes of the
node's /metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.serve import main
from tests.procs import duet_node, running

COMMON = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")


def test_bench_serve_against_a_duet_node(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = duet_node("both", tiny_llama, tmp_path, *COMMON)
    with running(node):
        assert (
            main(
                [
                    "--base-url",
                    node.url,
                    "--prompt-format",
                    "tokens",
                    "--tokenizer",
                    str(tiny_llama),
                    "--input-len",
                    "uniform:4,24",
                    "--output-len",
                    "6",
                    "--ignore-eos",
                    "--num-requests",
                    "8",
                    "--max-concurrency",
                    "4",
                    "--prefix-groups",
                    "2",
                    "--prefix-len",
                    "32",
                    "--warmup",
                    "1",
                    "--scrape-metrics",
                    node.url,
                    "--slo",
                    "ttft=60000",
                    "--json",
                    "--quiet",
                ]
            )
            == 0
        )
        r = json.loads(capsys.readouterr().out)
        assert r["completed"] == 8 and r["failed"] == 0, r["failures"]
        assert (
            r["output_lens"] == [6] * 8 and r["usage_reported"] == 8
        )  # from the node's usage chunk
        assert all(32 + 4 <= n <= 32 + 24 for n in r["input_lens"])
        assert all(0 < t <= e for t, e in zip(r["ttfts"], r["e2els"], strict=True))
        assert r["mean_tpot_ms"] > 0 and r["p99_itl_ms"] > 0 and r["good_requests"] == 8
        summary = r["scrapes"][node.url + "/metrics"]["summary"]
        assert summary["failed_scrapes"] == 0
        # 8 requests over 2 shared 32-token prefixes (2 blocks each), 4 at a time: the later
        # ones find their prefix cached
        assert summary["prefix_cache_hits"] > 0 and r["total_cached_tokens"] > 0
        # each request's group is in the result (a replay, sim/workload.py, shares prefixes as the
        # run did)
        assert len(r["groups"]) == 8 and set(r["groups"]) <= {0, 1}
        assert r["prefix_tokens"] == [32] * 8  # token-id prompts: the prefix exactly
        assert (
            main(
                [
                    "--base-url",
                    node.url,
                    "--tokenizer",
                    str(tiny_llama),
                    "--input-len",
                    "16",
                    "--output-len",
                    "3",
                    "--ignore-eos",
                    "--num-requests",
                    "3",
                    "--json",
                    "--quiet",
                ]
            )
            == 0
        )
        t = json.loads(capsys.readouterr().out)
        assert (
            t["completed"] == 3
            and t["output_lens"] == [3] * 3
            and t["config"]["prompt_format"] == "text"
        )
        assert t["groups"] == [None] * 3 and t["prefix_tokens"] == [None] * 3
        # text prompts over shared prefixes: what each shares with its group's prefix once the
        # text is tokenized again (the node's prefix cache hits its full blocks of that)
        assert (
            main(
                [
                    "--base-url",
                    node.url,
                    "--tokenizer",
                    str(tiny_llama),
                    "--input-len",
                    "24",
                    "--output-len",
                    "2",
                    "--ignore-eos",
                    "--num-requests",
                    "6",
                    "--max-concurrency",
                    "1",
                    "--prefix-groups",
                    "1",
                    "--prefix-len",
                    "48",
                    "--json",
                    "--quiet",
                ]
            )
            == 0
        )
        x = json.loads(capsys.readouterr().out)
        pairs = list(zip(x["prefix_tokens"], x["input_lens"], x["cached_tokens"], strict=True))
        assert x["completed"] == 6 and all(isinstance(k, int) and 0 < k <= n for k, n, _ in pairs)
        # the node's cache hits only full blocks of what a prompt shares with the prefix (the
        # tiny model's tokenizer merges random ids' text heavily: k is often the whole prompt)
        assert all(c <= min(k, n - 1) // 16 * 16 for k, n, c in pairs) and any(
            c > 0 for _, _, c in pairs
        )
