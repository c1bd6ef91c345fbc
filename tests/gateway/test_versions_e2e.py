"""A model over two versions through a real gateway: an etcd, a coordinator, version v1 on a
prefill and a decode node, version v2 (the same weights in a directory of another name, so its
nodes register another model name) on one colocated node, and the official openai client.

The gateway splits the model's requests by the versions' weights, exactly, and routes each with
its version's served name: every v1 request is prefilled on v1's P and decoded on v1's D, every
v2 request runs on v2's node — no request's legs ever span versions — and each usage record
names its version; `/v1/usage?group_by=version` totals them per model.
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.gateway.helpers import gateway_proc, http, make_team
from tests.procs import TINY_NODE_ARGS, Proc, running, secured_plane
from tests.wait import wait_for

SECRET = secrets.token_urlsafe(24)


@dataclass
class Versioned:
    gateway: Proc
    key: str


@pytest.fixture(scope="module")
def versioned(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Versioned]:
    tmp = tmp_path_factory.mktemp("versions-gw")
    v2 = shutil.copytree(tiny_llama, tmp / "tiny-v2")  # its nodes register "tiny-v2"
    model = {
        "kind": "cluster",
        "tokenizer": str(tiny_llama),
        "input_usd_per_mtok": 1.0,
        "output_usd_per_mtok": 2.0,
        "versions": {
            "v1": {"served_name": tiny_llama.name, "weight": 2},
            "v2": {"served_name": v2.name, "weight": 1},
        },
    }
    with secured_plane(tmp, SECRET, "--local-prefill-tokens", "8") as plane:
        nodes = [
            plane.node("prefill", tiny_llama, *TINY_NODE_ARGS, node_id="prefill-v1"),
            plane.node("decode", tiny_llama, *TINY_NODE_ARGS, node_id="decode-v1"),
            plane.node("both", v2, *TINY_NODE_ARGS, node_id="both-v2"),
        ]
        g = gateway_proc(
            tmp,
            {"tiny": model},
            args=plane.flag,
            routing={"coordinator": [plane.coordinator.url]},
        )
        with running(plane.coordinator, *nodes, g):
            plane.wait_ready({"prefill-v1", "decode-v1", "both-v2"})
            yield Versioned(g, make_team(g.url, "alice"))


def test_requests_split_by_weight_and_each_stays_on_its_version(versioned: Versioned) -> None:
    client = openai.OpenAI(
        base_url=versioned.gateway.url + "/v1", api_key=versioned.key, max_retries=0
    )
    start = time.time() - 1
    prompt = "The versions of one model answer in turn, each on its own nodes. " * 2
    rids = []
    for _ in range(6):
        r = client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=4, temperature=0
        )
        assert r.parse().usage is not None
        rids.append(r.headers["x-request-id"])
    url = f"{versioned.gateway.url}/v1/usage?start={start}&end={time.time() + 1}"

    def records() -> dict[str, dict] | None:
        status, _, body = http(url + "&group_by=record", key=versioned.key)
        assert status == 200, body
        got = {r["request_id"]: r for r in body["data"]}
        return got if set(rids) <= set(got) else None

    recs = wait_for(records, timeout=30, what="the usage records")
    seen = [(recs[rid]["version"], recs[rid]["nodes"]) for rid in rids]
    # weights 2:1, exactly: v1, v2, v1 in each cycle of three
    assert [v for v, _ in seen] == ["v1", "v2", "v1"] * 2
    for version, nodes in seen:
        want = "prefill-v1 decode-v1" if version == "v1" else "both-v2"
        assert nodes == want, (version, nodes)
    status, _, body = http(url + "&group_by=version", key=versioned.key)
    assert status == 200, body
    rows = {(r["model"], r["version"]): r["requests"] for r in body["data"]}
    assert rows == {("tiny", "v1"): 4, ("tiny", "v2"): 2}
