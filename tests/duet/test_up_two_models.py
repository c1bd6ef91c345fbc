"""`duet up --config cluster.toml` with two models: one on a prefill and a decode node, the
other on a colocated node. The gateway it writes serves both, `/v1/models` lists both to the
official openai client, and each model's requests run on its own nodes only (the usage
records' nodes).

Real processes: etcd, a coordinator, three nodes (tiny random models, the second a copy under
another directory name, which is the name it is served as), the gateway.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

from tests.duet.test_up import start_up, wait_banner
from tests.gateway.helpers import http
from tests.procs import free_port
from tests.wait import wait_for


def test_up_serves_a_pd_model_and_a_colocated_model(tiny_llama: Path, tmp_path: Path) -> None:
    other = shutil.copytree(tiny_llama, tmp_path / "tiny-colocated")
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        f'model = "{tiny_llama}"\n'
        # short prompts go P/D too (the default prefills them on the decode node)
        '[coordinator]\nargs = ["--local-prefill-tokens", "8"]\n'
        '[[nodes]]\nrole = "prefill"\n'
        '[[nodes]]\nrole = "decode"\n'
        f'[[nodes]]\nrole = "both"\nmodel = "{other}"\n'
    )
    home, port = tmp_path / "home", free_port()
    up = start_up(home, tiny_llama, port, tmp_path / "up.log", "--config", str(cluster))
    try:
        key = wait_banner(up)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        names = {m.id for m in client.models.list().data}
        assert {tiny_llama.name, other.name} <= names, names
        since = time.time() - 1
        rids = {}
        for name in (tiny_llama.name, other.name):
            r = client.completions.with_raw_response.create(
                model=name,
                prompt="Two models behind one gateway, each on its own nodes. " * 2,
                max_tokens=4,
                temperature=0,
            )
            assert r.parse().choices[0].text is not None
            rids[name] = r.headers["x-request-id"]
        q = f"{url}/v1/usage?start={since}&end={time.time() + 1}&group_by=record"

        def records() -> dict[str, dict] | None:
            status, _, body = http(q, key=key)
            assert status == 200, body
            got = {r["request_id"]: r for r in body["data"]}
            return got if set(rids.values()) <= set(got) else None

        recs = wait_for(records, timeout=30, what="the usage records")
        pd_nodes = recs[rids[tiny_llama.name]]["nodes"].split()
        both_nodes = recs[rids[other.name]]["nodes"].split()
        assert len(pd_nodes) == 2 and pd_nodes[0].startswith("prefill"), recs
        assert pd_nodes[1].startswith("decode"), recs
        assert len(both_nodes) == 1 and both_nodes[0].startswith("both"), recs
        # `duet rollout` finds this `duet up`'s gateway and admin key by itself; the model has
        # no versions, which the gateway says (a wrong key would be a 401)
        got = subprocess.run(
            [sys.executable, "-m", "duet", "rollout", "status", other.name],
            env={**os.environ, "DUET_HOME": str(home), "DUET_ADMIN_KEY": ""},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert got.returncode == 2 and "404" in got.stderr, got
        assert f"no model {other.name!r} with versions" in got.stderr, got
    finally:
        up.proc.send_signal(signal.SIGINT)
        up.proc.wait(120)
