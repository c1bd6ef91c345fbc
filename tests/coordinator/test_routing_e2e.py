"""Routing on a real cluster: etcd, two prefill nodes and a decode node (tiny model), one
coordinator process. Prefix affinity proven by the chosen node's own prefix-hit metric,
conditional disaggregation, and a SIGKILLed node leaving routing and the index."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from coordinator.etcd_server import EtcdServer
from protocol.block_hash import block_hashes
from protocol.cluster import NODE_TTL_S
from tests.coordinator.conftest import (
    cluster_node,
    coordinator,
    get,
    http,
    metric,
    node,
    node_id_of,
    wait_ready,
)
from tests.procs import running
from tests.wait import wait_for


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 380 + 1 for i in range(n)]


def route_body(toks: list[int], max_tokens: int = 8) -> dict:
    return {
        "model": "tiny-llama",
        "block_hashes": block_hashes(toks, 16),
        "num_prompt_tokens": len(toks),
        "max_tokens": max_tokens,
        "request_id": "test",
    }


def test_prefix_affinity_local_prefill_and_sigkill(
    tiny_llama: Path, tmp_path: Path, etcd: EtcdServer
) -> None:
    p1 = node("prefill", tiny_llama, tmp_path, etcd.url)
    p2 = node("prefill", tiny_llama, tmp_path, etcd.url)
    d1 = node("decode", tiny_llama, tmp_path, etcd.url)
    coord = coordinator(tmp_path, etcd.url)
    with running(p1, p2, d1, coord):
        procs = {node_id_of(p): p for p in (p1, p2, d1)}
        wait_ready(coord.url, list(procs))
        model = get(coord.url + "/cluster")["nodes"][0]["model"]

        def route(toks: list[int]) -> dict:
            status, body = http("POST", coord.url + "/route", {**route_body(toks), "model": model})
            assert status == 200, body
            return body

        # A short prompt is prefilled on the decode node.
        short = route(tokens(1, 100))
        assert short["prefill"] is None and short["decode"]["node_id"] == node_id_of(d1)
        assert short["reason"].startswith("local_short")

        # A long prompt goes to a prefill node; its prefill leg fills that node's cache.
        prefix = tokens(2, 512)
        first = route(prefix + tokens(3, 100))
        assert first["prefill"] is not None and first["prefill"]["cached_tokens"] == 0
        holder = first["prefill"]["node_id"]
        leg = {
            "prompt": prefix + tokens(3, 100),
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        status, body = http("POST", procs[holder].url + "/v1/completions", leg)
        assert status == 200, body
        wait_for(
            lambda: (cluster_node(coord.url, holder) or {}).get("indexed_blocks", 0) >= 38,
            30,
            "the first prompt's blocks in the index",
        )
        wait_ready(coord.url, list(procs))

        # The second prompt shares the 512-token prefix: same prefill node, and it reuses it.
        second_toks = prefix + tokens(4, 100)
        second = route(second_toks)
        assert second["prefill"]["node_id"] == holder, second["reason"]
        assert second["prefill"]["cached_tokens"] == 512
        hits = metric(procs[holder].url, "duet:prefix_cache_hits_total")
        status, body = http(
            "POST", procs[holder].url + "/v1/completions", {**leg, "prompt": second_toks}
        )
        assert status == 200, body
        assert metric(procs[holder].url, "duet:prefix_cache_hits_total") - hits >= 512

        # A prompt fully cached on the decode node is prefilled there.
        cached = tokens(5, 300)
        status, body = http("POST", d1.url + "/v1/completions", {"prompt": cached, "max_tokens": 1})
        assert status == 200, body
        wait_for(
            lambda: (cluster_node(coord.url, node_id_of(d1)) or {}).get("indexed_blocks", 0) >= 18,
            30,
            "the decode node's blocks in the index",
        )
        wait_ready(coord.url, list(procs))
        local = route(cached)
        assert local["prefill"] is None and local["reason"].startswith("local_cached"), local[
            "reason"
        ]
        assert local["decode"]["cached_tokens"] == 288

        # SIGKILL the holder: it leaves routing and the index within 2 × TTL.
        blocks_before = get(coord.url + "/cluster")["index_blocks"]
        t0 = time.monotonic()
        procs[holder].proc.send_signal(signal.SIGKILL)
        wait_for(
            lambda: cluster_node(coord.url, holder) is None,
            2 * NODE_TTL_S,
            "the killed node to leave",
        )
        assert time.monotonic() - t0 <= 2 * NODE_TTL_S
        assert get(coord.url + "/cluster")["index_blocks"] <= blocks_before - 38
        after = route(second_toks)
        assert (
            after["prefill"]["node_id"] not in (holder, None)
            and after["prefill"]["cached_tokens"] == 0
        )
        assert metric(coord.url, 'duet:route_decisions_total{outcome="disaggregated"}') >= 3
        assert metric(coord.url, 'duet:route_decisions_total{outcome="local_short"}') == 1
        status, _ = http(
            "POST", coord.url + "/route", {**route_body(tokens(6, 20)), "model": "nope"}
        )
        assert status == 404
        assert metric(coord.url, 'duet:route_decisions_total{outcome="model_not_found"}') == 1
