"""A real P/D cluster of the tiny model behind a gateway, as the end-to-end suites hold it
(tests/e2e/test_cluster.py, and the traced one of tests/observe/conftest.py): its processes,
the gateway's model entry for it, and what a test asks of it — an openai client, the
coordinator's view, the nodes it calls ready.

Each suite starts its own processes (their flags, secret and exporters differ) inside its own
`running` block, which stops every one at the end, pass or fail.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from coordinator.etcd_server import EtcdServer
from tests.procs import Proc

#: the gateway's name for the cluster's model
MODEL = "tiny"
#: low enough that every prompt of these suites is disaggregated unless D has it cached
LOCAL_PREFILL_TOKENS = 8


def cluster_model(model_dir: Path) -> dict[str, Any]:
    """The gateway's config entry for the cluster's model (priced, so usage records a cost)."""
    return {
        "kind": "cluster",
        "tokenizer": str(model_dir),
        "served_name": model_dir.name,
        "input_usd_per_mtok": 1.0,
        "output_usd_per_mtok": 2.0,
    }


@dataclass(kw_only=True)
class PDCluster:
    etcd: EtcdServer
    coordinator: Proc
    prefill: Proc
    decode: Proc
    gateway: Proc
    #: a team's API key
    key: str
    model_dir: Path
    tmp: Path
    #: the internal plane's cluster secret ("": none; the coordinator then answers anyone)
    secret: str = ""

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.gateway.url + "/v1", api_key=key or self.key, max_retries=0
        )

    def cluster(self) -> dict[str, Any]:
        """The coordinator's `GET /cluster`."""
        headers = {"Authorization": f"Bearer {self.secret}"} if self.secret else {}
        req = urllib.request.Request(self.coordinator.url + "/cluster", headers=headers)
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def ready_nodes(self) -> set[str]:
        return {n["node_id"] for n in self.cluster()["nodes"] if n["ready"]}
