"""A node or coordinator reached without the cluster secret answers 401 and does nothing; with
it, everything works as before (the internal plane is authenticated).

The attack: the internal APIs trusted the network. Anyone who reached a node could run
completions on it for free (no team, no quota, no usage record), read its KV metadata and
events, release or abort other requests' work; anyone who reached a coordinator could read the
cluster and drain its nodes. Now every internal endpoint needs `Authorization: Bearer <secret>`
(runtime/cluster_secret.py), `/health` is the only exception and `/metrics` is open unless
`--protect-metrics`. Every internal client sends the secret: the gateway to the coordinator and
the nodes, the coordinator to the nodes (`/kv/events`), the decode node to the prefill node
(`/kv/metadata`, `/kv/release`, and the tcp transport's handshake), `duet status`.

Real parts: etcd, a coordinator, a prefill and a decode node (tiny model, tcp transport), the
gateway routing through the coordinator, the official openai client, `duet status`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.coordinator.conftest import http
from tests.gateway.helpers import ADMIN_KEY, gateway_proc, make_team
from tests.procs import Proc, running, secured_plane
from tests.wait import wait_for

MODEL = "tiny"
NODE_ARGS = (
    "--dtype",
    "float32",
    "--kv-blocks",
    "128",
    "--max-model-len",
    "512",
    "--transport",
    "tcp",
)
SECRET = secrets.token_urlsafe(32)
AUTH = {"Authorization": f"Bearer {SECRET}"}
WRONG = {"Authorization": f"Bearer {secrets.token_urlsafe(32)}"}


@dataclass
class Plane:
    coordinator: Proc
    prefill: Proc
    decode: Proc
    gateway: Proc
    key: str
    model: str
    secret_file: Path


def metric_value(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    status, text = http("GET", url + "/metrics", headers=headers)
    assert status == 200, text
    return sum(
        float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    )


@pytest.fixture(scope="module")
def plane(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    with secured_plane(
        tmp_path_factory.mktemp("internal-plane"), SECRET, "--local-prefill-tokens", "8"
    ) as sp:
        coord = sp.coordinator
        p = sp.node("prefill", tiny_llama, *NODE_ARGS, node_id="prefill-0")
        # --failure-policy fail: a pull whose metadata, read or release were refused fails the
        # request instead of hiding behind a local recompute
        d = sp.node(
            "decode",
            tiny_llama,
            *NODE_ARGS,
            "--protect-metrics",
            "--failure-policy",
            "fail",
            node_id="decode-0",
        )
        model = {"kind": "cluster", "tokenizer": str(tiny_llama), "served_name": tiny_llama.name}
        g = gateway_proc(
            sp.tmp,
            {MODEL: model},
            routing={"coordinator": [coord.url]},
            args=("--protect-metrics", *sp.flag),
        )
        with running(coord, p, d, g):

            def ready() -> bool:
                status, body = http("GET", coord.url + "/cluster", headers=AUTH)
                return status == 200 and {"prefill-0", "decode-0"} <= {
                    n["node_id"] for n in body["nodes"] if n["ready"]
                }

            # the coordinator's /kv/events streams to both nodes carry the secret, or no node is
            # ready
            wait_for(ready, timeout=60, what="both nodes ready")
            yield Plane(coord, p, d, g, make_team(g.url, "team-a"), tiny_llama.name, sp.secret_file)


def _internal(plane: Plane) -> list[tuple[str, str, Any]]:
    leg = {"model": plane.model, "prompt": list(range(10, 30)), "max_tokens": 2}
    chat = {"model": plane.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    out: list[tuple[str, str, Any]] = []
    for node in (plane.prefill, plane.decode):
        out += [
            ("POST", node.url + "/v1/completions", leg),
            ("POST", node.url + "/v1/chat/completions", chat),
            ("GET", node.url + "/v1/models", None),
            ("GET", node.url + "/kv/metadata", None),
            ("POST", node.url + "/abort", {"request_id": "someone-elses"}),
            ("GET", node.url + "/kv/snapshot", None),
            ("GET", node.url + "/kv/events?since=0", None),
            ("GET", node.url + "/spans?trace_id=" + "ab" * 16, None),
        ]
    out += [
        ("POST", plane.prefill.url + "/kv/release", {"request_id": "someone-elses"}),
        (
            "POST",
            plane.coordinator.url + "/route",
            {"model": plane.model, "block_hashes": [], "num_prompt_tokens": 4, "max_tokens": 2},
        ),
        ("GET", plane.coordinator.url + "/cluster", None),
        ("POST", plane.coordinator.url + "/nodes/decode-0/drain", {}),
    ]
    return out


def test_every_internal_endpoint_refuses_a_caller_without_the_secret(plane: Plane) -> None:
    computed = metric_value(plane.prefill.url, "duet:prompt_tokens_total")
    for method, url, body in _internal(plane):
        for headers in ({}, WRONG, {"Authorization": SECRET}, {"Authorization": f"Basic {SECRET}"}):
            status, answer = http(method, url, body, headers=headers)
            assert status == 401, (method, url, status, answer)
            assert answer["error"]["code"] == "cluster_secret_required", answer
    # ... and did nothing: no prompt computed, the node it tried to drain still active
    assert metric_value(plane.prefill.url, "duet:prompt_tokens_total") == computed
    status, cluster = http("GET", plane.coordinator.url + "/cluster", headers=AUTH)
    assert (
        status == 200
        and {n["node_id"]: n["status"] for n in cluster["nodes"]}["decode-0"] == "active"
    )


def test_health_is_open_and_metrics_are_protected_by_flag(plane: Plane) -> None:
    for proc in (plane.coordinator, plane.prefill, plane.decode, plane.gateway):
        assert http("GET", proc.url + "/health")[0] == 200
    assert http("GET", plane.prefill.url + "/metrics")[0] == 200  # open by default
    assert http("GET", plane.coordinator.url + "/metrics")[0] == 200
    for url in (plane.decode.url, plane.gateway.url):  # --protect-metrics
        assert http("GET", url + "/metrics")[0] == 401
        assert http("GET", url + "/metrics", headers=WRONG)[0] == 401
        assert http("GET", url + "/metrics", headers=AUTH)[0] == 200
    assert (
        http(
            "GET", plane.gateway.url + "/metrics", headers={"Authorization": f"Bearer {plane.key}"}
        )[0]
        == 401
    )
    assert (
        http(
            "GET", plane.gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )[0]
        == 200
    )


def test_with_the_secret_everything_works_as_before(plane: Plane) -> None:
    """Gateway → coordinator → prefill → decode (pulling over the tcp transport, releasing on
    P): every hop carries the secret, and the decode node reads real KV bytes (a refused hop
    would fail the request: the decode node runs with --failure-policy fail)."""
    moved = metric_value(plane.decode.url, "duet:kv_transfer_bytes_total", AUTH)
    computed = metric_value(plane.prefill.url, "duet:prompt_tokens_total")
    client = openai.AsyncOpenAI(
        base_url=plane.gateway.url + "/v1", api_key=plane.key, max_retries=0
    )

    async def one(i: int) -> openai.types.Completion:
        prompt = (
            f"Request {i}: the internal plane of the cluster is authenticated with one shared "
            "secret."
        )
        return await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0
        )

    async def all_of() -> list[openai.types.Completion]:
        try:
            return await asyncio.gather(*(one(i) for i in range(4)))
        finally:
            await client.close()

    for r in asyncio.run(all_of()):
        assert r.usage is not None and r.usage.completion_tokens > 0
    assert metric_value(plane.decode.url, "duet:kv_transfer_bytes_total", AUTH) > moved
    assert (
        metric_value(plane.prefill.url, "duet:prompt_tokens_total") > computed
    )  # the metric the refusals read
    # a leg sent by hand with the secret is served too
    status, body = http(
        "POST",
        plane.prefill.url + "/v1/completions",
        {"model": plane.model, "prompt": list(range(10, 30)), "max_tokens": 2},
        headers=AUTH,
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_duet_status_sends_the_secret(plane: Plane, tmp_path: Path) -> None:
    base = [
        sys.executable,
        "-m",
        "duet",
        "status",
        "--coordinator",
        plane.coordinator.url,
        "--json",
    ]
    with_secret = subprocess.run(
        [*base, "--cluster-secret-file", str(plane.secret_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert with_secret.returncode == 0, with_secret.stderr
    assert {n["node_id"] for n in json.loads(with_secret.stdout)["cluster"]["nodes"]} == {
        "prefill-0",
        "decode-0",
    }
    without = subprocess.run(
        base,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("DUET_CLUSTER")},
    )
    assert without.returncode == 1
    assert "HTTP 401" in json.dumps(json.loads(without.stdout)["errors"])
    assert "--cluster-secret-file" in json.dumps(json.loads(without.stdout)["errors"])


def test_bench_scrapes_send_the_secret(
    plane: Plane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench serve --scrape-metrics` reads a --protect-metrics endpoint with the secret it finds
    as every internal client does ($DUET_CLUSTER_SECRET_FILE); without one, the scrape records
    the 401 and why. The old scraper sent no secret: both endpoints were scrape errors."""
    import aiohttp

    from bench.scrape import Scraper

    urls = (plane.decode.url, plane.gateway.url)  # both --protect-metrics

    async def scrape() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session:
            s = Scraper(session, urls, 1.0)
            await s.snapshot("after")
            return {u: x[0] for u, x in s.scrapes.items()}

    for k in ("DUET_CLUSTER_SECRET", "DUET_CLUSTER_SECRET_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DUET_HOME", str(tmp_path))  # no `duet up` here: no secret at all
    for entry in asyncio.run(scrape()).values():
        assert (
            "samples" not in entry
            and "HTTP 401" in entry["error"]
            and "DUET_CLUSTER_SECRET_FILE" in entry["error"]
        )
    monkeypatch.setenv("DUET_CLUSTER_SECRET_FILE", str(plane.secret_file))
    got = asyncio.run(scrape())
    assert got[plane.decode.url + "/metrics"]["samples"], got
    assert any(
        k.startswith("duet:gateway_") for k in got[plane.gateway.url + "/metrics"]["samples"]
    ), got


def test_autoscale_step_reads_the_cluster_with_the_secret(
    plane: Plane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/autoscale_step.py samples the coordinator's /cluster (an internal endpoint) with the
    cluster secret it finds as scrapes do, and stops with the 401 named when it has none. The
    old sampler sent no secret and swallowed the 401: every sample was skipped and the run's
    node counts came out empty."""
    import argparse

    from bench.autoscale_step import _read_cluster, cluster_headers, run

    for k in ("DUET_CLUSTER_SECRET", "DUET_CLUSTER_SECRET_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DUET_HOME", str(tmp_path))  # no `duet up` here: no secret at all
    args = argparse.Namespace(
        coordinator=plane.coordinator.url, phases="1,1,1", rate=0.5, factor=2.0
    )
    with pytest.raises(SystemExit, match=r"HTTP 401.*DUET_CLUSTER_SECRET_FILE"):
        run(args)
    monkeypatch.setenv("DUET_CLUSTER_SECRET_FILE", str(plane.secret_file))
    nodes = _read_cluster(plane.coordinator.url, cluster_headers(plane.coordinator.url))
    assert {n["role"] for n in nodes} >= {"prefill", "decode"}, nodes


def test_metrics_guesses_of_the_admin_key_are_limited(plane: Plane) -> None:
    """A --protect-metrics gateway's /metrics takes the admin key: a wrong bearer token there
    counts as a failed admin attempt (the admin endpoints' 10 a minute per address), and a
    blocked address's key is not even compared. It compared the admin key with no limit."""
    import http.client
    from urllib.parse import urlsplit

    port = urlsplit(plane.gateway.url).port

    def get(key: str, source: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))
        try:
            conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
            r = conn.getresponse()
            r.read()
            return r.status
        finally:
            conn.close()

    assert get(ADMIN_KEY, "127.0.0.8") == 200
    for i in range(10):
        assert get(f"guess-{i}", "127.0.0.8") == 401
    assert get(ADMIN_KEY, "127.0.0.8") == 401  # blocked: not compared
    assert get(ADMIN_KEY, "127.0.0.9") == 200  # another address is not affected
