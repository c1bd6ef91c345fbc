"""Measured latency in real load frames: a node that served requests reports, in the
load frames it streams to coordinators, its TTFT P90 (prefill and colocated nodes) and ITL P90
(decode and colocated nodes) over its recent window with the sample counts; a real coordinator
reads them (its `/cluster` load report shows what the planner's load mode gets: the same
NodeView.load, tests/planner/test_loop.py decides on it), each with the window's histogram.

Real etcd, a real coordinator, a colocated and a prefill node on the tiny model."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

from coordinator.etcd_server import EtcdServer
from protocol.latency_hist import RELATIVE_ERROR, LatencyHistogram, MergedLatency
from tests.coordinator.conftest import coordinator, get, http, node, node_id_of, wait_ready
from tests.procs import running
from tests.wait import wait_for

REQUESTS = 24
MAX_TOKENS = 4


def _stream(url: str, prompt: list[int]) -> int:
    """A streamed completion; the number of chunks that carried tokens."""
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    chunks = 0
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunks += bool(json.loads(line[6:])["choices"][0].get("token_ids"))
    return chunks


def _load(coord_url: str, node_id: str) -> dict[str, Any]:
    nodes = {n["node_id"]: n for n in get(coord_url + "/cluster")["nodes"]}
    return (nodes.get(node_id) or {}).get("load") or {}


def test_load_frames_carry_the_measured_ttft_and_itl(
    tiny_llama: Path, tmp_path: Path, etcd: EtcdServer
) -> None:
    both = node("both", tiny_llama, tmp_path, etcd.url)
    pre = node("prefill", tiny_llama, tmp_path, etcd.url)
    coord = coordinator(tmp_path, etcd.url)
    with running(both, pre, coord):
        ids = {"both": node_id_of(both), "prefill": node_id_of(pre)}
        wait_ready(coord.url, list(ids.values()))
        # nothing served yet: measured, but no samples
        assert _load(coord.url, ids["both"])["ttft_samples"] == 0

        token_chunks = sum(
            _stream(both.url, [(7 + i * 13 + k) % 380 + 1 for k in range(24)])
            for i in range(REQUESTS)
        )
        for i in range(REQUESTS):  # prefill legs: one token each, the KV held for a decode node
            status, out = http(
                "POST",
                pre.url + "/v1/completions",
                {
                    "prompt": [(11 + i * 17 + k) % 380 + 1 for k in range(24)],
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True},
                },
            )
            assert status == 200, out

        def measured(key: str, ttfts: int, gaps: int = 0) -> dict[str, Any] | None:
            # Both counts: a frame built while the last stream was still decoding (the
            # coordinator may hold it a moment, e.g. across a reconnect of its event stream)
            # has every TTFT and not yet every gap; a node that lost gaps never gets here.
            load = _load(coord.url, ids[key])
            return (
                load
                if load.get("ttft_samples", 0) >= ttfts and load.get("itl_samples", 0) >= gaps
                else None
            )

        gaps = token_chunks - REQUESTS
        colocated = wait_for(
            lambda: measured("both", REQUESTS, gaps),
            30,
            "the colocated node's frame with its TTFTs and gaps",
        )
        prefill = wait_for(
            lambda: measured("prefill", REQUESTS), 30, "the prefill node's frame with its TTFTs"
        )

        # colocated: one TTFT per request, one gap per later token chunk (the same observations
        # as its histograms), P90s that are real durations
        assert colocated["ttft_samples"] == REQUESTS
        assert colocated["itl_samples"] == gaps > 0
        assert 0 < colocated["ttft_p90_s"] < 30 and 0 < colocated["itl_p90_s"] < 30, colocated
        # prefill: TTFT only (it makes first tokens, it does not decode)
        assert prefill["ttft_samples"] == REQUESTS and prefill["ttft_p90_s"] > 0
        assert (prefill["itl_samples"], prefill["itl_p90_s"]) == (0, 0.0), prefill
        # each figure comes with the window's histogram, which the planner merges over a pool:
        # one node's histogram reads its own P90 within the bucket resolution
        for load, figure in ((colocated, "ttft"), (colocated, "itl"), (prefill, "ttft")):
            hist = msgspec.convert(load[f"{figure}_hist"], LatencyHistogram)
            merged = MergedLatency()
            assert merged.add(hist) and merged.total == load[f"{figure}_samples"], load
            p90 = load[f"{figure}_p90_s"]
            assert abs(merged.quantile(0.9) - p90) <= RELATIVE_ERROR * p90, (figure, load)
        assert prefill["itl_hist"] is None
