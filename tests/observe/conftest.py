"""One traced cluster for the tracing and console tests (package scope: started once): a real
etcd, a coordinator, a prefill and a decode node on the tiny model, and the gateway routing
through the coordinator — every process exporting its spans over OTLP/HTTP to one receiver."""

from __future__ import annotations

import json
import secrets
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from coordinator.etcd_server import EtcdServer
from tests.gateway.helpers import ADMIN_KEY, make_team, write_config
from tests.observe.otlp import Receiver
from tests.procs import Proc, duet_node, free_port, running
from tests.wait import wait_for

MODEL = "tiny"
NODE_ARGS = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")
#: every prompt here is longer: disaggregated unless the decode node has it cached
LOCAL_PREFILL_TOKENS = 8


@dataclass
class Traced:
    receiver: Receiver
    etcd: EtcdServer
    coordinator: Proc
    prefill: Proc
    decode: Proc
    gateway: Proc
    key: str
    model_dir: Path
    tmp: Path

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=key or self.key, max_retries=0)


def _ready(coordinator: Proc, ids: set[str], secret: str) -> bool:
    req = urllib.request.Request(coordinator.url + "/cluster", headers={"Authorization": f"Bearer {secret}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        nodes = json.loads(r.read())["nodes"]
    return ids <= {n["node_id"] for n in nodes if n["ready"]}


@pytest.fixture(scope="package")
def traced(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    tmp = tmp_path_factory.mktemp("observe")
    with Receiver() as receiver, EtcdServer(tmp / "etcd") as etcd:
        # the SDK's batch processor exports every 100 ms here (5 s by default); the internal
        # plane behind a cluster secret, as in production (the traceparent travels beside it)
        secret = secrets.token_urlsafe(32)
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100",
               "DUET_CLUSTER_SECRET": secret}  # fmt: skip
        port = free_port()
        coord = Proc([sys.executable, "-m", "duet", "coordinator", "--etcd", etcd.url, "--port", str(port),
                      "--local-prefill-tokens", str(LOCAL_PREFILL_TOKENS)], port, tmp / "coordinator.log", env=env)  # fmt: skip
        p = duet_node("prefill", str(tiny_llama), tmp, *NODE_ARGS, "--etcd", etcd.url, "--node-id", "prefill-0", env=env)
        d = duet_node("decode", str(tiny_llama), tmp, *NODE_ARGS, "--etcd", etcd.url, "--node-id", "decode-0", env=env)
        model = {"kind": "cluster", "tokenizer": str(tiny_llama), "served_name": tiny_llama.name,
                 "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 2.0}  # fmt: skip
        gport = free_port()
        cfg = write_config(tmp / "gateway.toml", {MODEL: model}, server={"port": gport},
                           store={"url": f"sqlite://{tmp / 'gateway.db'}"},
                           routing={"coordinator": [coord.url], "etcd": etcd.url},
                           batch={"concurrency": 1, "poll_s": 0.1})  # one line at a time: a batch to cancel  # fmt: skip
        g = Proc([sys.executable, "-m", "duet", "gateway", "--config", str(cfg)], gport, tmp / "gateway.log",
                 env={"DUET_ADMIN_KEY": ADMIN_KEY, **env})  # fmt: skip
        with running(coord, p, d, g):
            wait_for(lambda: _ready(coord, {"prefill-0", "decode-0"}, secret), 60, "both nodes ready")
            yield Traced(receiver, etcd, coord, p, d, g, make_team(g.url, "observe"), tiny_llama, tmp)


def settle(what: str, cond, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    """wait_for, named for spans that arrive with the next export."""
    t0 = time.monotonic()
    return wait_for(cond, timeout, f"{what} ({time.monotonic() - t0:.1f} s)")
