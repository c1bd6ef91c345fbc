"""The cluster `python -m bench.rollout` runs on: an etcd, a coordinator, version v1 of a model
on a prefill and a decode node, and two candidate versions on one colocated node each — `bad`
(`duet node --fail-fraction`) and `good` — behind one gateway whose `[models.NAME.rollout]` is
the bench's policy. Every version is the same weights under another directory name (symlinks),
so each registers its own served name. Every process is stopped when the block ends."""

from __future__ import annotations

import json
import secrets
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Proc, duet_node, free_port, running
from coordinator.etcd_server import EtcdServer

NODE_IDS = ("prefill-v1", "decode-v1", "both-bad", "both-good")


@dataclass(frozen=True)
class Plane:
    gateway: str
    admin_key: str
    api_key: str
    model: str


def _alias(model: Path, where: Path) -> Path:
    """`model`'s files under another directory name (the name its nodes register)."""
    where.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if not (where / f.name).exists():
            (where / f.name).symlink_to(f.resolve())
    return where


def _post(url: str, key: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _wait_ready(coordinator: str, secret: str, timeout: float = 120.0) -> None:
    req = urllib.request.Request(
        coordinator + "/cluster", headers={"Authorization": f"Bearer {secret}"}
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(req, timeout=5) as r:
            ready = {n["node_id"] for n in json.loads(r.read())["nodes"] if n["ready"]}
        if set(NODE_IDS) <= ready:
            return
        time.sleep(0.2)
    raise RuntimeError(f"nodes {NODE_IDS} not ready after {timeout:g} s")


def _gateway_toml(tmp: Path, port: int, model: Path, policy: dict[str, object]) -> Path:
    rollout = ", ".join(f"{k} = {json.dumps(v)}" for k, v in policy.items())
    text = f"""[server]
port = {port}
[store]
url = "sqlite://{tmp / "gateway.db"}"
[routing]
coordinator = ["{{coordinator}}"]
[models.tiny]
kind = "cluster"
tokenizer = "{model}"
versions.v1 = {{ served_name = "{model.name}", weight = 100 }}
versions.bad = {{ served_name = "{model.name}-bad", weight = 0 }}
versions.good = {{ served_name = "{model.name}-good", weight = 0 }}
rollout = {{ {rollout} }}
"""
    path = tmp / "gateway.toml"
    path.write_text(text)
    return path


@contextmanager
def plane(
    model: Path, tmp: Path, fail_fraction: float, policy: dict[str, object], node_args: list[str]
) -> Iterator[Plane]:
    secret, admin = secrets.token_urlsafe(24), secrets.token_urlsafe(32)
    secret_file = tmp / "cluster.secret"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    flag = ("--cluster-secret-file", str(secret_file))
    bad = _alias(model, tmp / f"{model.name}-bad")
    good = _alias(model, tmp / f"{model.name}-good")
    with EtcdServer(tmp / "etcd") as etcd:
        cport, gport = free_port(), free_port()
        coord = Proc(
            [sys.executable, "-m", "duet", "coordinator", "--etcd", etcd.url]
            + ["--port", str(cport), "--local-prefill-tokens", "8", *flag],
            cport,
            tmp / "coordinator.log",
        )
        common = [*node_args, "--etcd", etcd.url, *flag]
        faulty = ("--fail-fraction", str(fail_fraction))
        nodes = [
            duet_node("prefill", str(model), tmp, *common, "--node-id", "prefill-v1"),
            duet_node("decode", str(model), tmp, *common, "--node-id", "decode-v1"),
            duet_node("both", str(bad), tmp, *common, *faulty, "--node-id", "both-bad"),
            duet_node("both", str(good), tmp, *common, "--node-id", "both-good"),
        ]
        cfg = _gateway_toml(tmp, gport, model, policy)
        cfg.write_text(cfg.read_text().replace("{coordinator}", coord.url))
        gw = Proc(
            [sys.executable, "-m", "duet", "gateway", "--config", str(cfg), *flag],
            gport,
            tmp / "gateway.log",
            env={"DUET_ADMIN_KEY": admin},
        )
        with running(coord, *nodes, gw):
            _wait_ready(coord.url, secret)
            _post(gw.url + "/admin/teams", admin, {"id": "bench"})
            key = _post(gw.url + "/admin/keys", admin, {"team_id": "bench"})
            yield Plane(gw.url, admin, str(key["key"]), "tiny")
