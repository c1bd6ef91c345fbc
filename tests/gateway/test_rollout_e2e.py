"""A rollout under steady load through a real gateway: an etcd, a coordinator, version v1 on a
prefill and a decode node, and two candidates each on one colocated node — `bad`, whose node
fails a fifth of its requests (`duet node --fail-fraction 0.2`), and `good` — with the official
openai client sending requests all along.

- `bad` rolled out at a 20 % canary is rolled back to 0 % by the gateway itself, within the
  policy's window; its failed attempts ran again on v1, so the client saw no error, and every
  request after the rollback runs on v1;
- `good` steps 20 → 50 → 100 % and the rollout ends `done`, with no client error.

Every request's legs stay on one version (its usage record's nodes are that version's).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from tests.gateway.helpers import ADMIN_KEY, gateway_proc, http, make_team
from tests.procs import TINY_NODE_ARGS, Proc, running, secured_plane
from tests.wait import wait_for

SECRET = secrets.token_urlsafe(24)
WINDOW_S = 20.0
POLICY = {
    "steps": [20, 50, 100],
    "step_interval_s": 1.0,
    "window_s": WINDOW_S,
    "max_error_rate": 0.1,
    "min_requests": 5,
}
NODES = {"v1": "prefill-v1 decode-v1", "bad": "both-bad", "good": "both-good"}


@dataclass
class Plane:
    gateway: Proc
    key: str


@pytest.fixture(scope="module")
def plane(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp("rollout-gw")
    bad = shutil.copytree(tiny_llama, tmp / "tiny-bad")  # its nodes register "tiny-bad"
    good = shutil.copytree(tiny_llama, tmp / "tiny-good")
    model = {
        "kind": "cluster",
        "tokenizer": str(tiny_llama),
        "versions": {
            "v1": {"served_name": tiny_llama.name, "weight": 100},
            "bad": {"served_name": bad.name, "weight": 0},
            "good": {"served_name": good.name, "weight": 0},
        },
        "rollout": POLICY,
    }
    with secured_plane(tmp, SECRET, "--local-prefill-tokens", "8") as p:
        nodes = [
            p.node("prefill", tiny_llama, *TINY_NODE_ARGS, node_id="prefill-v1"),
            p.node("decode", tiny_llama, *TINY_NODE_ARGS, node_id="decode-v1"),
            p.node("both", bad, *TINY_NODE_ARGS, "--fail-fraction", "0.2", node_id="both-bad"),
            p.node("both", good, *TINY_NODE_ARGS, node_id="both-good"),
        ]
        g = gateway_proc(
            tmp, {"tiny": model}, args=p.flag, routing={"coordinator": [p.coordinator.url]}
        )
        with running(p.coordinator, *nodes, g):
            p.wait_ready(set(NODES["v1"].split()) | {"both-bad", "both-good"})
            yield Plane(g, make_team(g.url, "alice"))


@dataclass
class Load:
    """Requests sent back to back by a few threads until stopped: their ids and errors."""

    client: openai.OpenAI
    rids: list[tuple[float, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def worker(self) -> None:
        prompt = "A rollout moves the requests from one version to the next. " * 2
        while not self.stop.is_set():
            try:
                r = self.client.completions.with_raw_response.create(
                    model="tiny", prompt=prompt, max_tokens=3, temperature=0
                )
                self.rids.append((time.time(), r.headers["x-request-id"]))
            except openai.APIError as e:
                self.errors.append(repr(e))


def _status(plane: Plane) -> dict:
    status, _, body = http(f"{plane.gateway.url}/admin/models/tiny/versions")
    assert status == 200, body
    return body


def _rollout(plane: Plane, **body: object) -> dict:
    status, _, got = http(f"{plane.gateway.url}/admin/models/tiny/rollout", "POST", body)
    assert status == 200, got
    return got


def _under_load(plane: Plane, until_phase: str, timeout: float) -> tuple[Load, dict]:
    client = openai.OpenAI(base_url=plane.gateway.url + "/v1", api_key=plane.key, max_retries=0)
    load = Load(client)
    with ThreadPoolExecutor(3) as pool:
        for _ in range(3):
            pool.submit(load.worker)
        try:
            got = wait_for(
                lambda: (s := _status(plane))["rollout"]["phase"] == until_phase and s,
                timeout=timeout,
                what=f"the rollout {until_phase}",
            )
        finally:
            load.stop.set()
    return load, got


def _versions(plane: Plane, rids: list[str], since: float) -> list[str]:
    """Each request's version, checked to have run on that version's nodes only."""
    url = f"{plane.gateway.url}/v1/usage?start={since}&end={time.time() + 1}&group_by=record"

    def records() -> dict[str, dict] | None:
        status, _, body = http(url + "&limit=10000", key=plane.key)
        assert status == 200, body
        got = {r["request_id"]: r for r in body["data"]}
        return got if set(rids) <= set(got) else None

    recs = wait_for(records, timeout=30, what="the usage records")
    for rid in rids:
        assert recs[rid]["nodes"] == NODES[recs[rid]["version"]], recs[rid]
    return [recs[rid]["version"] for rid in rids]


def test_a_failing_version_rolls_back_by_itself_and_the_client_sees_no_error(
    plane: Plane,
) -> None:
    since = time.time() - 1
    started = _rollout(plane, action="start", to="bad", canary=20)
    assert {v["name"]: v["weight"] for v in started["versions"]} == {
        "v1": 80,
        "bad": 20,
        "good": 0,
    }
    load, got = _under_load(plane, "rolled_back", timeout=60)
    assert load.errors == []
    events = got["rollout"]["events"]
    back = next(e for e in events if e["what"].startswith("rolled back"))
    assert back["at"] - events[0]["at"] <= WINDOW_S, events
    bad = next(v for v in got["versions"] if v["name"] == "bad")
    assert bad["weight"] == 0 and bad["failed"] >= 1, got["versions"]
    assert got["rollout"]["share"] == 0
    # bad answered the requests its node did not fail; each failed one was answered by v1
    versions = _versions(plane, [r for _, r in load.rids], since)
    assert set(versions) == {"v1", "bad"}
    # after the rollback: every request on v1, none failed
    client = openai.OpenAI(base_url=plane.gateway.url + "/v1", api_key=plane.key, max_retries=0)
    after = [
        client.completions.with_raw_response.create(
            model="tiny", prompt="After the rollback.", max_tokens=2, temperature=0
        ).headers["x-request-id"]
        for _ in range(6)
    ]
    assert _versions(plane, after, since) == ["v1"] * 6


def test_a_healthy_version_steps_up_to_every_request(plane: Plane) -> None:
    since = time.time() - 1
    _rollout(plane, action="start", to="good")
    load, got = _under_load(plane, "done", timeout=90)
    assert load.errors == []
    assert {v["name"]: v["weight"] for v in got["versions"]} == {"v1": 0, "bad": 0, "good": 100}
    shares = [e["weights"].get("good") for e in got["rollout"]["events"] if e["weights"]]
    assert shares[-3:] == [20, 50, 100], got["rollout"]["events"]
    versions = _versions(plane, [r for _, r in load.rids], since)
    assert "good" in versions and set(versions) <= {"v1", "good"}
    # its whole answers' inter-token latency is measured for the ITL bar
    good = next(v for v in got["versions"] if v["name"] == "good")
    assert good["itl_p90_s"] is not None and 0 < good["itl_p90_s"] < 5, good
    # the operator's view: `duet rollout status`, through the same admin API
    out = subprocess.run(
        [sys.executable, "-m", "duet", "rollout", "status", "tiny", "--gateway", plane.gateway.url],
        env={**os.environ, "DUET_ADMIN_KEY": ADMIN_KEY},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "model tiny: rollout done" in out and "v1 -> good: good at 100.0 %" in out, out


def test_the_admin_api_takes_the_admin_key_and_refuses_nonsense(plane: Plane) -> None:
    url = f"{plane.gateway.url}/admin/models/tiny/versions"
    assert http(url, key=plane.key)[0] == 401  # a team's key is not the admin's
    assert http(f"{plane.gateway.url}/admin/models/nope/versions")[0] == 404
    status, _, body = http(url, "PUT", {"weights": {"v1": -1}})
    assert status == 400 and ">= 0" in body["error"]["message"], body
    status, _, body = http(url, "PUT", {"weights": {"v9": 1}})
    assert status == 400 and "no version 'v9'" in body["error"]["message"], body
    status, _, body = http(
        f"{plane.gateway.url}/admin/models/tiny/rollout", "POST", {"action": "start"}
    )
    assert status == 400 and body["error"]["param"] == "to", body
    status, _, body = http(url, "PUT", {"weights": {"v1": 3, "good": 1}})
    assert status == 200, body
    assert {v["name"]: v["weight"] for v in body["versions"]} == {"v1": 3, "bad": 0, "good": 1}
