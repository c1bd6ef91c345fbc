"""One traced cluster for the tracing and console tests (package scope: started once): a real
etcd, a coordinator, a prefill and a decode node on the tiny model, and the gateway routing
through the coordinator — every process exporting its spans over OTLP/HTTP to one receiver.

The coordinator runs the autoscaler (load mode, the virtual actuator: it only writes
`decision.json`) with prefill bounds of at least 2 replicas, so its first tick scales the one
prefill node's pool out (`below_min`) — a real decision for the console's Cluster page, and no
process is started or stopped by it."""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from coordinator.etcd_server import EtcdServer
from tests.gateway.helpers import ADMIN_KEY, make_team, write_config
from tests.observe.otlp import Receiver
from tests.pd_cluster import LOCAL_PREFILL_TOKENS, MODEL, PDCluster, cluster_model
from tests.procs import TINY_NODE_ARGS, Proc, duet_node, free_port, running
from tests.wait import wait_for


@dataclass(kw_only=True)
class Traced(PDCluster):
    """The cluster, every process exporting its spans to `receiver`; the internal plane behind
    the cluster secret (coordinator and nodes refuse a request without it)."""

    receiver: Receiver


@pytest.fixture(scope="package")
def traced(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    tmp = tmp_path_factory.mktemp("observe")
    with Receiver() as receiver, EtcdServer(tmp / "etcd") as etcd:
        # the SDK's batch processor exports every 100 ms here (5 s by default); the internal
        # plane behind a cluster secret, as in production (the traceparent travels beside it)
        secret = secrets.token_urlsafe(32)
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "DUET_CLUSTER_SECRET": secret,
            # one host: UCX keeps its shared-memory and cma transports, and no network device
            # but loopback goes into a worker's address. Otherwise a bridge another test makes
            # for a while (runtime/netns.py) is advertised too, and once it is gone the decode
            # node's connection to it is refused and the KV is recomputed, not pulled
            "UCX_NET_DEVICES": "lo",
        }
        port = free_port()
        (tmp / "planner.toml").write_text("interval_s = 1\n[bounds]\nprefill = [2, 3]\n")
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
                "--planner",
                "load",
                "--planner-config",
                str(tmp / "planner.toml"),
                "--actuator",
                "virtual",
                "--decision-file",
                str(tmp / "decision.json"),
            ],
            port,
            tmp / "coordinator.log",
            env=env,
        )
        p = duet_node(
            "prefill",
            str(tiny_llama),
            tmp,
            *TINY_NODE_ARGS,
            "--etcd",
            etcd.url,
            "--node-id",
            "prefill-0",
            env=env,
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
            env=env,
        )
        model = cluster_model(tiny_llama)
        gport = free_port()
        cfg = write_config(
            tmp / "gateway.toml",
            {MODEL: model},
            server={"port": gport},
            store={"url": f"sqlite://{tmp / 'gateway.db'}"},
            routing={"coordinator": [coord.url], "etcd": etcd.url},
            batch={"concurrency": 1, "poll_s": 0.1},
        )  # one line at a time: a batch to cancel
        g = Proc(
            [sys.executable, "-m", "duet", "gateway", "--config", str(cfg)],
            gport,
            tmp / "gateway.log",
            env={"DUET_ADMIN_KEY": ADMIN_KEY, **env},
        )
        with running(coord, p, d, g):
            t = Traced(
                receiver=receiver,
                etcd=etcd,
                coordinator=coord,
                prefill=p,
                decode=d,
                gateway=g,
                key=make_team(g.url, "observe"),
                model_dir=tiny_llama,
                tmp=tmp,
                secret=secret,
            )
            wait_for(lambda: {"prefill-0", "decode-0"} <= t.ready_nodes(), 60, "both nodes ready")
            yield t


def settle(what: str, cond, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    """wait_for, named for spans that arrive with the next export."""
    t0 = time.monotonic()
    return wait_for(cond, timeout, f"{what} ({time.monotonic() - t0:.1f} s)")


@pytest.fixture
async def closing() -> AsyncIterator[list[openai.AsyncOpenAI]]:
    """Async openai clients closed before the test's loop ends (their connections, not at GC)."""
    made: list[openai.AsyncOpenAI] = []
    yield made
    for c in made:
        await c.close()
